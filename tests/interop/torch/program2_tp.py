#!/usr/bin/env python3
"""Tensor parallelism as torch's example writes it (pytorch/examples
distributed/tensor_parallelism/tensor_parallel_example.py): a ToyModel MLP
(in_proj, ReLU, out_proj) given to parallelize_module on a 1-D device mesh,
here init_device_mesh("cpu", (world,)), with in_proj ColwiseParallel and
out_proj RowwiseParallel; every rank draws the same input each iteration
(torch.manual_seed(i), as the example does to stand in for a data loader),
and AdamW (foreach) trains 10 iterations on output.sum(). Run it under
cohortrun (tests/interop/torch2_programs_test.sh) with `--backend gloo|cohort
--out DIR`: "cohort" imports cohort_torch first, which registers the backend.
Each rank writes DIR/BACKEND/rank<R>.pt: the full (gathered) parameters at the
start (p0), after iteration 1 (p1) and at the end, its local copies of the
replicated parameters at the end, and for every iteration out_proj's output
before and after the all-reduce that RowwiseParallel makes of it (a forward
hook, registered before parallelize_module's, sees the Partial DTensor).
`--check DIR WORLD` compares DIR/cohort with DIR/gloo.

The collectives: in forward, RowwiseParallel all-reduces (SUM) out_proj's
partial outputs, the one float32 sum of the step; ColwiseParallel's input
is replicated and needs no gradient, and every weight's gradient is local
to its shard, so backward communicates nothing; AdamW works shard by shard.
(parallelize_module's distribution of the parameters from rank 0, and the
gathers that make the records, copy bytes.)

What must hold, and why (program2_check.py defines gamma, u, S):
 - Both backends start from the same parameters and compute the same
   partial outputs, bit for bit; on each, every rank's local copy of a
   replicated parameter (out_proj's bias) stays identical (each rank
   applies the same replicated gradient to it).
 - Each iteration's all-reduced output y = sum_r partial_r is within
   gamma(W-1, 2^-24) * S of the exact sum, S = sum_r |partial_r|, on each
   backend.
 - World 2: one addition per element, rounded alike in either order: y is
   fl(partial_0 + partial_1) bit for bit, on both backends.
 - The loss is output.sum(), so d(loss)/dy is 1 everywhere, and every
   gradient follows from it and the activations before out_proj's
   all-reduce: y's value never reaches the gradients, and the parameters
   (AdamW, the same arithmetic on the same gradients) are bit-identical on
   both backends after every iteration, at any world size.
 - World 4: the 4-term sums may be added in different orders, so each
   iteration's y may differ by 2 * gamma(3, 2^-24) * S between the
   backends (the partial outputs being bit-identical, by the above).
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

sys.dont_write_bytecode = True
import program2_check  # noqa: E402

ITERS = 10


class ToyModel(nn.Module):
    """MLP based model"""

    def __init__(self):
        super(ToyModel, self).__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def main(backend, out):
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"Start running the TP example on rank {rank} of {world}.")
    tp_mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    tp_model = ToyModel()

    partials = []  # the test's: out_proj's output before RowwiseParallel's hook

    def before_all_reduce(module, inputs, output):
        partials.append(([str(p) for p in output.placements],
                         output.to_local().detach().clone()))

    tp_model.out_proj.register_forward_hook(before_all_reduce)
    tp_model = parallelize_module(
        module=tp_model,
        device_mesh=tp_mesh,
        parallelize_plan={
            "in_proj": ColwiseParallel(),
            "out_proj": RowwiseParallel(),
        },
    )
    record = {"rank": rank, "world": world, "p0": program2_check.params(tp_model),
              "outputs": []}

    lr = 0.25
    optimizer = torch.optim.AdamW(tp_model.parameters(), lr=lr, foreach=True)
    for i in range(ITERS):
        # For TP, input needs to be same across all TP ranks.
        # Setting the random seed is to mimic the behavior of dataloader.
        torch.manual_seed(i)
        inp = torch.rand(20, 10)
        output = tp_model(inp)
        record["outputs"].append(output.detach().clone())
        output.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 0:
            record["p1"] = program2_check.params(tp_model)

    record["final"] = program2_check.params(tp_model)
    record["placements"] = [p for p, _ in partials]
    record["partials"] = [t for _, t in partials]
    record["replicated"] = {
        name: p.to_local().detach().clone() for name, p in tp_model.named_parameters()
        if all(isinstance(pl, Replicate) for pl in p.placements)}
    program2_check.save(out, backend, rank, record)
    dist.barrier()
    dist.destroy_process_group()


def check(directory, world):
    f32 = torch.float32
    c = program2_check.Checks("program2_tp")
    runs = {b: program2_check.load(directory, b, world) for b in ("gloo", "cohort")}
    for b, rs in runs.items():
        if not rs[0]["replicated"]:
            c.fail(f"{b}: no parameter is replicated (out_proj's bias should be)")
        for r in rs[1:]:
            for key in ("p0", "p1", "final", "replicated"):
                c.equal(f"{b}: {key} of rank {r['rank']} vs rank 0", r[key], rs[0][key])
        for r in rs:
            if len(r["partials"]) != ITERS or len(r["outputs"]) != ITERS:
                c.fail(f"{b}: rank {r['rank']} recorded {len(r['partials'])} partial "
                       f"outputs and {len(r['outputs'])} outputs, expected {ITERS} each")
                return c.finish()
            if any(p != ["P(sum)"] for p in r["placements"]):
                c.fail(f"{b}: rank {r['rank']}: out_proj's outputs are {r['placements']}, "
                       "the derivation assumes [P(sum)], a Partial of SUM")
        for i in range(ITERS):
            parts = [r["partials"][i] for r in rs]
            for r in rs:
                got = r["outputs"][i]
                what = f"{b}: iteration {i + 1}'s output on rank {r['rank']}"
                if world == 2:
                    c.equal(f"{what} vs fl(partial_0 + partial_1)", got, parts[0] + parts[1])
                s, _, bound = program2_check.sum_bound(parts, f32)
                c.within(f"{what} vs the exact sum of {world} partial outputs "
                         f"(bound gamma({world - 1}, 2^-24) * S)", got, s, bound)
    g, k = runs["gloo"], runs["cohort"]
    for key in ("p0", "p1", "final"):
        c.equal(f"{key}, gloo vs cohort", k[0][key], g[0][key])
    for r in range(world):
        for i in range(ITERS):
            c.equal(f"rank {r}'s partial output in iteration {i + 1}, gloo vs cohort",
                    k[r]["partials"][i], g[r]["partials"][i])
            if world == 2:
                c.equal(f"rank {r}'s output in iteration {i + 1}, gloo vs cohort",
                        k[r]["outputs"][i], g[r]["outputs"][i])
            else:
                _, _, bound = program2_check.sum_bound([x["partials"][i] for x in g], f32)
                c.within(f"rank {r}'s output in iteration {i + 1}, cohort vs gloo "
                         "(bound 2 * gamma(3, 2^-24) * S)", k[r]["outputs"][i],
                         g[r]["outputs"][i], 2 * bound)
    c.finish()


if __name__ == "__main__":
    args = program2_check.parse_args(__doc__)
    if args.check:
        check(args.check[0], int(args.check[1]))
    else:
        main(args.backend, args.out)
