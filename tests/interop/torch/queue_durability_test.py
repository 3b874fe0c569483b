#!/usr/bin/env python3
"""torch 2.x's own TCPStore client (queue_push / queue_pop / queue_len)
against cohortd: phase 1 (one process) pushes items and pops a few; cohortd
is killed with SIGKILL and restarted on the same data dir and TCPStore port;
phase 2 (a new process, new clients) finds every unpopped item, pops them in
push order (block=True and block=False), and has a blocked queue_pop woken
by another client's push. cohortctl (gRPC) lists the items in between.

Run with the project venv's python (torch 2.4+ has queues;
tests/interop/torch_queue_durability_test.sh does). --backend=torch runs the
phases against torch's own server of the same torch, without a kill (it keeps
nothing over one): that only validates the test logic."""
import argparse
import json
import sys
import threading
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402

# Every process this test starts (torch's reference server, the phases)
# runs on this interpreter: the venv's torch 2.x.
ct.PYTHON = sys.executable

PUSHED = 40
POPPED = 7
QUEUE = "jobs"


def extra_flags(p):
    p.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def item(i):
    return (f"job-{i}-" + "x" * (i % 13)).encode() + bytes([i % 256])


def connect(dist, port):
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=timedelta(seconds=30))


def phase1(port):
    dist = ct.import_torch()
    s = connect(dist, port)
    for i in range(PUSHED):
        s.queue_push(QUEUE, item(i))
    s.queue_push("other", "o1")
    popped = [s.queue_pop(QUEUE, block=(i % 2 == 0)) for i in range(POPPED)]
    # queue_len is answered after everything before it on the connection
    # was applied (queue_push has no reply): it orders them all.
    print(json.dumps({"popped_ok": popped == [item(i) for i in range(POPPED)],
                      "len": s.queue_len(QUEUE), "other": s.queue_len("other"),
                      "num_keys": s.num_keys()}))


def phase2(port):
    dist = ct.import_torch()
    s = connect(dist, port)
    out = {"len": s.queue_len(QUEUE), "other": s.queue_len("other")}
    got = []
    for i in range(POPPED, PUSHED):
        got.append(s.queue_pop(QUEUE, block=(i % 2 == 1)))
    out["order_ok"] = got == [item(i) for i in range(POPPED, PUSHED)]
    out["first_wrong"] = next((f"{i}: {g!r}" for i, g in
                               zip(range(POPPED, PUSHED), got) if g != item(i)), "")
    try:
        s.queue_pop(QUEUE, block=False)
        out["empty_pop"] = "returned"
    except Exception as e:  # noqa: BLE001 (its type is what is checked)
        out["empty_pop"] = type(e).__name__
    # A blocked pop (no thread held on the server: a parked WAIT) is woken
    # by another client's push.
    blocked = connect(dist, port)
    result = {}

    def pop():
        try:
            result["item"] = blocked.queue_pop("later", block=True)
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=pop)
    t.start()
    s.queue_push("later", b"woken")
    t.join(timeout=ct.GIVE_UP_S)
    out["woken"] = result.get("item", b"").decode() or result.get("error", "still blocked")
    out["after_kill"] = s.queue_pop("other", block=False).decode()
    print(json.dumps(out))


def main():
    args = ct.parse_args(__doc__, extra_flags)
    if args.phase == 1:
        return phase1(args.port)
    if args.phase == 2:
        return phase2(args.port)
    import torch
    ct.import_torch()
    c = ct.Checks("queue_durability_test")
    if not c.ok(int(torch.__version__.split(".")[0]) >= 2,
                f"{sys.executable} has torch {torch.__version__}: queues need 2.4+ "
                "(run with the venv's python)"):
        c.finish()
    b = ct.Backend(args, "queue_durability")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port} (torch {torch.__version__})",
          flush=True)
    try:
        one = ct.run_phase(__file__, 1, b.port)
        print(f"phase 1: {one}")
        c.ok(one["popped_ok"], "phase 1 popped other items than it pushed first")
        c.eq("phase 1 queue_len", one["len"], PUSHED - POPPED)
        c.eq("phase 1 num_keys leaves queues out", one["num_keys"], 0)
        if b.is_cohortd:
            rc, out, err = b.ctl("list", "/cohort/queues/")
            c.eq("cohortctl list /cohort/queues/ (exit status)", rc, 0)
            listed = out.split()
            c.eq("items cohortctl lists", len(listed), PUSHED - POPPED + 1)
            prefix = f"/cohort/queues/{len('/' + QUEUE)}:/{QUEUE}/"
            jobs = [k for k in listed if k.startswith(prefix)]
            c.eq("items of the queue under its prefix", len(jobs), PUSHED - POPPED)
            if jobs:
                rc, out, err = b.ctl("get", jobs[0])
                c.eq("cohortctl get of the oldest item", out.encode().rstrip(b"\n"),
                     item(POPPED).rstrip(b"\n"))
            pid, port = b.proc.pid, b.port
            b.kill9()
            c.eq("cohortd died of SIGKILL", b.proc.returncode, -9)
            b.start(port=port)
            c.eq("restarted on the same TCPStore port", b.port, port)
            c.ok(b.proc.pid != pid, "cohortd was not restarted")
        else:
            print("torch's server keeps nothing over a kill: phase 2 runs without one")
        two = ct.run_phase(__file__, 2, b.port)
        print(f"phase 2: {two}")
        c.eq("items after kill -9", two["len"], PUSHED - POPPED)
        c.eq("other queue after kill -9", two["other"], 1)
        c.ok(two["order_ok"], f"items popped out of push order: {two['first_wrong']}")
        c.eq("queue_pop(block=False) of the emptied queue", two["empty_pop"],
             "QueueEmptyError")
        c.eq("blocked queue_pop woken by a push", two["woken"], "woken")
        c.eq("the other queue's item", two["after_kill"], "o1")
        if b.is_cohortd:
            rc, out, err = b.ctl("list", "/cohort/queues/")
            c.eq("no items left", (rc, out.split()), (0, []))
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    sys.exit(main())
