#!/usr/bin/env python3
"""torch.distributed.TCPStore of PyTorch 2.x (the venv's) as a client of the
store under test: every Store operation 2.x's Python API has (set, get, add,
check, delete_key, num_keys, wait with and without a timeout, compare_set,
append, multi_get, multi_set, queue_push/queue_pop/queue_len, list_keys,
set_timeout, clone; 2.11 binds no barrier), their timeouts (the exception
type and message torch's own server gives), and against cohortd one key
space shared with cohortctl. Everything runs twice, on clients made with
use_libuv=True and use_libuv=False: the server is the same, but the client
side differs (a use_libuv=False client refuses queue ops itself).
--backend=torch runs the same checks against torch's own default server
(libuv), which they encode."""
import sys
import threading
import time
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402
import torch2_harness as t2  # noqa: E402

dist = t2.import_torch2()


class Run:
    """One pass of the checks: the clients' use_libuv and a key prefix of
    its own, so the two passes share no key."""

    def __init__(self, c, b, use_libuv):
        self.c, self.b, self.uv = c, b, use_libuv
        self.p = f"uv{int(use_libuv)}/"

    def client(self, timeout_s=10.0):
        return t2.client(dist, self.b, timeout_s, self.uv)

    def k(self, *names):
        """The pass's key for a name, or a list of them for several."""
        return [self.p + n for n in names] if len(names) > 1 else self.p + names[0]


