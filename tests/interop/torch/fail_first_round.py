#!/usr/bin/python3
"""Runs SCRIPT as its __main__, except in cohortrun's first round
(TORCHELASTIC_RESTART_COUNT=0), where every rank joins the process group,
rank 0 leaves the key "first_round" in the job's store, and rank 1 then
exits 1 (its peers fail or are stopped). In a later round rank 0 first
checks that the store no longer has that key: the round's keys are fresh.
Usage: fail_first_round.py SCRIPT"""
import os
import runpy
import sys
from datetime import timedelta

import torch.distributed as dist


def store():
    """The job's store as the workers reach it, with no torch prefix."""
    return dist.TCPStore(os.environ["MASTER_ADDR"],
                         int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))


def main():
    script = sys.argv[1]
    rank = int(os.environ["RANK"])
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        if rank == 0:
            store().set("first_round", "was here")
        dist.barrier()
        if rank == 1:
            print("rank 1: failing in the first round", flush=True)
            sys.exit(1)
        dist.barrier()  # Ends when rank 1's exit stops the round.
        sys.exit(2)
    if rank == 0:
        # 1.13's Python TCPStore has no check(), and a get of a missing key
        # fails; compare_set with a non-empty expected value writes nothing
        # and returns it when the key is missing, the value when present.
        found = store().compare_set("first_round", "missing", "missing")
        if found != b"missing":
            print(f"rank 0: the first round's key is still in the store: {found}")
            sys.exit(3)
        print(f"rank 0: round {os.environ['TORCHELASTIC_RESTART_COUNT']} "
              "starts with fresh keys", flush=True)
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
