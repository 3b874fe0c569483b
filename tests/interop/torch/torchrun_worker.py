#!/usr/bin/python3
"""A worker under torchrun: init_process_group("gloo") from the environment
(env://), an all_reduce, and a JSON report in OUT_DIR/rank<RANK>.json of the
result and of where the worker store (MASTER_ADDR:MASTER_PORT) lives.
Usage: torchrun_worker.py OUT_DIR"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def listening_inodes(port):
    """Inodes of TCP sockets listening on `port` (state 0A), from /proc/net."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except FileNotFoundError:
            pass
    return inodes


def own_socket_inodes():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    master_port = int(os.environ["MASTER_PORT"])
    report = {
        "rank": rank,
        "world_size": world,
        "all_reduce": t.item(),
        "expected": world * (world + 1) / 2.0,
        "env": {k: os.environ.get(k) for k in (
            "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")},
        "hosts_master_port": bool(listening_inodes(master_port) & own_socket_inodes()),
        "pid": os.getpid(),
    }
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