def expect_timeout(c, what, fn, timeout_s, keys):
    """fn must raise what torch's server makes its client raise when a wait
    times out: DistStoreError (a RuntimeError) "wait timeout after {ms}ms,
    keys: /k1, /k2", and not before timeout_s. The callers leave no other
    timeout that could end fn within the test."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - t0
        c.eq(f"{what}: exception type", type(e).__name__, "DistStoreError")
        c.ok(isinstance(e, RuntimeError), f"{what}: {type(e).__name__} is no RuntimeError")
        c.eq(f"{what}: message", t2.timeout_message(e),
             (round(timeout_s * 1000), ", ".join("/" + k for k in keys)))
        # 0.8: slack for how torch measures and rounds it.
        c.ok(took >= timeout_s * 0.8,
             f"{what}: raised after {took:.2f}s, before its {timeout_s}s timeout")
        return
    c.fail(f"{what}: returned after {time.monotonic() - t0:.2f}s instead of timing out")


def released(c, what, start, release):
    """start() runs in a thread and must block until release() runs, then
    end. Returns what start returned (or raised)."""
    out = []

    def body():
        try:
            out.append(start())
        except Exception as e:  # noqa: BLE001
            out.append(e)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    time.sleep(0.5)
    c.ok(th.is_alive(), f"{what}: returned before it was released ({out})")
    release()
    th.join(ct.GIVE_UP_S)
    c.ok(not th.is_alive(), f"{what}: not released (gave up after {ct.GIVE_UP_S} s)")
    return out[0] if out else None


def set_get(r):
    c, s = r.c, r.client()
    s.set(r.k("sg/text"), "hello")
    c.eq("get after set", s.get(r.k("sg/text")), b"hello")
    s.set(r.k("sg/text"), b"again")
    c.eq("get after overwrite", s.get(r.k("sg/text")), b"again")
    blob = bytes(range(256)) * 64
    s.set(r.k("sg/binary"), blob)
    c.eq("binary value (16 KiB, every byte value)", s.get(r.k("sg/binary")), blob)
    big = bytes(range(251)) * (4 * 1024 * 1024 // 251)
    s.set(r.k("sg/4mib"), big)
    c.eq("a 4 MiB value comes back whole", s.get(r.k("sg/4mib")) == big, True)
    s.set(r.k("sg/empty"), b"")
    c.eq("empty value", s.get(r.k("sg/empty")), b"")
    s.set(r.k("sg/ключ with spaces"), "ü")
    c.eq("a UTF-8 key with spaces", s.get(r.k("sg/ключ with spaces")), "ü".encode())
    other = r.client()
    c.eq("another connection sees the value", other.get(r.k("sg/text")), b"again")


def add(r):
    c, s = r.c, r.client()
    c.eq("add creates the counter", s.add(r.k("add/ctr"), 5), 5)
    c.eq("add returns the new value", s.add(r.k("add/ctr"), 2), 7)
    c.eq("add a negative delta", s.add(r.k("add/ctr"), -10), -3)
    c.eq("add 0 reads the counter", s.add(r.k("add/ctr"), 0), -3)
    c.eq("get of a counter is decimal text", s.get(r.k("add/ctr")), b"-3")
    s.set(r.k("add/fromtext"), "41")
    c.eq("add to a decimal value set by set()", s.add(r.k("add/fromtext"), 1), 42)
    big = 2**62
    c.eq("add keeps 64 bits", s.add(r.k("add/big"), big), big)
    c.eq("get of a 64-bit counter", s.get(r.k("add/big")), str(big).encode())
    # torch's server cannot parse the value, drops the connection, and keeps
    # the value; its client raises DistNetworkError.
    s.set(r.k("add/text"), "abc")
    try:
        s.add(r.k("add/text"), 1)
        c.fail("add to a non-numeric value succeeded")
    except Exception as e:  # noqa: BLE001
        c.eq("add to a non-numeric value: exception", type(e).__name__, "DistNetworkError")
    c.eq("... leaves the value", r.client().get(r.k("add/text")), b"abc")


def compare_set(r):
    c, s = r.c, r.client()
    probe = r.client()
    c.eq("compare_set missing+empty returns desired",
         s.compare_set(r.k("cas/a"), "", "first"), b"first")
    c.eq("... and writes it", s.get(r.k("cas/a")), b"first")
    c.eq("compare_set missing+non-empty returns expected",
         s.compare_set(r.k("cas/b"), "guess", "x"), b"guess")
    c.eq("... and writes nothing", probe.check([r.k("cas/b")]), False)
    c.eq("compare_set match returns the new value",
         s.compare_set(r.k("cas/a"), "first", "second"), b"second")
    c.eq("... and replaces it", s.get(r.k("cas/a")), b"second")
    c.eq("compare_set mismatch returns the current value",
         s.compare_set(r.k("cas/a"), "wrong", "third"), b"second")
    c.eq("... and keeps it", s.get(r.k("cas/a")), b"second")
    c.eq("compare_set present+empty expected is a mismatch",
         s.compare_set(r.k("cas/a"), "", "fourth"), b"second")
    c.eq("compare_set expected == desired == current",
         s.compare_set(r.k("cas/a"), "second", "second"), b"second")
    s.set(r.k("cas/empty"), b"")
    c.eq("compare_set present+empty value, empty expected: a match",
         s.compare_set(r.k("cas/empty"), "", "filled"), b"filled")
    s.add(r.k("cas/ctr"), 12)
    c.eq("compare_set on a counter compares its decimal text",
         s.compare_set(r.k("cas/ctr"), "12", "20"), b"20")
    c.eq("... and add goes on from the new text", s.add(r.k("cas/ctr"), 1), 21)
    c.eq("compare_set binary values",
         s.compare_set(r.k("cas/bin"), b"", bytes([0, 255, 1])), bytes([0, 255, 1]))
    key = r.k("cas/waited")
    got = released(c, "wait released by compare_set creating the key",
                   lambda: r.client(ct.Backend.LONG_S).wait([key]),
                   lambda: s.compare_set(key, "", "v"))
    c.eq("... the wait's result", got, None)


def check(r):
    c, s = r.c, r.client()
    s.set(r.k("chk/a"), "1")
    s.add(r.k("chk/b"), 1)
    c.eq("check of present keys", s.check(r.k("chk/a", "chk/b")), True)
    c.eq("check with one key missing", s.check(r.k("chk/a", "chk/none")), False)
    c.eq("check of a missing key", s.check([r.k("chk/none")]), False)
    c.eq("check of no keys", s.check([]), True)
    s.delete_key(r.k("chk/a"))
    c.eq("check after delete", s.check([r.k("chk/a")]), False)


def wait(r):
    c, s = r.c, r.client()
    s.set(r.k("w/a"), "1")
    s.set(r.k("w/b"), "2")
    # Present keys: returning at all says they were found (a wait that
    # blocked would raise its timeout instead).
    s.wait(r.k("w/a", "w/b"))
    s.wait(r.k("w/a", "w/b"), timedelta(seconds=1))
    s.wait([])
    for how, release in [
            ("set", lambda k: s.set(k, "x")),
            ("add", lambda k: s.add(k, 1)),
            ("append", lambda k: s.append(k, "x")),
            ("multi_set", lambda k: s.multi_set([k], ["x"])),
            ("another client's set", lambda k: r.client().set(k, "x"))]:
        key = r.k(f"w/by/{how}")
        got = released(c, f"wait released by {how}",
                       lambda key=key: r.client(ct.Backend.LONG_S).wait([r.k("w/a"), key]),
                       lambda key=key, release=release: release(key))
        c.eq(f"wait released by {how}: result", got, None)
    done = threading.Event()
    th = threading.Thread(target=lambda: (r.client(ct.Backend.LONG_S).wait(
        r.k("w/late1", "w/late2")), done.set()), daemon=True)
    th.start()
    time.sleep(0.5)
    s.set(r.k("w/late1"), "x")
    time.sleep(0.5)
    c.ok(not done.is_set(), "wait returned with one of two keys missing")
    s.set(r.k("w/late2"), "x")
    c.ok(done.wait(ct.GIVE_UP_S), "wait of two keys not released by the second")

    expect_timeout(c, "wait(keys, 0.5s) of a missing key",
                   lambda: r.client(ct.Backend.LONG_S).wait(
                       r.k("w/never", "w/a"), timedelta(seconds=0.5)), 0.5,
                   r.k("w/never", "w/a"))
    expect_timeout(c, "wait(keys) under a 0.5s store timeout",
                   lambda: r.client(0.5).wait([r.k("w/never")]), 0.5, [r.k("w/never")])


def timed_out_then_served(r):
    """2.x's client cancels a timed-out wait (CANCEL_WAIT, answered
    WAIT_CANCELED) and goes on on the same connection: its next replies are
    its next requests', also once the waited key appears."""
    c, s = r.c, r.client(0.5)
    expect_timeout(c, "get of a missing key under a 0.5s store timeout",
                   lambda: s.get(r.k("tw/late")), 0.5, [r.k("tw/late")])
    # The next replies must come, not come fast: a loaded machine may take
    # longer than 0.5 s.
    s.set_timeout(timedelta(seconds=30))
    s.set(r.k("tw/flag"), "1")
    c.eq("get after a timed-out get", s.get(r.k("tw/flag")), b"1")
    c.eq("add after a timed-out get", s.add(r.k("tw/ctr"), 3), 3)
    r.client().set(r.k("tw/late"), "arrived")
    c.eq("add once the waited key appeared", s.add(r.k("tw/ctr"), 1), 4)
    c.eq("get of the key once it appeared", s.get(r.k("tw/late")), b"arrived")
    c.eq("check on the same connection", s.check([r.k("tw/late")]), True)
    s.set_timeout(timedelta(seconds=0.5))
    expect_timeout(c, "multi_get with one key missing",
                   lambda: s.multi_get(r.k("tw/flag", "tw/never")), 0.5,
                   r.k("tw/flag", "tw/never"))
    s.set_timeout(timedelta(seconds=30))
    c.eq("multi_get after a timed-out multi_get", s.multi_get(r.k("tw/flag", "tw/late")),
         [b"1", b"arrived"])


