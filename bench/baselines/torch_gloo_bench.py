#!/usr/bin/python3
"""Baseline: PyTorch's ProcessGroupGloo collectives over WORLD forked ranks on
loopback (CPU, one thread per rank).

The ranks are forked from this process, which hosts their TCPStore; each
creates the group with init_process_group("gloo") (Gloo on the loopback
interface unless GLOO_SOCKET_IFNAME says otherwise). For all_reduce,
all_gather and broadcast at 4 KiB, 256 KiB, 4 MiB and 64 MiB of float32 ones
(`bytes` is the buffer each rank passes in; all_gather's output is WORLD
times that): 2 warm-up calls, a barrier, then max(3, min(200, 64 MiB /
bytes)) calls, each returning before the next starts; rank 0 prints the mean
time per call, algbw = bytes / time and busbw with nccl-tests' factors
(all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1):

  torch-gloo init_process_group world=2 25.1 ms
  torch-gloo all_reduce world=2 bytes=  4194304 time_us=    5854.0 algbw_GBps=  0.716 busbw_GBps=  0.716

bench/collectives_bench prints cohort's figures in the same fields and
bench/collectives_compare.py parses both.

Usage: torch_gloo_bench.py [WORLD=2]
Runs on torch 1.13 (Debian's python3-torch) and 2.x alike.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_tcpstore

SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def timed(op, nbytes, world):
    """Mean seconds per call of `op` on `nbytes` per rank."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    outputs = [torch.empty_like(t) for _ in range(world)]
    call = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_gather": lambda: dist.all_gather(outputs, t),
        "broadcast": lambda: dist.broadcast(t, 0),
    }[op]
    iters = max(3, min(200, (64 << 20) // nbytes))
    for _ in range(2):
        call()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def run_rank(rank, world, port):
    torch.set_num_threads(1)
    store = torch_tcpstore.client(port)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    if rank == 0:
        print(f"torch-gloo init_process_group world={world} "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    for op in BUS_FACTOR:
        for nbytes in SIZES:
            seconds = timed(op, nbytes, world)
            if rank == 0:
                algbw = nbytes / seconds / 1e9
                print(f"torch-gloo {op:10s} world={world} bytes={nbytes:>9d} "
                      f"time_us={seconds * 1e6:10.1f} algbw_GBps={algbw:7.3f} "
                      f"busbw_GBps={algbw * BUS_FACTOR[op](world):7.3f}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("world", type=int, nargs="?", default=2)
    a = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    server = torch_tcpstore.server()
    print(f"# {torch_tcpstore.describe(server)}, ProcessGroupGloo on "
          f"{os.environ['GLOO_SOCKET_IFNAME']}", flush=True)
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=run_rank, args=(r, a.world, server.port))
             for r in range(a.world)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join()
    failed = [i for i, r in enumerate(ranks) if r.exitcode != 0]
    if failed:
        sys.exit(f"torch_gloo_bench: ranks {failed} of {a.world} failed")


if __name__ == "__main__":
    main()
