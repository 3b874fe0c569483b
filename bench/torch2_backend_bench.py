#!/usr/bin/env python3
"""The backend "cohort" beside torch's own "gloo" on PyTorch 2.x (the
project venv's torch), in the same torch processes, so that only the
backend differs. Every rank creates both groups (init_process_group
("cohort") and new_group(backend="gloo")); each measurement runs the same
work on one group right after the other, the order swapped every round,
ROUNDS rounds; medians are reported.

1. busbw (nccl-tests' definitions) through torch's API of all_reduce,
   all_gather (into a list), all_gather_into_tensor, reduce_scatter (from
   a list), reduce_scatter_tensor, broadcast and all_to_all_single, at 4 KiB, 256 KiB, 4 MiB and 64 MiB
   (each rank's input, as bench/collectives_bench counts them).
2. The floor of one op through torch's API: all_reduce of one float, us.
3. Steps/s of torch's own DDP (DistributedDataParallel, bucket_cap_mb 25)
   and FSDP2 (fully_shard per layer, then the model; f32) on
   bench/torch_ddp_bench.py's model (MLP 64-512-512-512-16, global batch
   128, SGD), over each group in turn.

Usage (bazel build //worker/torch:cohort_torch2 first):
  PYTHONPATH=bazel-bin/worker/torch/torch2:bench .venv/bin/python \\
      bench/torch2_backend_bench.py [--world=2] [--rounds=5] [--steps=60]
Ranks are forked here and share a TCPStore hosted by rank 0; one thread
each (OMP_NUM_THREADS=1).
"""
import argparse
import os
import statistics
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import cohort_torch  # noqa: F401,E402  (registers backend "cohort")
from torch_ddp_bench import DIMS, GLOBAL_BATCH, model  # noqa: E402

SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]
OPS = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "broadcast", "all_to_all_single"]
BACKENDS = ["cohort", "gloo"]


def bus_factor(op, world):
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op == "broadcast":
        return 1.0
    return (world - 1) / world  # gathers, reduce_scatter, all-to-all


def make_op(op, group, nbytes, world):
    """A closure running `op` once on `group`, on buffers made here;
    nbytes is each rank's input."""
    n = nbytes // 4
    t = torch.ones(n)
    if op == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        outs = [torch.empty_like(t) for _ in range(world)]
        return lambda: dist.all_gather(outs, t, group=group)
    if op == "all_gather_into_tensor":
        out = torch.empty(n * world)
        return lambda: dist.all_gather_into_tensor(out, t, group=group)
    if op == "reduce_scatter":  # from a list of separate tensors
        ins = [torch.ones(n // world) for _ in range(world)]
        out = torch.empty(n // world)
        return lambda: dist.reduce_scatter(out, ins, group=group)
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


def train_steps_per_s(kind, group, steps, rank, world, x, y):
    """Steps/s of torch's DDP or FSDP2 over `group` (the first step,
    which builds buckets and shards, is not timed)."""
    torch.manual_seed(11)
    net = model()
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(
            net, bucket_cap_mb=25, process_group=group)
    else:
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
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
    dist.barrier(group=group)
    return (steps - 1) / (time.perf_counter() - start)


def run(rank, args, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, rank == 0,
                          timedelta(seconds=300))
    dist.init_process_group("cohort", store=store, rank=rank,
                            world_size=args.world)
    groups = {"cohort": dist.group.WORLD,
              "gloo": dist.new_group(backend="gloo")}
    times = {}  # (op, bytes, backend) -> [seconds]
    floor = {b: [] for b in BACKENDS}
    one = torch.ones(1)
    for rnd in range(args.rounds):
        order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
        for backend in order:
            floor[backend].append(timed(
                lambda: dist.all_reduce(one, group=groups[backend]), 500,
                groups[backend]))
        for op in OPS:
            for nbytes in SIZES:
                iters = max(3, min(200, (256 << 20) // nbytes // 8))
                for backend in order:
                    fn = make_op(op, groups[backend], nbytes, args.world)
                    el = timed(fn, iters, groups[backend])
                    times.setdefault((op, nbytes, backend), []).append(el)
    torch.manual_seed(7)
    x = torch.randn(4096, DIMS[0])
    with torch.no_grad():
        y = model()(x)
    train = {}
    for rnd in range(args.rounds):
        order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
        for kind in ("ddp", "fsdp2"):
            for backend in order:
                train.setdefault((kind, backend), []).append(
                    train_steps_per_s(kind, groups[backend], args.steps, rank,
                                      args.world, x, y))
    if rank == 0:
        out.put((times, floor, train))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--port", type=int, default=29741)
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=run, args=(r, args, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    times, floor, train = out.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")

    w = args.world
    print(f"torch {torch.__version__}, world={w}, medians of {args.rounds} "
          f"rounds, busbw in GB/s")
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
    g, c = (statistics.median(floor[b]) * 1e6 for b in ("gloo", "cohort"))
    print(f"\none all_reduce of one float, us: torch-gloo {g:.1f}, "
          f"cohort {c:.1f}")
    print("\n| torch training | torch-gloo steps/s | cohort steps/s "
          "| cohort ÷ gloo |")
    print("| --- | --- | --- | --- |")
    for kind in ("ddp", "fsdp2"):
        g = statistics.median(train[(kind, "gloo")])
        c = statistics.median(train[(kind, "cohort")])
        print(f"| {kind.upper()} | {g:.1f} | {c:.1f} | {c / g:.2f}x |")


if __name__ == "__main__":
    main()