def set_timeout(r):
    c = r.c
    s = r.client(ct.Backend.LONG_S)
    s.set_timeout(timedelta(seconds=0.4))
    c.eq("timeout after set_timeout", s.timeout, timedelta(seconds=0.4))
    expect_timeout(c, "get after set_timeout(0.4s)", lambda: s.get(r.k("st/never")), 0.4,
                   [r.k("st/never")])
    expect_timeout(c, "wait after set_timeout(0.4s)", lambda: s.wait([r.k("st/never")]), 0.4,
                   [r.k("st/never")])
    s.set_timeout(timedelta(seconds=0.7))
    expect_timeout(c, "wait(keys, 0.3s) overrides the store's 0.7s",
                   lambda: s.wait([r.k("st/never")], timedelta(seconds=0.3)), 0.3,
                   [r.k("st/never")])


def delete_key(r):
    c, s = r.c, r.client()
    s.set(r.k("del/k"), "v")
    c.eq("delete_key of a present key", s.delete_key(r.k("del/k")), True)
    c.eq("delete_key again", s.delete_key(r.k("del/k")), False)
    c.eq("delete_key of a never-set key", s.delete_key(r.k("del/never")), False)
    s.add(r.k("del/ctr"), 5)
    c.eq("delete_key of a counter", s.delete_key(r.k("del/ctr")), True)
    c.eq("add after delete starts again", s.add(r.k("del/ctr"), 1), 1)
    expect_timeout(c, "get of a deleted key",
                   lambda: r.client(0.5).get(r.k("del/k")), 0.5, [r.k("del/k")])


