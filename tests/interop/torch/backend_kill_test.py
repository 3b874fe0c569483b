#!/usr/bin/python3
"""A rank of a job on the backend "cohort" (cohort_torch) killed in the
middle of an all_reduce: the other ranks' all_reduce fails with a
RuntimeError naming the op (cohort's status: the connection broke, or the
group's 5 s timeout passed) instead of hanging (a hang is killed at the
job's deadline, and its rank then fails the test); their next op fails
from the broken group (FAILED_PRECONDITION naming that first failure), not
by waiting out a timeout of its own. World 3: rank 2 issues a large
all_reduce and SIGKILLs itself while it runs.

Run: bazel test //tests/interop:torch_backend_kill_test, or by hand
  PYTHONPATH=bazel-bin/worker/torch /usr/bin/python3 \
      tests/interop/torch/backend_kill_test.py
"""
import os
import signal
import sys
import time
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import backend_ranks  # noqa: E402
import harness  # noqa: E402

args = backend_ranks.parse_args(__doc__)
dist = backend_ranks.import_backend()
import torch  # noqa: E402

WORLD = 3
VICTIM = 2
TIMEOUT_S = 5


def rank_main(rank):
    c = harness.Checks(f"rank {rank}")
    dist.init_process_group("cohort", timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    # 64 MiB: over shared memory (the ranks share this host) it takes about
    # 20-30 ms here, 64 rounds of two barriers each; the victim dies 2 ms
    # into it.
    big = torch.ones(16 << 20)
    if rank == VICTIM:
        dist.all_reduce(big, async_op=True)
        time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.all_reduce(big)
        c.fail("all_reduce succeeded although rank 2 was killed during it")
    except RuntimeError as e:
        took = time.monotonic() - t0
        print(f"rank {rank}: all_reduce failed after {took:.1f}s: {e}",
              flush=True)
        c.ok("AllReduce SUM of 16777216 f32" in str(e),
             f"the error does not name the op: {e}")
    try:
        dist.broadcast(torch.zeros(4), src=0)
        c.fail("a broadcast after the failure succeeded")
    except RuntimeError as e:
        print(f"rank {rank}: the next op: {e}", flush=True)
        c.ok("FAILED_PRECONDITION" in str(e) and "AllReduce" in str(e),
             f"the next op's error does not name the first failure: {e}")
    c.finish()


def main():
    if args.rank >= 0:
        rank_main(args.rank)
    c = harness.Checks("backend_kill_test")
    t0 = time.monotonic()
    codes = backend_ranks.wait_all(
        backend_ranks.launch(os.path.abspath(sys.argv[0]), WORLD,
                             name="backend_kill_test"),
        deadline_s=60)
    print(f"== job took {time.monotonic() - t0:.1f}s", flush=True)
    c.eq(f"rank {VICTIM}'s exit status", codes[VICTIM], -signal.SIGKILL)
    for r in range(WORLD):
        if r != VICTIM:
            c.eq(f"rank {r}'s exit status (0: its checks passed)", codes[r], 0)
    c.finish()


if __name__ == "__main__":
    main()
