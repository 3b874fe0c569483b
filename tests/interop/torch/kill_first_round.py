#!/usr/bin/python3
"""Runs SCRIPT ARGS... as its __main__ (tutorial_ddp.py --backend=cohort),
except that in cohortrun's first round (TORCHELASTIC_RESTART_COUNT=0) rank 1
SIGKILLs itself in the middle of training, right after its KILL_AFTER-th
optimizer step (torch.optim.SGD.step, which the script uses, is wrapped to
count). The other ranks' next collective (DDP's all_reduce of the gradients
in backward) must then fail, not hang: each prints the error, which names
the op ("AllReduce SUM of 165 f32 on rank 0 of 4: ..."), and exits 1.
Meanwhile they let cohortrun's SIGTERM pass (its handler only notes it), so
that a rank hanging in its op shows as a rank that printed no error
(cohortrun SIGKILLs it after --stop-grace) instead of dying quietly. The
kill, each failure and the start of a later round are printed with the wall
clock time, for the test to check their order.
Usage: kill_first_round.py SCRIPT [ARGS...]"""
import os
import runpy
import signal
import sys
import time

import torch.optim

VICTIM = 1
KILL_AFTER = 2  # optimizer steps; the DDP tutorial takes 5


def first_round(rank):
    if rank == VICTIM:
        step = torch.optim.SGD.step
        steps = 0

        def step_then_die(self, *args, **kwargs):
            nonlocal steps
            out = step(self, *args, **kwargs)
            steps += 1
            if steps == KILL_AFTER:
                print(f"rank {rank}: SIGKILL after step {steps} at "
                      f"{time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        torch.optim.SGD.step = step_then_die
        runpy.run_path(sys.argv[0], run_name="__main__")
        print(f"rank {rank}: trained to the end although it should have "
              "been killed", flush=True)
        sys.exit(4)

    signal.signal(signal.SIGTERM, lambda *_: None)  # see the docstring
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except Exception as e:  # noqa: BLE001  (RuntimeError in 1.13)
        message = " | ".join(l for l in str(e).splitlines() if l.strip())
        print(f"rank {rank}: round 0 failed at {time.time():.3f}: "
              f"{type(e).__name__}: {message[:2000]}", flush=True)
        os._exit(1)  # no teardown of a group whose peer is gone
    print(f"rank {rank}: round 0 completed although rank {VICTIM} was "
          "killed", flush=True)
    sys.exit(5)


def main():
    sys.argv = sys.argv[1:]
    rank = int(os.environ["RANK"])
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if restart == "0":
        first_round(rank)
    print(f"rank {rank}: round {restart} starts at {time.time():.3f}",
          flush=True)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