def num_keys(r):
    c, s = r.c, r.client()
    n0 = s.num_keys()
    c.ok(isinstance(n0, int) and n0 >= 0, f"num_keys: {n0!r}")
    s.set(r.k("nk/new"), "1")
    c.eq("num_keys after a new key", s.num_keys(), n0 + 1)
    s.set(r.k("nk/new"), "2")
    c.eq("num_keys after overwriting it", s.num_keys(), n0 + 1)
    s.add(r.k("nk/ctr"), 1)
    c.eq("num_keys after a new counter", s.num_keys(), n0 + 2)
    s.multi_set(r.k("nk/m1", "nk/m2"), ["a", "b"])
    c.eq("num_keys after multi_set of 2 new keys", s.num_keys(), n0 + 4)
    s.delete_key(r.k("nk/new"))
    c.eq("num_keys after a delete", s.num_keys(), n0 + 3)


def init_key(r):
    """A client given world_size ADDs 1 to the unprefixed key "init/" (the
    server-side TCPStore counts its workers there): num_keys counts it,
    list_keys (which keeps only torch's "/" keys) does not show it."""
    c, s = r.c, r.client()
    n0, listed0 = s.num_keys(), set(s.list_keys())
    dist.TCPStore(r.b.host, r.b.port, world_size=3, is_master=False, use_libuv=r.uv,
                  timeout=timedelta(seconds=30))
    # The use_libuv=True pass runs first, on a fresh store.
    c.eq("num_keys after a world_size client", s.num_keys(), n0 + (1 if r.uv else 0))
    dist.TCPStore(r.b.host, r.b.port, world_size=3, is_master=False, use_libuv=r.uv,
                  timeout=timedelta(seconds=30))
    c.eq("num_keys after a second one (the same init/)", s.num_keys(),
         n0 + (1 if r.uv else 0))
    c.eq("list_keys does not show init/", set(s.list_keys()), listed0)
    c.eq("check(['init/']) (the client looks for '/init/')", s.check(["init/"]), False)
    if r.b.is_cohortd:
        rc, out, err = r.b.ctl("get", "init/", "--timeout=5")
        c.ok(rc == 0 and int(out) >= 2, f"cohortctl get init/: {rc} {out!r} {err}")


def append(r):
    c, s = r.c, r.client()
    s.append(r.k("ap/x"), "ab")
    c.eq("append to a missing key creates it", s.get(r.k("ap/x")), b"ab")
    s.append(r.k("ap/x"), b"\x00cd")
    c.eq("append concatenates", s.get(r.k("ap/x")), b"ab\x00cd")
    s.append(r.k("ap/x"), b"")
    c.eq("append of nothing", s.get(r.k("ap/x")), b"ab\x00cd")
    s.add(r.k("ap/ctr"), 5)
    s.append(r.k("ap/ctr"), "7")
    c.eq("append to a counter's text", s.get(r.k("ap/ctr")), b"57")
    c.eq("add to the appended counter", s.add(r.k("ap/ctr"), 1), 58)
    key = r.k("ap/waited")
    released(c, "wait released by append creating the key",
             lambda: r.client(ct.Backend.LONG_S).wait([key]), lambda: s.append(key, "v"))


def multi(r):
    c, s = r.c, r.client()
    keys = r.k("mu/a", "mu/b", "mu/c")
    s.multi_set(keys, ["1", b"\x00two", ""])
    c.eq("multi_get in the order asked", s.multi_get(keys[::-1]), [b"", b"\x00two", b"1"])
    c.eq("get of a multi_set key", s.get(keys[1]), b"\x00two")
    s.multi_set(keys[:2], ["one", "2"])
    c.eq("multi_set overwrites", s.multi_get(keys), [b"one", b"2", b""])
    c.eq("multi_get of the same key twice", s.multi_get([keys[0], keys[0]]), [b"one", b"one"])
    c.eq("multi_get of no keys", s.multi_get([]), [])
    s.multi_set([], [])
    c.eq("multi_set of no keys changes nothing", s.multi_get(keys), [b"one", b"2", b""])
    late = r.k("mu/late")
    got = released(c, "multi_get blocked until its last key is set",
                   lambda: r.client(ct.Backend.LONG_S).multi_get([keys[0], late]),
                   lambda: s.set(late, "here"))
    c.eq("multi_get released: values", got, [b"one", b"here"])
    expect_timeout(c, "multi_get of a missing key under a 0.5s store timeout",
                   lambda: r.client(0.5).multi_get([keys[0], r.k("mu/never")]), 0.5,
                   [keys[0], r.k("mu/never")])


