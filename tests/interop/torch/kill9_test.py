#!/usr/bin/python3
"""kill -9 of cohortd between two phases loses nothing a torch client wrote:
phase 1 (one process) sets keys, adds to counters, compare_sets and deletes
through torch.distributed.TCPStore; cohortd is killed with SIGKILL and
restarted on the same data dir and TCPStore port; phase 2 (a new process,
a new client) reads every key and counter back.

Against torch's own server (--backend=torch) nothing survives a kill, so the
phases run back to back without one: that only validates the test logic."""
import argparse
import json
import sys
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402

KEYS = 300
ADDS = 100


def extra_flags(p):
    p.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--kill_torch_server", action="store_true",
                   help="kill and restart torch's server too: the test must then fail")


def value(i):
    return (f"value-{i}-" + "x" * (i % 97)).encode() + bytes([i % 256])


def phase1(port):
    dist = ct.import_torch()
    s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    for i in range(KEYS):
        s.set(f"k9/key/{i}", value(i))
    last = 0
    for _ in range(ADDS):
        last = s.add("k9/counter", 3)
    s.compare_set("k9/cas", "", "v1")
    s.compare_set("k9/cas", "v1", "v2")
    s.set("k9/deleted", "gone soon")
    deleted = s.delete_key("k9/deleted")
    # Every write above has had its reply or was followed by one on the same
    # connection (set has no reply in 1.13): this read orders them all.
    marker = s.get(f"k9/key/{KEYS - 1}")
    print(json.dumps({"last_add": last, "deleted": deleted, "num_keys": s.num_keys(),
                      "marker_ok": marker == value(KEYS - 1)}))


def phase2(port):
    dist = ct.import_torch()

    def connect():
        s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        # Every key read here was acknowledged before the kill, so a present
        # one answers at once; the timeout only bounds what a lost key costs
        # (3 of them at most), long enough that a slow server is not taken
        # for a lost key.
        s.set_timeout(timedelta(seconds=10))
        return s

    s = connect()
    misses = []

    def read(key):
        """The value, or None once it timed out (1.13 leaves the timed-out
        WAIT pending on the connection, so the next read uses a new one)."""
        nonlocal s
        try:
            return s.get(key)
        except RuntimeError as e:
            misses.append(f"{key}: {e}")
            s = connect()
            return None

    wrong = []
    for i in range(KEYS):
        if len(misses) >= 3:
            wrong.append(f"gave up after 3 missing keys; {KEYS - i} keys unread")
            break
        got = read(f"k9/key/{i}")
        if got != value(i):
            wrong.append(f"k9/key/{i}: {got!r}")
    counter, cas = read("k9/counter"), read("k9/cas")
    print(json.dumps({"wrong": wrong[:20], "num_wrong": len(wrong),
                      "counter": counter and counter.decode(),
                      "counter_add0": s.add("k9/counter", 0),
                      "cas": cas and cas.decode(),
                      "deleted_again": s.delete_key("k9/deleted"),
                      "num_keys": s.num_keys()}))


def main():
    args = ct.parse_args(__doc__, extra_flags)
    if args.phase == 1:
        return phase1(args.port)
    if args.phase == 2:
        return phase2(args.port)
    ct.import_torch()
    c = ct.Checks("kill9_test")
    b = ct.Backend(args, "kill9")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    try:
        one = ct.run_phase(__file__, 1, b.port, ct.PYTHON)
        print(f"phase 1: {one}")
        c.eq("phase 1 last add", one["last_add"], 3 * ADDS)
        c.eq("phase 1 delete_key", one["deleted"], True)
        c.ok(one["marker_ok"], "phase 1 read back its last key wrong")
        if b.is_cohortd or args.kill_torch_server:
            pid, port = b.proc.pid, b.port
            b.kill9()
            c.eq("server died of SIGKILL", b.proc.returncode, -9)
            b.start(port=port)
            c.eq("restarted on the same TCPStore port", b.port, port)
            c.ok(b.proc.pid != pid, "server was not restarted")
        else:
            print("torch's server keeps nothing over a kill: phase 2 runs without one")
        two = ct.run_phase(__file__, 2, b.port, ct.PYTHON)
        print(f"phase 2: {two}")
        c.eq("keys lost or wrong after kill -9", two["num_wrong"], 0)
        c.eq("first wrong keys", two["wrong"], [])
        c.eq("counter after kill -9 (get)", two["counter"], str(3 * ADDS))
        c.eq("counter after kill -9 (add 0)", two["counter_add0"], 3 * ADDS)
        c.eq("compare_set value after kill -9", two["cas"], "v2")
        c.eq("deleted key stays deleted", two["deleted_again"], False)
        c.eq("num_keys after kill -9", two["num_keys"], one["num_keys"])
        if b.is_cohortd:
            c.eq("cohortctl get /k9/counter", b.ctl("get", "/k9/counter")[1], f"{3 * ADDS}")
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    sys.exit(main())
