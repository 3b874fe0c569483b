#!/usr/bin/env python3
"""One rank of bench/multihost_netns.sh: the backend "cohort" beside torch's
own "gloo" in the same torch process, over the same link between two hosts
(network namespaces). Every rank creates both groups; each measurement runs
the same op on one group right after the other, the order swapped every
round, ROUNDS rounds; rank 0 prints, per op and size, the median time of
each and the ratio (gloo's time / cohort's, so > 1 is cohort faster), then
every round's times.

Sizes are each rank's input, as bench/collectives_bench counts them; busbw
uses nccl-tests' factors for the world size. The environment gives RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT (rank 0 hosts the TCPStore),
GLOO_SOCKET_IFNAME (the host's interface, for both backends) and
COHORT_HOST_ID (the host, for cohort's hierarchy).

  multihost_netns.py --label=capped [--rounds=5] [--sizes=4096,...]
"""
import argparse
import os
import statistics
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cohort_torch  # noqa: F401,E402  (registers backend "cohort")

OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
       "broadcast", "all_to_all_single"]
BACKENDS = ["cohort", "gloo"]


def bus_factor(op, world):
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op == "broadcast":
        return 1.0
    return (world - 1) / world


def make_op(op, group, nbytes, world):
    n = nbytes // 4
    t = torch.ones(n)
    if op == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather_into_tensor":
        out = torch.empty(n * world)
        return lambda: dist.all_gather_into_tensor(out, t, group=group)
    if op == "reduce_scatter_tensor":
        out = torch.empty(n // world)
        return lambda: dist.reduce_scatter_tensor(out, t, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(t, 0, group=group)
    out = torch.empty(n)
    return lambda: dist.all_to_all_single(out, t, group=group)


def timed(fn, iters, group):
    fn()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="link")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="4096,262144,4194304,16777216")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--bytes_per_case", type=int, default=32 << 20,
                   help="timed calls per case: this many bytes' worth "
                   "(at least 3, at most 50)")
    a = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"],
                          int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timedelta(seconds=300))
    dist.init_process_group("cohort", store=store, rank=rank,
                            world_size=world)
    groups = {"cohort": dist.group.WORLD,
              "gloo": dist.new_group(backend="gloo")}
    sizes = [int(s) for s in a.sizes.split(",")]
    ops = a.ops.split(",")
    times = {}
    for rnd in range(a.rounds):
        order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
        for op in ops:
            for nbytes in sizes:
                iters = max(3, min(50, a.bytes_per_case // nbytes))
                for backend in order:
                    fn = make_op(op, groups[backend], nbytes, world)
                    times.setdefault((op, nbytes, backend), []).append(
                        timed(fn, iters, groups[backend]))
        if rank == 0:
            print(f"# {a.label}: round {rnd + 1} of {a.rounds} done",
                  flush=True)
    if rank == 0:
        print(f"{'link':<9}{'op':<24}{'bytes':>10}{'gloo_us':>11}"
              f"{'cohort_us':>11}{'gloo_busbw':>11}{'cohort_busbw':>13}"
              f"{'ratio':>7}")
        for op in ops:
            for nbytes in sizes:
                g = statistics.median(times[(op, nbytes, "gloo")])
                c = statistics.median(times[(op, nbytes, "cohort")])
                f = bus_factor(op, world)
                print(f"{a.label:<9}{op:<24}{nbytes:>10}{g * 1e6:>11.0f}"
                      f"{c * 1e6:>11.0f}{nbytes / g / 1e9 * f:>11.3f}"
                      f"{nbytes / c / 1e9 * f:>13.3f}{g / c:>7.2f}",
                      flush=True)
        print("every round, us (gloo/cohort), in order:")
        for op in ops:
            for nbytes in sizes:
                pairs = zip(times[(op, nbytes, "gloo")],
                            times[(op, nbytes, "cohort")])
                print(f"  {a.label} {op} {nbytes}: " + " ".join(
                    f"{g * 1e6:.0f}/{c * 1e6:.0f}" for g, c in pairs))
    dist.barrier(group=groups["gloo"])
    # torch 2.11's gloo may hang in destroy_process_group (see
    # tests/interop's program2 scripts): every rank is past its last
    # collective, so leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