def queues(r):
    c, s = r.c, r.client()
    q = r.k("q/fifo")
    if not r.uv:
        # torch refuses them in the client: nothing reaches the server.
        for name, call in [("queue_push", lambda: s.queue_push(q, "a")),
                           ("queue_pop", lambda: s.queue_pop(q, block=False)),
                           ("queue_len", lambda: s.queue_len(q))]:
            try:
                call()
                c.fail(f"{name} on a use_libuv=False client succeeded")
            except NotImplementedError as e:
                c.eq(f"{name} on a use_libuv=False client", str(e),
                     "queues not implemented on legacy TCPStore backend")
        c.eq("the client serves after refusing queue ops", s.add(r.k("q/after"), 1), 1)
        return
    c.eq("queue_len of a queue never pushed", s.queue_len(q), 0)
    n0 = s.num_keys()
    s.queue_push(q, "a")
    s.queue_push(q, b"\x00b")
    s.queue_push(q, "")
    c.eq("queue_len after 3 pushes", s.queue_len(q), 3)
    c.eq("check of a non-empty queue's key", s.check([q]), True)
    s.wait([q], timedelta(seconds=5))  # a non-empty queue's key is present
    c.eq("queues are not counted by num_keys", s.num_keys(), n0)
    c.ok(q not in s.list_keys(), "list_keys lists a queue")
    c.eq("delete_key of a queue's key", s.delete_key(q), False)
    c.eq("... leaves the queue", s.queue_len(q), 3)
    c.eq("queue_pop: first in first out", s.queue_pop(q), b"a")
    c.eq("queue_pop(block=False)", s.queue_pop(q, block=False), b"\x00b")
    c.eq("queue_pop of an empty value", s.queue_pop(q, block=False), b"")
    c.eq("queue_len after popping all", s.queue_len(q), 0)
    c.eq("check of an emptied queue's key", s.check([q]), False)
    try:
        s.queue_pop(q, block=False)
        c.fail("queue_pop(block=False) of an empty queue returned")
    except Exception as e:  # noqa: BLE001
        c.eq("queue_pop(block=False) of an empty queue: exception",
             (type(e).__name__, str(e)), ("QueueEmptyError", "queue is empty"))
        c.ok(isinstance(e, dist.DistStoreError), "QueueEmptyError is no DistStoreError")
    c.eq("the client serves after QueueEmptyError", s.queue_len(q), 0)
    got = released(c, "queue_pop blocked until another client pushes",
                   lambda: r.client(ct.Backend.LONG_S).queue_pop(q),
                   lambda: r.client().queue_push(q, "pushed"))
    c.eq("blocked queue_pop's value", got, b"pushed")
    released(c, "wait on an empty queue's key released by queue_push",
             lambda: r.client(ct.Backend.LONG_S).wait([r.k("q/w")]),
             lambda: s.queue_push(r.k("q/w"), "x"))
    expect_timeout(c, "blocking queue_pop of an empty queue under a 0.5s store timeout",
                   lambda: r.client(0.5).queue_pop(r.k("q/empty")), 0.5, [r.k("q/empty")])

    # One push releases one of two blocked pops; a second push the other.
    two = r.k("q/two")
    results, lock = [], threading.Lock()

    def popper():
        v = r.client(ct.Backend.LONG_S).queue_pop(two)
        with lock:
            results.append(v)

    threads = [threading.Thread(target=popper, daemon=True) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.7)
    s.queue_push(two, "one")
    deadline = time.monotonic() + ct.GIVE_UP_S
    while not results and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    c.eq("two blocked pops, one push: values popped", list(results), [b"one"])
    s.queue_push(two, "two")
    for th in threads:
        th.join(ct.GIVE_UP_S)
    c.eq("... after a second push", sorted(results), [b"one", b"two"])
    c.eq("queue_len after both pops", s.queue_len(two), 0)


