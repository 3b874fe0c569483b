#!/usr/bin/python3
"""PyTorch's side of bench/train_bench.sh: the same model, batch and optimizer
as worker/parallel/examples/train's defaults (MLP 64-512-512-512-16, ReLU,
MSE, global batch 128, SGD lr 0.05 momentum 0.9) at world 2 on Gloo (CPU), one
thread per rank, in two modes: compute_only (no communication) and ddp
(DistributedDataParallel, bucket_cap_mb 25). Prints the median ms/step of
each over ROUNDS rounds of STEPS steps. MODES adds others: powersgdR is DDP
with torch's PowerSGD hook at rank R (start_powerSGD_iter 2, the least it
takes; warm start and error feedback on), printing its last loss too.
Usage: [MODES="compute_only ddp powersgd1"] python bench/torch_ddp_bench.py [rounds] [steps]"""
import os, statistics, sys, time
from datetime import timedelta
import torch, torch.distributed as dist, torch.multiprocessing as mp

DIMS = [64, 512, 512, 512, 16]
GLOBAL_BATCH = 128


def model():
    layers = []
    for i in range(len(DIMS) - 1):
        layers.append(torch.nn.Linear(DIMS[i], DIMS[i + 1]))
        if i + 2 < len(DIMS):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def run(rank, world, port, rounds, steps, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(7)
    x = torch.randn(4096, DIMS[0])
    teacher = model()
    with torch.no_grad():
        y = teacher(x)
    per_rank = GLOBAL_BATCH // world
    modes = os.environ.get("MODES", "compute_only ddp").split()
    results = {m: [] for m in modes}
    losses = {}
    for _ in range(rounds):
        for mode in results:
            net = model()
            if mode == "ddp" or mode.startswith("powersgd"):
                net = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=25)
            if mode.startswith("powersgd"):
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=int(mode[8:]),
                    start_powerSGD_iter=2)
                net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            dist.barrier()
            start = None
            for step in range(steps):
                if step == 1:
                    start = time.perf_counter()
                i = (step * GLOBAL_BATCH + rank * per_rank) % (4096 - per_rank)
                opt.zero_grad()
                loss = 0.5 * ((net(x[i:i + per_rank]) - y[i:i + per_rank]) ** 2).sum(1).mean()
                loss.backward()
                opt.step()
            ms = (time.perf_counter() - start) * 1000 / (steps - 1)
            results[mode].append(ms)
            losses[mode] = loss.item()
            if rank == 0:
                print(f"torch {mode}: {ms:.2f} ms/step, last loss {losses[mode]:.6f}", flush=True)
    if rank == 0:
        out.put({m: statistics.median(v) for m, v in results.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    world = 2
    port = 29000 + os.getpid() % 1000
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, world, port, rounds, steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    medians = out.get()
    for p in procs:
        p.join()
    for mode, ms in medians.items():
        print(f"torch median {mode}: {ms:.2f} ms/step")
    if "ddp" in medians and "compute_only" in medians:
        print(f"torch DDP / compute-only: {medians['ddp'] / medians['compute_only']:.2f}x")
    for mode in medians:
        if mode.startswith("powersgd") and "ddp" in medians:
            print(f"torch {mode} / DDP step time: {medians[mode] / medians['ddp']:.2f}x")
