#!/usr/bin/python3
"""torch.distributed.TCPStore (1.13) as a client of the store under test:
every Store operation 1.13's Python API has, its timeouts, and (against
cohortd) that torch and cohortctl see one key space."""
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402

dist = ct.import_torch()

# The 1.13 dialect's query codes (no handshake; keys carry torch's "/").
_CHECK, _WATCH_KEY = 4, 7
_READY, _NOT_READY = 0, 1


def _wire_key(key):
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw


def _recv_exactly(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


def raw_check(store, keys):
    """CHECK over a raw connection: 1.13's Python binding has no check()."""
    with socket.create_connection((store.host, store.port), timeout=10) as s:
        s.sendall(bytes([_CHECK]) + struct.pack("<Q", len(keys)) +
                  b"".join(_wire_key("/" + k) for k in keys))
        reply = _recv_exactly(s, 1)
    if reply == bytes([_READY]):
        return True
    if reply == bytes([_NOT_READY]):
        return False
    raise RuntimeError(f"CHECK answered {reply!r}, expected b'\\x00' or b'\\x01'")


def expect_timeout(c, what, fn, timeout_s):
    """fn must raise RuntimeError naming a timeout, not before timeout_s. The
    callers leave no other timeout that could end fn within the test (the
    clients' own are ct.Backend.LONG_S): one that ignored timeout_s hangs
    until the test's."""
    t0 = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        took = time.monotonic() - t0
        c.ok("timeout" in str(e).lower(), f"{what}: message names no timeout: {e!r}")
        # The timeout starts inside fn: it cannot have passed sooner (0.8:
        # slack for how torch measures and rounds it).
        c.ok(took >= timeout_s * 0.8,
             f"{what}: raised after {took:.2f}s, before its {timeout_s}s timeout")
        return
    except Exception as e:  # noqa: BLE001
        c.fail(f"{what}: raised {type(e).__name__} ({e}), expected RuntimeError as torch's server gives")
        return
    c.fail(f"{what}: returned after {time.monotonic() - t0:.2f}s instead of timing out")


def set_get(c, b):
    s = b.client(dist)
    s.set("sg/text", "hello")
    c.eq("get after set", s.get("sg/text"), b"hello")
    s.set("sg/text", b"again")
    c.eq("get after overwrite", s.get("sg/text"), b"again")
    blob = bytes(range(256)) * 64
    s.set("sg/binary", blob)
    c.eq("binary value (16 KiB, every byte value)", s.get("sg/binary"), blob)
    big = bytes(range(251)) * (4 * 1024 * 1024 // 251)
    s.set("sg/4mib", big)
    c.eq("a 4 MiB value comes back whole", s.get("sg/4mib") == big, True)
    s.set("sg/empty", b"")
    c.eq("empty value", s.get("sg/empty"), b"")
    other = b.client(dist)
    c.eq("another connection sees the value", other.get("sg/text"), b"again")


def add(c, b):
    s = b.client(dist)
    c.eq("add creates the counter", s.add("add/ctr", 5), 5)
    c.eq("add returns the new value", s.add("add/ctr", 2), 7)
    c.eq("add a negative delta", s.add("add/ctr", -10), -3)
    c.eq("add 0 reads the counter", s.add("add/ctr", 0), -3)
    c.eq("get of a counter is decimal text", s.get("add/ctr"), b"-3")
    s.set("add/fromtext", "41")
    c.eq("add to a decimal value set by set()", s.add("add/fromtext", 1), 42)
    big = 2**62
    c.eq("add keeps 64 bits", s.add("add/big", big), big)
    c.eq("get of a 64-bit counter", s.get("add/big"), str(big).encode())


def compare_set(c, b):
    s = b.client(dist)
    c.eq("compare_set missing+empty returns desired",
         s.compare_set("cas/a", "", "first"), b"first")
    c.eq("... and writes it", s.get("cas/a"), b"first")
    c.eq("compare_set missing+non-empty returns expected",
         s.compare_set("cas/b", "guess", "x"), b"guess")
    c.eq("... and writes nothing", raw_check(b, ["cas/b"]), False)
    c.eq("compare_set match returns the new value",
         s.compare_set("cas/a", "first", "second"), b"second")
    c.eq("... and replaces it", s.get("cas/a"), b"second")
    c.eq("compare_set mismatch returns the current value",
         s.compare_set("cas/a", "wrong", "third"), b"second")
    c.eq("... and keeps it", s.get("cas/a"), b"second")
    c.eq("compare_set present+empty expected is a mismatch",
         s.compare_set("cas/a", "", "fourth"), b"second")


def check(c, b):
    s = b.client(dist)
    s.set("chk/a", "1")
    s.add("chk/b", 1)
    c.eq("CHECK of present keys", raw_check(b, ["chk/a", "chk/b"]), True)
    c.eq("CHECK with one key missing", raw_check(b, ["chk/a", "chk/none"]), False)
    c.eq("CHECK of a missing key", raw_check(b, ["chk/none"]), False)


def wait(c, b):
    s = b.client(dist)
    s.set("w/a", "1")
    s.set("w/b", "2")
    # Present keys: returning at all says they were found (a wait that
    # blocked would raise its timeout instead).
    s.wait(["w/a", "w/b"])
    s.wait(["w/a", "w/b"], timedelta(seconds=1))

    done = threading.Event()
    errors = []

    def waiter():
        try:
            # No timeout within the test: only the keys can release it.
            b.client(dist, timeout_s=ct.Backend.LONG_S).wait(["w/late1", "w/late2"])
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        done.set()

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    time.sleep(0.5)
    c.ok(not done.is_set(), "wait returned before any awaited key existed")
    s.set("w/late1", "x")
    time.sleep(0.5)
    c.ok(not done.is_set(), "wait returned with one of two keys missing")
    s.add("w/late2", 1)  # add wakes waiters too
    if c.ok(done.wait(ct.GIVE_UP_S),
            f"wait not released by its last key being added (gave up after {ct.GIVE_UP_S} s)"):
        th.join()
    c.eq("released wait's errors", errors, [])

    expect_timeout(c, "wait(keys, 0.5s) of a missing key",
                   lambda: b.client(dist, timeout_s=ct.Backend.LONG_S).wait(
                       ["w/never"], timedelta(seconds=0.5)), 0.5)
    expect_timeout(c, "wait(keys) of a missing key under a 0.5s store timeout",
                   lambda: b.client(dist, timeout_s=0.5).wait(["w/never", "w/a"]), 0.5)


def get_timeout(c, b):
    expect_timeout(c, "get of a missing key under a 0.5s store timeout",
                   lambda: b.client(dist, timeout_s=0.5).get("gt/never"), 0.5)


def set_timeout(c, b):
    s = b.client(dist, timeout_s=ct.Backend.LONG_S)
    s.set_timeout(timedelta(seconds=0.4))
    c.eq("timeout after set_timeout", s.timeout, timedelta(seconds=0.4))
    expect_timeout(c, "get after set_timeout(0.4s)", lambda: s.get("st/never"), 0.4)
    s2 = b.client(dist, timeout_s=ct.Backend.LONG_S)
    s2.set_timeout(timedelta(seconds=0.4))
    expect_timeout(c, "wait after set_timeout(0.4s)", lambda: s2.wait(["st/never"]), 0.4)


def delete_key(c, b):
    s = b.client(dist)
    s.set("del/k", "v")
    c.eq("delete_key of a present key", s.delete_key("del/k"), True)
    c.eq("delete_key again", s.delete_key("del/k"), False)
    c.eq("delete_key of a never-set key", s.delete_key("del/never"), False)
    c.eq("CHECK after delete", raw_check(b, ["del/k"]), False)
    expect_timeout(c, "get of a deleted key",
                   lambda: b.client(dist, timeout_s=0.5).get("del/k"), 0.5)


def num_keys(c, b):
    s = b.client(dist)
    n0 = s.num_keys()
    c.ok(isinstance(n0, int) and n0 >= 0, f"num_keys: {n0!r}")
    s.set("nk/new", "1")
    c.eq("num_keys after a new key", s.num_keys(), n0 + 1)
    s.set("nk/new", "2")
    c.eq("num_keys after overwriting it", s.num_keys(), n0 + 1)
    s.add("nk/ctr", 1)
    c.eq("num_keys after a new counter", s.num_keys(), n0 + 2)
    s.delete_key("nk/new")
    c.eq("num_keys after a delete", s.num_keys(), n0 + 1)


def after_timed_out_wait(c, b):
    """1.13's client has no CANCEL_WAIT: after a wait times out, its next
    requests go on the same connection and must be served."""
    s = b.client(dist)
    expect_timeout(c, "wait(keys, 0.5s) before the next requests",
                   lambda: s.wait(["tw/late"], timedelta(seconds=0.5)), 0.5)
    s.set("tw/flag", "1")
    other = b.client(dist)
    c.eq("a set after a timed-out wait reaches another client",
         other.get("tw/flag"), b"1")
    c.eq("add after a timed-out wait", s.add("tw/ctr", 3), 3)
    c.eq("get after a timed-out wait", s.get("tw/flag"), b"1")
    c.eq("delete_key after a timed-out wait", s.delete_key("tw/flag"), True)
    if b.is_cohortd:
        # torch's own 1.13 server answers the old WAIT once its key appears,
        # and its client reads the next reply from that byte on.
        other.set("tw/late", "x")
        c.eq("add once the waited key appeared", s.add("tw/ctr", 1), 4)
        c.eq("get once the waited key appeared", s.get("tw/late"), b"x")


def cohortctl_sees_torch(c, b):
    s = b.client(dist)
    s.set("x/foo", "bar")
    s.add("x/ctr", 9)
    c.eq("cohortctl get /x/foo", b.ctl("get", "/x/foo", "--timeout=5"), (0, "bar", ""))
    c.eq("cohortctl get of torch's counter", b.ctl("get", "/x/ctr", "--timeout=5")[1], "9")
    rc, out, err = b.ctl("list", "/x/")
    c.eq(f"cohortctl list /x/ (stderr: {err})", out.split(), ["/x/ctr", "/x/foo"])
    rc, out, err = b.ctl("list")
    c.ok("/x/foo" in out.split(), f"cohortctl list lacks /x/foo: {out!r} {err}")
    c.eq("cohortctl add to torch's counter", b.ctl("add", "/x/ctr", "1")[1], "10\n")
    c.eq("torch get after cohortctl add", s.get("x/ctr"), b"10")


def torch_sees_cohortctl(c, b):
    s = b.client(dist)
    c.eq("cohortctl set /fromctl", b.ctl("set", "/fromctl", "hi there")[0], 0)
    c.eq("torch get of a key cohortctl set", s.get("fromctl"), b"hi there")
    c.eq("cohortctl add /ctlctr 4", b.ctl("add", "/ctlctr", "4")[1], "4\n")
    c.eq("torch add to cohortctl's counter", s.add("ctlctr", 1), 5)
    b.ctl("set", "/ctlcas", "v1")
    c.eq("torch compare_set on cohortctl's value", s.compare_set("ctlcas", "v1", "v2"), b"v2")
    c.eq("cohortctl sees the compare_set", b.ctl("get", "/ctlcas")[1], "v2")
    b.ctl("set", "/ctldel", "v")
    c.eq("torch delete_key of cohortctl's key", s.delete_key("ctldel"), True)
    c.eq("cohortctl check after torch's delete", b.ctl("check", "/ctldel")[1], "false\n")
    n = s.num_keys()
    rc, out, _ = b.ctl("num-keys")
    c.eq("torch num_keys equals cohortctl num-keys", str(n), out.strip())


def blocked_get_released(c, b):
    got = []

    def getter():
        try:
            # No timeout within the test: only the set can release it.
            got.append(b.client(dist, timeout_s=ct.Backend.LONG_S).get("late"))
        except Exception as e:  # noqa: BLE001
            got.append(e)

    th = threading.Thread(target=getter, daemon=True)
    th.start()
    time.sleep(0.7)
    c.ok(th.is_alive(), "torch get returned before the key existed")
    if b.is_cohortd:
        c.eq("cohortctl set /late", b.ctl("set", "/late", "it arrived")[0], 0)
    else:
        b.client(dist).set("late", "it arrived")
    th.join(ct.GIVE_UP_S)
    c.ok(not th.is_alive(),
         f"blocked get not released by the set (gave up after {ct.GIVE_UP_S} s)")
    c.eq("released get's value", got, [b"it arrived"])


def reserved_namespace(c, b):
    """cohortd's own records under /cohort/ are read-only to clients. torch's
    key "cohort/..." is "/cohort/..." on the wire: a write there closes the
    connection (the protocol has no error reply) and cohortd logs why."""
    s = b.client(dist)
    try:
        s.add("cohort/runs/x", 1)
        c.fail("torch add to cohort/runs/x succeeded")
    except Exception:  # noqa: BLE001 (torch reports the closed connection)
        pass
    deadline = time.monotonic() + ct.GIVE_UP_S
    while "reserved namespace" not in b.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    c.ok('ADD refused: key "/cohort/runs/x" is in cohortd\'s reserved namespace' in b.log_text(),
         "cohortd's log does not say why the ADD was refused")
    rc, _, err = b.ctl("set", "/cohort/runs/x", "v")
    c.eq("cohortctl set in /cohort/: exit status", rc, 1)
    c.ok("reserved namespace" in err, f"cohortctl's error does not name the namespace: {err!r}")
    c.eq("nothing was written under /cohort/", b.ctl("list", "/cohort/")[1], "")
    s2 = b.client(dist)
    s2.set("cohortx/y", "ok")
    c.eq("a key that only looks alike is the user's", s2.get("cohortx/y"), b"ok")


def watch_key_closes(c, b):
    """1.13's WATCH_KEY is unsupported by cohortd: the connection is closed,
    and the server goes on serving others."""
    with socket.create_connection((b.host, b.port), timeout=10) as s:
        s.sendall(bytes([_WATCH_KEY]) + _wire_key("/watched"))
        try:
            data = s.recv(16)
        except ConnectionResetError:
            data = b""
        c.eq("reply to WATCH_KEY (expected the connection closed)", data, b"")
    s2 = b.client(dist)
    s2.set("after/watch", "ok")
    c.eq("server serves after a WATCH_KEY", s2.get("after/watch"), b"ok")


def idle_connections_kept(c, args):
    """torch 1.13 never reconnects, so cohortd's --idle_timeout must not
    close a TCPStore connection, idle or blocked in a WAIT."""
    b = ct.Backend(args, "store_ops_idle")
    b.start(flags=["--idle_timeout=1s"])
    try:
        s = b.client(dist)
        s.set("idle/a", "1")
        got = []
        th = threading.Thread(
            target=lambda: got.append(b.client(dist, timeout_s=ct.Backend.LONG_S).get("idle/late")),
            daemon=True)
        th.start()
        time.sleep(2.5)
        c.eq("get on a connection idle for 2.5 s under --idle_timeout=1s", s.get("idle/a"), b"1")
        c.ok(th.is_alive(), "a get blocked for 2.5 s under --idle_timeout=1s ended early")
        s.set("idle/late", "x")
        th.join(ct.GIVE_UP_S)
        c.eq("the blocked get's value", got, [b"x"])
    finally:
        b.kill9()


def main():
    args = ct.parse_args(__doc__)
    c = ct.Checks("store_ops_test")
    b = ct.Backend(args, "store_ops")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    try:
        c.section("set/get", set_get, c, b)
        c.section("add", add, c, b)
        c.section("compare_set", compare_set, c, b)
        c.section("check (raw CHECK: 1.13 binds no check())", check, c, b)
        c.section("wait", wait, c, b)
        c.section("get timeout", get_timeout, c, b)
        c.section("set_timeout", set_timeout, c, b)
        c.section("delete_key", delete_key, c, b)
        c.section("num_keys", num_keys, c, b)
        c.section("blocked get released by another client", blocked_get_released, c, b)
        c.section("requests after a timed-out wait", after_timed_out_wait, c, b)
        if b.is_cohortd:
            c.section("cohortctl sees torch's keys", cohortctl_sees_torch, c, b)
            c.section("torch sees cohortctl's keys", torch_sees_cohortctl, c, b)
            c.section("writes to /cohort/ are refused", reserved_namespace, c, b)
            c.section("WATCH_KEY closes the connection", watch_key_closes, c, b)
            c.section("--idle_timeout keeps TCPStore connections", idle_connections_kept, c, args)
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    main()