def list_keys(r):
    """list_keys: the "/" keys without their "/". torch's libuv server lists
    them in hash order, cohortd in key order: the test compares sets."""
    c, s = r.c, r.client()
    mine = r.k("lk/a", "lk/b/c", "lk/ctr")
    s.set(mine[0], "1")
    s.set(mine[1], "2")
    s.add(mine[2], 3)
    listed = s.list_keys()
    c.ok(all(isinstance(k, str) for k in listed), f"list_keys returned {listed!r}")
    c.eq("list_keys has each key once", len(listed), len(set(listed)))
    c.eq("list_keys of this pass's lk/ keys",
         sorted(k for k in listed if k.startswith(r.k("lk/"))), sorted(mine))
    # The init/ section made init/, counted and not listed.
    c.eq("num_keys - len(list_keys) (init/)", s.num_keys() - len(listed), 1)
    s.delete_key(mine[0])
    c.ok(mine[0] not in s.list_keys(), "list_keys lists a deleted key")


def clone(r):
    c, s = r.c, r.client()
    c.eq("has_extended_api", s.has_extended_api(), True)
    c.eq("libuvBackend (the client's use_libuv)", s.libuvBackend, r.uv)
    s.set(r.k("cl/a"), "1")
    twin = s.clone()
    c.eq("a clone sees the store", twin.get(r.k("cl/a")), b"1")
    # A clone is a connection of its own: it blocks while the original works.
    got = released(c, "a clone's get blocked while the original sets",
                   lambda: twin.get(r.k("cl/late")), lambda: s.set(r.k("cl/late"), "2"))
    c.eq("the clone's value", got, b"2")
    c.eq("clone's timeout", twin.timeout, s.timeout)


def outcome(r, fn):
    """What fn does on a connection of its own: ("ok", its result) or
    ("closed", None) when the server dropped the connection (torch's client
    raises DistNetworkError; neither server has an error reply)."""
    try:
        return ("ok", fn(r.client()))
    except dist.DistNetworkError:
        return ("closed", None)


def limits(r):
    """Sizes and ranges at their edges. Where cohortd's answer is not
    torch's, both are written here, each checked against its own server,
    and the line says so: a change on either side fails the test."""
    c, b = r.c, r.b
    mib8 = 8 << 20

    def differs(what, got, torch_does, cohortd_does):
        want = cohortd_does if b.is_cohortd else torch_does
        if c.eq(what, got, want) and torch_does != cohortd_does:
            print(f"   known difference: {what}: torch's server {torch_does}, "
                  f"cohortd {cohortd_does}", flush=True)

    def set_get(key, value):
        return lambda s: (s.set(key, value), len(s.get(key)))[1]

    # torch's libuv server takes strings up to 8 KiB (MAX_STRING_LEN); the
    # client puts "/" before the key. cohortd takes keys up to
    # --max_key_bytes, 4096 by default.
    c.eq("a key of 4096 bytes on the wire",
         outcome(r, set_get(r.k("k" * (4095 - len(r.p))), "v")), ("ok", 1))
    differs("a key of 4097 bytes on the wire",
            outcome(r, set_get(r.k("k" * (4096 - len(r.p))), "v")), ("ok", 1), ("closed", None))
    differs("a key of 8192 bytes on the wire",
            outcome(r, set_get(r.k("k" * (8191 - len(r.p))), "v")), ("ok", 1), ("closed", None))
    c.eq("a key of 8193 bytes on the wire",
         outcome(r, set_get(r.k("k" * (8192 - len(r.p))), "v")), ("closed", None))
    if b.is_cohortd:
        c.ok("is over max_key_bytes (4096 bytes)" in b.log_text(),
             "cohortd's log does not say why it closed the connection of a long key")
    # Values: 8 MiB in both (MAX_PAYLOAD_LEN; --max_value_bytes).
    c.eq("a value of 8 MiB", outcome(r, set_get(r.k("lim/v8"), b"x" * mib8)), ("ok", mib8))
    c.eq("a value of 8 MiB + 1", outcome(r, set_get(r.k("lim/v9"), b"x" * (mib8 + 1))),
         ("closed", None))
    c.eq("multi_set of a value of 8 MiB + 1",
         outcome(r, lambda s: s.multi_set([r.k("lim/m9")], [b"x" * (mib8 + 1)])), ("closed", None))
    c.eq("compare_set of a desired value of 8 MiB + 1",
         outcome(r, lambda s: s.compare_set(r.k("lim/c9"), "", b"x" * (mib8 + 1))),
         ("closed", None))
    # torch's server checks an APPEND's bytes, not the value they make.
    s = r.client()
    s.set(r.k("lim/ap"), b"x" * mib8)
    s.check([r.k("lim/ap")])  # a reply: the set is done before the append
    differs("append of 1 byte to a value of 8 MiB",
            outcome(r, lambda s: (s.append(r.k("lim/ap"), b"y"), len(s.get(r.k("lim/ap"))))[1]),
            ("ok", mib8 + 1), ("closed", None))
    # torch's server adds int64s with wrap-around; cohortd refuses to.
    top = 2**63 - 1
    r.client().add(r.k("lim/ovf"), top)
    differs("add 1 to INT64_MAX",
            outcome(r, lambda s: s.add(r.k("lim/ovf"), 1)), ("ok", -2**63), ("closed", None))
    differs("... the counter after it", r.client().get(r.k("lim/ovf")),
            str(-2**63).encode(), str(top).encode())


