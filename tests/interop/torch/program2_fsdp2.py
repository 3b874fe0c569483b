#!/usr/bin/env python3
"""FSDP2 as torch's FSDP2 tutorial and example write it (pytorch/examples
distributed/FSDP2): a small transformer-style model (residual MLP blocks
with LayerNorm), `fully_shard` on each block and then on the root, with a
MixedPrecisionPolicy of bfloat16 parameters and bfloat16 gradient
reduction, on a CPU device mesh (init_device_mesh("cpu", (world,))); every
rank seeds the model alike and draws its own batches (as a
DistributedSampler gives each its own), and SGD trains 6 steps. Run it under
cohortrun (tests/interop/torch2_programs_test.sh) with `--backend gloo|cohort
--out DIR`: "cohort" imports cohort_torch first, which registers the backend.
Each rank writes DIR/BACKEND/rank<R>.pt: the full (gathered) parameters at the
start (p0), after step 1 (p1) and at the end, step 1's full gradients, and what
each of step 1's reduce-scatters took and gave on this rank (the test wraps
dist.reduce_scatter_tensor to see it; the model's dimensions are multiples of
4, so FSDP2 pads nothing).
`--check DIR WORLD` compares DIR/cohort with DIR/gloo.

What must hold, and why (program2_check.py defines gamma, u, S):
 - FSDP2's all-gathers copy bytes, so both backends compute the same
   forward and backward: step 1's reduce-scatter inputs are bit-identical
   on both backends, rank by rank.
 - FSDP2 reduces bfloat16 gradients with ReduceOp.AVG (its choice for
   bfloat16 and float32 reduce dtypes): rank r's output is (sum_k of row r
   of rank k's input) / W. Dividing by W = 2 or 4 is exact (a power of 2;
   off the subnormals), so the only rounding is the sum's: with S = sum_k
   |row r of rank k's input|, each backend's output is within
   (gamma(W-1, 2^-8) * S + ...) / W of the exact s / W (sum_bound; torch's
   gloo rounds each addition to bfloat16, cohort adds in float32 and rounds
   once).
 - World 2: one addition, rounded once to bfloat16 in either order, and
   the exact halving: every output is fl(a + b) / 2, bit for bit, and so
   the whole training (every step repeats it) is bit-identical.
 - World 4: the outputs may differ by twice that bound. FSDP2 widens the
   output to float32 for the sharded gradient (exact: the sorted values of
   step 1's full gradients are the sorted values of all ranks' outputs),
   and after one SGD step the parameters differ by at most lr * |g_cohort -
   g_gloo| * (1 + u) + u * lr * (|g_cohort| + |g_gloo|) + ulp(p) (see
   sgd_bound). Later steps compound the difference without a useful bound.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.dont_write_bytecode = True
import program2_check  # noqa: E402

STEPS = 6
LR = 0.01
DIM = 32


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Transformer(nn.Module):
    def __init__(self, n_in=16, dim=DIM, n_layers=2, n_out=8):
        super().__init__()
        self.embed = nn.Linear(n_in, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_out)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def record_reduce_scatters(calls):
    """Has dist.reduce_scatter_tensor (which FSDP2 calls) append what it
    took and gave to calls while calls is not None."""
    original = dist.reduce_scatter_tensor

    def recorded(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = original(output, input, op=op, group=group, async_op=async_op)
        if work is not None and async_op:
            work.wait()
        if calls is not None:
            calls.append({"input": input.detach().clone(), "output": output.detach().clone(),
                          "op": str(op)})
        return work

    dist.reduce_scatter_tensor = recorded
    return lambda: setattr(dist, "reduce_scatter_tensor", original)


def main(backend, out):
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"Start running FSDP2 on rank {rank} of {world}.")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Transformer()
    fsdp_kwargs = {"mesh": mesh,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.bfloat16)}
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(1 + rank)  # each rank's own batches

    record = {"rank": rank, "world": world, "lr": LR, "p0": program2_check.params(model)}
    for step in range(STEPS):
        x, y = torch.randn(24, 16), torch.randn(24, 8)
        calls = [] if step == 0 else None
        restore = record_reduce_scatters(calls)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        restore()
        if step == 0:
            record["rs"] = calls
            record["reduced"] = program2_check.grads(model)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            record["p1"] = program2_check.params(model)

    record["final"] = program2_check.params(model)
    program2_check.save(out, backend, rank, record)
    dist.barrier()
    dist.destroy_process_group()


def check(directory, world):
    bf16 = torch.bfloat16
    c = program2_check.Checks("program2_fsdp2")
    runs = {b: program2_check.load(directory, b, world) for b in ("gloo", "cohort")}
    for b, rs in runs.items():
        for r in rs[1:]:
            for key in ("p0", "reduced", "p1", "final"):
                c.equal(f"{b}: {key} of rank {r['rank']} vs rank 0", r[key], rs[0][key])
        calls = [len(r["rs"]) for r in rs]
        c.equal(f"{b}: reduce-scatters per rank", torch.tensor(calls),
                torch.tensor([calls[0]] * world))
        if min(calls) == 0:
            c.fail(f"{b}: step 1 made no reduce-scatter on some rank: {calls}")
        for i in range(min(calls)):
            ops = {r["rs"][i]["op"] for r in rs}
            if ops != {str(dist.ReduceOp.AVG)}:
                c.fail(f"{b}: reduce-scatter {i} ran {ops}, the derivation assumes AVG")
            for r in rs:
                parts = [k["rs"][i]["input"].view(world, -1)[r["rank"]] for k in rs]
                got = r["rs"][i]["output"]
                if got.dtype != bf16 or any(p.dtype != bf16 for p in parts):
                    c.fail(f"{b}: reduce-scatter {i} is not of bfloat16")
                    continue
                what = f"{b}: reduce-scatter {i}'s output on rank {r['rank']}"
                if world == 2:
                    c.equal(f"{what} vs fl(a + b) / 2", got, (parts[0] + parts[1]).div(2))
                s, S, bound = program2_check.sum_bound(parts, bf16)
                c.within(f"{what} vs the exact average (bound gamma({world - 1}, 2^-8) * S / W)",
                         got, s / world, bound / world + program2_check.ETA[bf16])
        # The gradients FSDP2 kept are the outputs, widened.
        outs = torch.cat([r["rs"][i]["output"].float() for r in rs for i in range(min(calls))])
        grads = torch.cat([g.reshape(-1) for g in rs[0]["reduced"].values()])
        c.equal(f"{b}: step 1's gradients, sorted, vs every reduce-scatter output, sorted",
                grads.sort().values, outs.sort().values)
    g, k = runs["gloo"], runs["cohort"]
    c.equal("p0, gloo vs cohort", k[0]["p0"], g[0]["p0"])
    for r in range(world):
        for i in range(min(len(g[r]["rs"]), len(k[r]["rs"]))):
            c.equal(f"reduce-scatter {i}'s input on rank {r}, gloo vs cohort",
                    k[r]["rs"][i]["input"], g[r]["rs"][i]["input"])
    if world == 2:
        for key in ("reduced", "p1", "final"):
            c.equal(f"{key}, gloo vs cohort", k[0][key], g[0][key])
    else:
        for r in range(world):
            for i in range(min(len(g[r]["rs"]), len(k[r]["rs"]))):
                parts = [x["rs"][i]["input"].view(world, -1)[r] for x in g]
                _, _, bound = program2_check.sum_bound(parts, bf16)
                c.within(f"reduce-scatter {i}'s output on rank {r}, cohort vs gloo "
                         "(bound 2 * gamma(3, 2^-8) * S / 4)", k[r]["rs"][i]["output"],
                         g[r]["rs"][i]["output"],
                         2 * (bound / world + program2_check.ETA[bf16]))
        for pname in g[0]["p1"]:
            bound = program2_check.sgd_bound(g[0]["lr"], k[0]["reduced"][pname],
                                             g[0]["reduced"][pname], k[0]["p1"][pname],
                                             g[0]["p1"][pname])
            c.within(f"{pname} after one SGD step, cohort vs gloo", k[0]["p1"][pname],
                     g[0]["p1"][pname], bound)
    c.finish()


if __name__ == "__main__":
    args = program2_check.parse_args(__doc__)
    if args.check:
        check(args.check[0], int(args.check[1]))
    else:
        main(args.backend, args.out)
