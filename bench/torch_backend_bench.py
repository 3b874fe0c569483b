#!/usr/bin/python3
"""Backend "cohort" beside torch's own "gloo", in the same torch processes so
that only the backend differs: every rank creates both groups, and each
measurement runs the same op on one group right after the other (order
swapped every round), ROUNDS rounds, median reported.

1. busbw (nccl-tests' definitions) of all_reduce, all_gather, broadcast and
   reduce_scatter at 4 KiB, 256 KiB, 4 MiB and 64 MiB (each rank's input,
   as bench/collectives_bench counts them). torch-gloo has no
   reduce_scatter in 1.13; as torch users do, it is emulated there by an
   all_reduce of the whole buffer and keeping the rank's slice.
2. torch DDP step time on bench/torch_ddp_bench.py's model (MLP
   64-512-512-512-16, global batch 128, SGD), DistributedDataParallel over
   each group in turn.

Usage: PYTHONPATH=<dir of cohort_torch*.so> /usr/bin/python3 \
         bench/torch_backend_bench.py [--world=2] [--rounds=5] [--steps=100]
Ranks are forked here and share a TCPStore hosted by rank 0; one thread each.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cohort_torch  # noqa: F401  (registers backend "cohort")
from torch_ddp_bench import DIMS, GLOBAL_BATCH, model  # The same model.

SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]
OPS = ["all_reduce", "all_gather", "broadcast", "reduce_scatter"]


def bus_factor(op, world):
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0


def make_op(op, group, backend, nbytes, world, rank):
    """A closure running `op` once on `group`, on buffers made here."""
    n = nbytes // 4
    if op == "all_reduce":
        t = torch.ones(n)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":  # nbytes is each rank's input, as in
        t = torch.ones(n)        # collectives_bench and torch_gloo_bench.
        outs = [torch.empty_like(t) for _ in range(world)]
        return lambda: dist.all_gather(outs, t, group=group)
    if op == "broadcast":
        t = torch.ones(n)
        return lambda: dist.broadcast(t, 0, group=group)
    # reduce_scatter: nbytes is the input, every rank keeps 1/world of it.
    full = torch.ones(n)
    out = torch.empty(n // world)
    if backend == "cohort":
        inputs = list(full.chunk(world))
        return lambda: dist.reduce_scatter(out, inputs, group=group)

    def emulated():
        dist.all_reduce(full, group=group)
        out.copy_(full.chunk(world)[rank])
    return emulated


def timed(fn, iters, group):
    fn()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def ddp_step_ms(group, steps, rank, world, x, y):
    torch.manual_seed(11)
    net = torch.nn.parallel.DistributedDataParallel(
        model(), bucket_cap_mb=25, process_group=group)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    per_rank = GLOBAL_BATCH // world
    dist.barrier(group=group)
    start = None
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()
        i = (step * GLOBAL_BATCH + rank * per_rank) % (4096 - per_rank)
        opt.zero_grad()
        out = net(x[i:i + per_rank])
        loss = 0.5 * ((out - y[i:i + per_rank]) ** 2).sum(1).mean()
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) * 1000 / (steps - 1)


def run(rank, args, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, rank == 0,
                          timedelta(seconds=120))
    dist.init_process_group("cohort", store=store, rank=rank,
                            world_size=args.world)
    groups = {"cohort": dist.group.WORLD,
              "gloo": dist.new_group(backend="gloo")}
    times = {}  # (op, bytes, backend) -> [seconds]
    for rnd in range(args.rounds):
        order = ["cohort", "gloo"] if rnd % 2 == 0 else ["gloo", "cohort"]
        for op in OPS:
            for nbytes in SIZES:
                iters = max(3, min(200, (256 << 20) // nbytes // 8))
                for backend in order:
                    fn = make_op(op, groups[backend], backend, nbytes,
                                 args.world, rank)
                    el = timed(fn, iters, groups[backend])
                    times.setdefault((op, nbytes, backend), []).append(el)
    torch.manual_seed(7)
    x = torch.randn(4096, DIMS[0])
    with torch.no_grad():
        y = model()(x)
    ddp = {"cohort": [], "gloo": []}
    for rnd in range(args.rounds):
        order = ["cohort", "gloo"] if rnd % 2 == 0 else ["gloo", "cohort"]
        for backend in order:
            ddp[backend].append(ddp_step_ms(groups[backend], args.steps, rank,
                                            args.world, x, y))
    if rank == 0:
        out.put((times, ddp))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--port", type=int, default=29731)
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=run, args=(r, args, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    times, ddp = out.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")

    w = args.world
    print(f"world={w}, medians of {args.rounds} rounds, busbw in GB/s")
    print("| op | size | torch-gloo busbw | cohort busbw | cohort ÷ gloo |")
    print("| --- | --- | --- | --- | --- |")
    for op in OPS:
        for nbytes in SIZES:
            g = statistics.median(times[(op, nbytes, "gloo")])
            c = statistics.median(times[(op, nbytes, "cohort")])
            f = bus_factor(op, w)
            size = (f"{nbytes >> 20} MiB" if nbytes >= 1 << 20
                    else f"{nbytes >> 10} KiB")
            print(f"| {op} | {size} | {nbytes / g / 1e9 * f:.3f} "
                  f"| {nbytes / c / 1e9 * f:.3f} | {g / c:.2f}x |")
    g = statistics.median(ddp["gloo"])
    c = statistics.median(ddp["cohort"])
    print(f"\nDDP ms/step: torch-gloo {g:.2f}, cohort {c:.2f}: "
          f"cohort steps {g / c:.2f}x as fast")


if __name__ == "__main__":
    main()