def torch_key_sizes(c, args):
    """cohortd --max_key_bytes=8192 takes the keys torch's server takes."""
    b = ct.Backend(args, "torch2_store_keys8k")
    b.start(flags=["--max_key_bytes=8192", "--engine=memory"])
    try:
        r = Run(c, b, True)
        c.eq("--max_key_bytes=8192: a key of 8192 bytes on the wire",
             outcome(r, lambda s: (s.set("k" * 8191, "v"), s.get("k" * 8191))[1]), ("ok", b"v"))
        c.eq("--max_key_bytes=8192: a key of 8193 bytes on the wire",
             outcome(r, lambda s: (s.set("k" * 8192, "v"), s.get("k" * 8192))[1]),
             ("closed", None))
    finally:
        b.kill9()


def cohortctl_sees_torch(r):
    c, b, s = r.c, r.b, r.client()
    p = "/" + r.p + "x/"
    s.set(r.k("x/foo"), "bar")
    s.add(r.k("x/ctr"), 9)
    s.append(r.k("x/ap"), "a")
    s.append(r.k("x/ap"), "b")
    s.multi_set(r.k("x/m1", "x/m2"), ["v1", "v2"])
    s.compare_set(r.k("x/cas"), "", "c1")
    for key, want in [("foo", "bar"), ("ctr", "9"), ("ap", "ab"), ("m1", "v1"), ("m2", "v2"),
                      ("cas", "c1")]:
        c.eq(f"cohortctl get {p}{key}", b.ctl("get", p + key, "--timeout=5"), (0, want, ""))
    rc, out, err = b.ctl("list", p)
    c.eq(f"cohortctl list {p} (stderr: {err})", out.split(),
         [p + k for k in ["ap", "cas", "ctr", "foo", "m1", "m2"]])
    c.eq("torch list_keys and cohortctl list name the same keys",
         sorted("/" + k for k in s.list_keys() if k.startswith(r.k("x/"))), out.split())
    c.eq("cohortctl add to torch's counter", b.ctl("add", p + "ctr", "1")[1], "10\n")
    c.eq("torch get after cohortctl add", s.get(r.k("x/ctr")), b"10")
    c.eq("cohortctl cas on torch's value", b.ctl("cas", p + "cas", "c1", "c2")[1], "c2")
    c.eq("torch get after cohortctl cas", s.get(r.k("x/cas")), b"c2")
    c.eq("cohortctl delete of torch's key", b.ctl("delete", p + "foo")[1], "true\n")
    c.eq("torch check after cohortctl delete", s.check([r.k("x/foo")]), False)


