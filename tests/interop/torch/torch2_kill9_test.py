#!/usr/bin/env python3
"""kill -9 of cohortd between two phases loses nothing a torch 2.x client
wrote: phase 1 (one process, clients with use_libuv True and False) sets
keys, adds to counters, compare_sets, appends, multi_sets and deletes
through torch.distributed.TCPStore; cohortd (RocksDB engine, the default)
is killed with SIGKILL, while another client is blocked in a get, and
restarted on the same data dir and TCPStore port; phase 2 (a new process,
new clients) reads every key back with get, multi_get, list_keys and
num_keys, and the restarted cohortd serves blocking ops again. (Queues are
not written: their durability is not this test's.)

Against torch's own server (--backend=torch) nothing survives a kill, so the
phases run back to back without one: that only validates the test logic."""
import argparse
import json
import sys
import threading
import time
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402
import torch2_harness as t2  # noqa: E402

KEYS = 300
ADDS = 100


def extra_flags(p):
    p.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def value(i):
    return (f"value-{i}-" + "x" * (i % 97)).encode() + bytes([i % 256])


def connect(dist, port, use_libuv):
    return dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=use_libuv,
                         timeout=timedelta(seconds=30))


def phase1(port):
    dist = t2.import_torch2()
    uv, legacy = connect(dist, port, True), connect(dist, port, False)
    for i in range(KEYS):
        (uv if i % 2 else legacy).set(f"k9/key/{i}", value(i))
    last = 0
    for i in range(ADDS):
        last = (uv if i % 2 else legacy).add("k9/counter", 3)
    uv.compare_set("k9/cas", "", "v1")
    legacy.compare_set("k9/cas", "v1", "v2")

    def done(s):
        """set, append and multi_set have no reply, so two connections' are
        in no order: a round trip on s orders s's before what follows."""
        s.check(["k9/none"])

    uv.append("k9/log", "a")
    done(uv)
    legacy.append("k9/log", "b")
    done(legacy)
    uv.append("k9/log", "c")
    legacy.multi_set([f"k9/multi/{i}" for i in range(50)], [value(i) for i in range(50)])
    uv.set("k9/deleted", "gone soon")
    done(uv)
    deleted = legacy.delete_key("k9/deleted")
    # Every write above is acknowledged by this read on each connection:
    # replies come in order, and set/append/multi_set have none.
    ok = (uv.get(f"k9/key/{KEYS - 1}") == value(KEYS - 1) and
          legacy.get("k9/multi/49") == value(49) and uv.get("k9/log") == b"abc")
    print(json.dumps({"last_add": last, "deleted": deleted, "num_keys": uv.num_keys(),
                      "list_keys": sorted(uv.list_keys()), "marker_ok": ok}))


def phase2(port):
    dist = t2.import_torch2()
    # A present key answers at once: the timeout only bounds what a lost
    # key costs, long enough that a slow server is not taken for one.
    s = connect(dist, port, True)
    s.set_timeout(timedelta(seconds=10))
    legacy = connect(dist, port, False)
    legacy.set_timeout(timedelta(seconds=10))
    present = s.check([f"k9/key/{i}" for i in range(KEYS)] +
                      [f"k9/multi/{i}" for i in range(50)] + ["k9/counter", "k9/cas", "k9/log"])
    wrong = []
    if present:  # else multi_get would time out on the first lost key
        got = s.multi_get([f"k9/key/{i}" for i in range(KEYS)])
        wrong = [f"k9/key/{i}: {g!r}" for i, g in enumerate(got) if g != value(i)]
        got = legacy.multi_get([f"k9/multi/{i}" for i in range(50)])
        wrong += [f"k9/multi/{i}: {g!r}" for i, g in enumerate(got) if g != value(i)]
        wrong += [f"k9/key/{i} (get): {legacy.get(f'k9/key/{i}')!r}"
                  for i in range(0, KEYS, 37) if legacy.get(f"k9/key/{i}") != value(i)]
    print(json.dumps({
        "present": present, "wrong": wrong[:20], "num_wrong": len(wrong),
        "counter": present and s.get("k9/counter").decode(),
        "counter_add0": present and legacy.add("k9/counter", 0),
        "cas": present and s.get("k9/cas").decode(),
        "log": present and legacy.get("k9/log").decode(),
        "deleted_present": s.check(["k9/deleted"]),
        "deleted_again": s.delete_key("k9/deleted"),
        "num_keys": s.num_keys(), "list_keys": sorted(s.list_keys())}))


