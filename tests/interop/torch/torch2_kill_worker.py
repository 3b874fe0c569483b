#!/usr/bin/env python3
"""Runs SCRIPT ARGS... as its __main__ (tutorial_ddp.py), except in the
launcher's first round (TORCHELASTIC_RESTART_COUNT=0):
  - rank 0 first leaves the key "first_round" in the job's store (a
    TCPStore client of MASTER_ADDR:MASTER_PORT, no torch prefix);
  - rank 1 SIGKILLs itself in the middle of training, right after its
    KILL_AFTER-th optimizer step (torch.optim.SGD.step, which the script
    uses, is wrapped to count);
  - the other ranks' next collective must then fail: each prints its error
    and exits 1 (or is stopped by the launcher).
In a later round rank 0 first checks that the store has no "first_round":
the round's keys are fresh. Each event is printed with the wall-clock time.
Usage: torch2_kill_worker.py SCRIPT [ARGS...]"""
import os
import runpy
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist
import torch.optim

VICTIM = 1
KILL_AFTER = 2  # optimizer steps; the DDP tutorial takes 5


def store():
    """The job's store as the workers reach it, with no torch prefix."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=60))


def first_round(rank):
    if rank == 0:
        store().set("first_round", "was here")
    if rank == VICTIM:
        step = torch.optim.SGD.step
        steps = 0

        def step_then_die(self, *args, **kwargs):
            nonlocal steps
            out = step(self, *args, **kwargs)
            steps += 1
            if steps == KILL_AFTER:
                print(f"rank {rank}: SIGKILL after step {steps} at {time.time():.3f}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        torch.optim.SGD.step = step_then_die
        runpy.run_path(sys.argv[0], run_name="__main__")
        print(f"rank {rank}: trained to the end although it should have been killed",
              flush=True)
        sys.exit(4)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except Exception as e:  # noqa: BLE001
        message = " | ".join(l for l in str(e).splitlines() if l.strip())
        print(f"rank {rank}: round 0 failed at {time.time():.3f}: "
              f"{type(e).__name__}: {message[:500]}", flush=True)
        os._exit(1)  # no teardown of a group whose peer is gone
    print(f"rank {rank}: round 0 completed although rank {VICTIM} was killed", flush=True)
    sys.exit(5)


def main():
    sys.argv = sys.argv[1:]
    rank = int(os.environ["RANK"])
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if restart == "0":
        first_round(rank)
    if rank == 0:
        if store().check(["first_round"]):
            print(f"rank 0: round {restart}: the first round's key is still in the store",
                  flush=True)
            sys.exit(3)
        print(f"rank 0: round {restart} starts with fresh keys at {time.time():.3f}",
              flush=True)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
