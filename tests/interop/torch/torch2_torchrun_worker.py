#!/usr/bin/env python3
"""A gloo worker under torchrun 2.x: init_process_group("gloo") from the
environment (env://), an all_reduce whose sum it checks, and a JSON report
OUT_DIR/rank<RANK>.<pid>.json of the result and the environment torchrun
gave it. Usage: torch2_torchrun_worker.py OUT_DIR

What it does after the report depends on files the test makes in OUT_DIR:
  go      it waits for this file (up to 10 minutes) before it leaves the
          group, so that the test can look at the job's sockets while every
          worker is alive; then a barrier, and exit 0
  killed  absent when the worker starts: it all_reduces until that fails
          (a peer died) and exits 1; present: it reports and exits 0
          (only when OUT_DIR/until_killed exists, the kill test's marker)
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    out_dir = sys.argv[1]
    until_killed = (os.path.exists(os.path.join(out_dir, "until_killed")) and
                    not os.path.exists(os.path.join(out_dir, "killed")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    report = {
        "rank": rank,
        "world_size": world,
        "all_reduce": t.item(),
        "expected": world * (world + 1) / 2.0,
        "until_killed": until_killed,
        "env": {k: os.environ.get(k) for k in (
            "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")},
        "pid": os.getpid(),
        "agent": os.getppid(),
    }
    path = os.path.join(out_dir, f"rank{rank}.{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(path + ".tmp", path)
    if until_killed:
        # A peer's death ends this: gloo's next op on the broken pair fails.
        while True:
            dist.all_reduce(t)
            time.sleep(0.05)
    go = os.path.join(out_dir, "go")
    deadline = time.monotonic() + 600
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001
        print(f"worker rank {os.environ.get('RANK')} pid {os.getpid()}: "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        sys.exit(1)