def main():
    args = ct.parse_args(__doc__, extra_flags)
    if args.phase == 1:
        return phase1(args.port)
    if args.phase == 2:
        return phase2(args.port)
    dist = t2.import_torch2()
    c = ct.Checks("torch2_kill9_test")
    b = ct.Backend(args, "torch2_kill9")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    try:
        one = ct.run_phase(__file__, 1, b.port, t2.PYTHON, 180)
        print(f"phase 1: num_keys {one['num_keys']}, {len(one['list_keys'])} keys listed")
        c.eq("phase 1 last add", one["last_add"], 3 * ADDS)
        c.eq("phase 1 delete_key", one["deleted"], True)
        c.ok(one["marker_ok"], "phase 1 read back its last writes wrong")
        if b.is_cohortd:
            # A client blocked in a get when the server dies: its connection
            # closes, so it fails at once (torch's client does not reconnect).
            blocked = []
            waiter = t2.client(dist, b, ct.Backend.LONG_S)

            def get_across_kill():
                try:
                    blocked.append(waiter.get("k9/never"))
                except Exception as e:  # noqa: BLE001
                    blocked.append(e)

            th = threading.Thread(target=get_across_kill, daemon=True)
            th.start()
            time.sleep(0.5)
            pid, port = b.proc.pid, b.port
            b.kill9()
            c.eq("server died of SIGKILL", b.proc.returncode, -9)
            th.join(ct.GIVE_UP_S)
            c.ok(not th.is_alive(), "a get blocked across the kill did not end")
            c.eq("a get blocked across the kill: exception",
                 type(blocked[0]).__name__ if blocked else None, "DistNetworkError")
            b.start(port=port)
            c.eq("restarted on the same TCPStore port", b.port, port)
            c.ok(b.proc.pid != pid, "server was not restarted")
        else:
            print("torch's server keeps nothing over a kill: phase 2 runs without one")
        two = ct.run_phase(__file__, 2, b.port, t2.PYTHON, 180)
        print(f"phase 2: {json.dumps({k: v for k, v in two.items() if k != 'list_keys'})}")
        c.ok(two["present"], "keys written before the kill are missing after it")
        c.eq("keys lost or wrong after kill -9", two["num_wrong"], 0)
        c.eq("first wrong keys", two["wrong"], [])
        c.eq("counter after kill -9 (get)", two["counter"], str(3 * ADDS))
        c.eq("counter after kill -9 (add 0)", two["counter_add0"], 3 * ADDS)
        c.eq("compare_set value after kill -9", two["cas"], "v2")
        c.eq("appended value after kill -9", two["log"], "abc")
        c.eq("deleted key stays deleted (check)", two["deleted_present"], False)
        c.eq("deleted key stays deleted (delete_key)", two["deleted_again"], False)
        c.eq("num_keys after kill -9", two["num_keys"], one["num_keys"])
        c.eq("list_keys after kill -9", two["list_keys"], one["list_keys"])
        s = t2.client(dist, b)
        got = []
        th = threading.Thread(target=lambda: got.append(
            t2.client(dist, b, ct.Backend.LONG_S).get("k9/after")), daemon=True)
        th.start()
        time.sleep(0.5)
        s.set("k9/after", "served")
        th.join(ct.GIVE_UP_S)
        c.eq("a blocked get released by a set after the restart", got, [b"served"])
        if b.is_cohortd:
            c.eq("cohortctl get /k9/counter", b.ctl("get", "/k9/counter")[1], f"{3 * ADDS}")
            c.eq("cohortctl get /k9/log", b.ctl("get", "/k9/log")[1], "abc")
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    sys.exit(main())