def torch_sees_cohortctl(r):
    c, b, s = r.c, r.b, r.client()
    p = "/" + r.p + "y/"
    c.eq("cohortctl set", b.ctl("set", p + "fromctl", "hi there")[0], 0)
    c.eq("torch get of a key cohortctl set", s.get(r.k("y/fromctl")), b"hi there")
    c.eq("torch check of it", s.check([r.k("y/fromctl")]), True)
    b.ctl("set", p + "two", "2")
    c.eq("torch multi_get of cohortctl's keys", s.multi_get(r.k("y/fromctl", "y/two")),
         [b"hi there", b"2"])
    c.ok(r.k("y/two") in s.list_keys(), "torch list_keys lacks cohortctl's key")
    c.eq("cohortctl add", b.ctl("add", p + "ctlctr", "4")[1], "4\n")
    c.eq("torch add to cohortctl's counter", s.add(r.k("y/ctlctr"), 1), 5)
    s.append(r.k("y/two"), "3")
    s.check([r.k("y/two")])  # a reply: the append (which has none) is done
    c.eq("cohortctl get after torch's append", b.ctl("get", p + "two")[1], "23")
    b.ctl("set", p + "ctlcas", "v1")
    c.eq("torch compare_set on cohortctl's value", s.compare_set(r.k("y/ctlcas"), "v1", "v2"),
         b"v2")
    c.eq("cohortctl sees the compare_set", b.ctl("get", p + "ctlcas")[1], "v2")
    b.ctl("set", p + "ctldel", "v")
    c.eq("torch delete_key of cohortctl's key", s.delete_key(r.k("y/ctldel")), True)
    c.eq("cohortctl check after torch's delete", b.ctl("check", p + "ctldel")[1], "false\n")
    got = released(c, "torch get blocked until cohortctl sets the key",
                   lambda: r.client(ct.Backend.LONG_S).get(r.k("y/late")),
                   lambda: b.ctl("set", p + "late", "it arrived"))
    c.eq("released get's value", got, b"it arrived")
    released(c, "torch wait blocked until cohortctl adds to the key",
             lambda: r.client(ct.Backend.LONG_S).wait([r.k("y/late2")]),
             lambda: b.ctl("add", p + "late2", "1"))
    rc, out, _ = b.ctl("get", "/" + r.k("y/late2"), "--timeout=5")
    c.eq("cohortctl get of its own counter", out, "1")
    n = s.num_keys()
    rc, out, _ = b.ctl("num-keys")
    c.eq("torch num_keys equals cohortctl num-keys", str(n), out.strip())


def cohortctl_waits_for_torch(r):
    c, b, s = r.c, r.b, r.client()
    key = r.k("z/late")
    out = []
    th = threading.Thread(target=lambda: out.append(
        b.ctl("wait", "/" + key, "--timeout=60", timeout=90)), daemon=True)
    th.start()
    time.sleep(0.7)
    c.ok(th.is_alive(), f"cohortctl wait returned before torch set the key: {out}")
    s.set(key, "now")
    th.join(ct.GIVE_UP_S)
    c.eq("cohortctl wait released by torch's set: exit status", out and out[0][0], 0)


def main():
    args = ct.parse_args(__doc__)
    c = ct.Checks("torch2_store_test")
    b = ct.Backend(args, "torch2_store")
    b.start()
    import torch
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}; clients: torch "
          f"{torch.__version__}", flush=True)
    try:
        for uv in (True, False):
            r = Run(c, b, uv)
            tag = f"[use_libuv={uv}]"
            c.section(f"{tag} set/get", set_get, r)
            c.section(f"{tag} add", add, r)
            c.section(f"{tag} compare_set", compare_set, r)
            c.section(f"{tag} check", check, r)
            c.section(f"{tag} wait", wait, r)
            c.section(f"{tag} requests after a timed-out get", timed_out_then_served, r)
            c.section(f"{tag} set_timeout", set_timeout, r)
            c.section(f"{tag} delete_key", delete_key, r)
            c.section(f"{tag} num_keys", num_keys, r)
            c.section(f"{tag} init/ of world_size clients", init_key, r)
            c.section(f"{tag} append", append, r)
            c.section(f"{tag} multi_get/multi_set", multi, r)
            c.section(f"{tag} queues", queues, r)
            c.section(f"{tag} list_keys", list_keys, r)
            c.section(f"{tag} clone", clone, r)
            c.section(f"{tag} limits", limits, r)
            if b.is_cohortd:
                c.section(f"{tag} cohortctl sees torch's keys", cohortctl_sees_torch, r)
                c.section(f"{tag} torch sees cohortctl's keys", torch_sees_cohortctl, r)
                c.section(f"{tag} cohortctl wait released by torch", cohortctl_waits_for_torch, r)
        if b.is_cohortd:
            c.section("torch's key sizes on cohortd --max_key_bytes=8192", torch_key_sizes, c, args)
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    main()
