#!/usr/bin/env python3
"""Automatic mixed precision on the CPU inside DDP, as torch's tutorials
write them: demo_basic of "Getting Started with Distributed Data Parallel"
(a ToyModel in DDP, SGD, each rank's own random batches, the process group
from torchrun's environment) with the forward pass and the loss under
`torch.autocast(device_type="cpu", dtype=torch.bfloat16)` and backward
outside it, as the "Automatic Mixed Precision" recipe does (bfloat16 needs
no GradScaler). It trains 8 steps. Run it under cohortrun
(tests/interop/torch2_programs_test.sh) with `--backend gloo|cohort --out DIR`:
"cohort" imports cohort_torch first, which registers the backend. Each rank
writes DIR/BACKEND/rank<R>.pt: the parameters after DDP's broadcast (p0), its
local step-1 gradients (a copy of the model, not in DDP, under the same
autocast on the same batch), the all-reduced step-1 gradients, the parameters
after step 1 and at the end.
`--check DIR WORLD` compares DIR/cohort with DIR/gloo.

Autocast runs the Linear layers in bfloat16, but the parameters and so
their gradients stay float32, and DDP all-reduces float32 buckets: each
rank adds c_r = g_r / W (DDP divides the gradient by the world size as it
copies it into the bucket; W = 2 or 4 makes that exact), and the sum's
bounds are those of program2_ddp_hooks.py with u = 2^-24:
 - every rank holds the same parameters (DDP's invariant), both backends
   broadcast the same p0 and compute the same local gradients;
 - world 2: step 1's gradient is fl(c_0 + c_1), bit for bit, and the
   parameters after 8 steps are bit-identical on both backends;
 - world 4: each backend's step-1 gradient is within gamma(3, 2^-24) * S
   of the exact sum, the two within twice that, and the parameters after
   one SGD step within lr * |g_cohort - g_gloo| * (1 + u) + u * lr *
   (|g_cohort| + |g_gloo|) + ulp(p); later steps only DDP's invariant.
   (The weights' gradients come from bfloat16 matmuls here, so most have
   few significant bits and their float32 sums are often exact: the bound
   is rarely approached.)
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

sys.dont_write_bytecode = True
import program2_check  # noqa: E402

STEPS = 8
LR = 0.001


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_autocast(backend, out):
    dist.init_process_group(backend)
    rank = dist.get_rank()
    print(f"Start running DDP with autocast on rank {rank}.")
    torch.manual_seed(rank)

    model = ToyModel()
    ddp_model = DDP(model)
    local_model = copy.deepcopy(model)  # the test's: local gradients

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=LR)

    record = {"rank": rank, "world": dist.get_world_size(), "lr": LR,
              "p0": program2_check.params(model)}
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, labels = torch.randn(20, 10), torch.randn(20, 5)
        if step == 0:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                local_loss = loss_fn(local_model(inputs), labels)
            local_loss.backward()
            record["local"] = program2_check.grads(local_model)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            outputs = ddp_model(inputs)
            loss = loss_fn(outputs, labels)
        loss.backward()
        if step == 0:
            record["reduced"] = program2_check.grads(model)
        optimizer.step()
        if step == 0:
            record["p1"] = program2_check.params(model)

    record["final"] = program2_check.params(model)
    program2_check.save(out, backend, rank, record)
    dist.barrier()  # every rank has written before any leaves
    dist.destroy_process_group()


if __name__ == "__main__":
    args = program2_check.parse_args(__doc__)
    if args.check:
        program2_check.check_ddp("program2_autocast", args.check[0], int(args.check[1]),
                                 torch.float32, lambda g, world: g.div(world))
    else:
        demo_autocast(args.backend, args.out)
