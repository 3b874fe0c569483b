#!/usr/bin/env python3
"""demo_basic of "Getting Started with Distributed Data Parallel" (a
ToyModel in DDP, SGD, each rank's own random batches, the process group
from torchrun's environment) with one of torch's DDP communication hooks,
registered as the "DDP Communication Hooks" documentation registers them:
  --hook=fp16      default_hooks.fp16_compress_hook
  --hook=bf16      default_hooks.bf16_compress_hook
  --hook=powersgd  powerSGD_hook.powerSGD_hook, rank 1, error feedback and
                   warm start; plain all-reduce for the first 2 iterations
It trains 8 steps. Run it under cohortrun
(tests/interop/torch2_programs_test.sh) with `--backend gloo|cohort --out DIR`:
"cohort" imports cohort_torch first, which registers the backend. Each rank
writes DIR/BACKEND/rank<R>.pt: the parameters after DDP's broadcast (p0), its
local step-1 gradients (a copy of the model, not in DDP, on the same batch),
the all-reduced step-1 gradients, the parameters after step 1 and at the end.
`--check DIR WORLD --hook=H` compares DIR/cohort with DIR/gloo.

What must hold, and why (program2_check.py defines gamma, u, S):
 - On each backend every rank holds the same p0, step-1 gradients, and
   parameters after step 1 and step 8: DDP's invariant.
 - Both backends broadcast the same p0 and see the same local gradients.
 - The step-1 all-reduce: each rank adds c_r, its gradient as the hook
   makes it (fp16: g.to(float16).div_(W); bf16: to bfloat16; PowerSGD's
   first iterations and plain DDP: g / W in float32), and DDP writes the
   sum back to the float32 gradients (an exact widening). With S = sum_r
   |c_r| and s = sum_r c_r exact, each backend's result is within
   gamma(W-1, u) * S (+ the terms sum_bound adds) of s, u that of the
   hook's dtype.
 - World 2: the sum is one addition a + b, which IEEE 754 rounds the same
   in either order; torch's gloo rounds it to the dtype, cohort's engine
   adds in float32 and rounds once, the same single rounding (a + b of two
   16-bit values is exact in float32, or, when their exponents are 16 or
   more apart, lands nowhere near a 16-bit midpoint). So the step-1
   gradient equals fl(c_0 + c_1) bit for bit, and as every later step
   repeats that (PowerSGD's P and Q included: SUM all-reduces of float32),
   the parameters after 8 steps are bit-identical on both backends.
 - World 4: the order of the 4-term sums may differ (gloo's ring versus
   cohort's), so step 1's gradients may differ by up to 2 * gamma(3, u) * S,
   and the parameters after one SGD step p - lr * g by lr * |g_cohort -
   g_gloo| * (1 + u) + u * lr * (|g_cohort| + |g_gloo|) + ulp(p) (u =
   2^-24; see sgd_bound). After more steps the difference compounds
   through the model and has no useful bound, so only DDP's invariant is
   checked there (for PowerSGD, whose compression starts at step 3, this
   is what world 4 checks of it; world 2 checks it bit for bit).
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
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


def demo_hook(hook, backend, out):
    dist.init_process_group(backend)
    rank = dist.get_rank()
    print(f"Start running DDP with the {hook} hook on rank {rank}.")
    torch.manual_seed(rank)

    model = ToyModel()
    ddp_model = DDP(model)
    if hook == "fp16":
        ddp_model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp_model.register_comm_hook(state=None, hook=default_hooks.bf16_compress_hook)
    else:
        state = powerSGD.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=1,
                                       start_powerSGD_iter=2,
                                       use_error_feedback=True,
                                       warm_start=True)
        ddp_model.register_comm_hook(state, powerSGD.powerSGD_hook)
    local_model = copy.deepcopy(model)  # the test's: local gradients

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=LR)

    record = {"rank": rank, "world": dist.get_world_size(), "lr": LR,
              "p0": program2_check.params(model)}
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, labels = torch.randn(20, 10), torch.randn(20, 5)
        if step == 0:
            loss_fn(local_model(inputs), labels).backward()
            record["local"] = program2_check.grads(local_model)
        outputs = ddp_model(inputs)
        loss_fn(outputs, labels).backward()
        if step == 0:
            record["reduced"] = program2_check.grads(model)
        optimizer.step()
        if step == 0:
            record["p1"] = program2_check.params(model)

    record["final"] = program2_check.params(model)
    program2_check.save(out, backend, rank, record)
    dist.barrier()  # every rank has written before any leaves
    dist.destroy_process_group()


def contribution(hook):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(hook, torch.float32)
    return dtype, lambda g, world: g.to(dtype).div_(world)


if __name__ == "__main__":
    args = program2_check.parse_args(__doc__, lambda p: p.add_argument(
        "--hook", required=True, choices=["fp16", "bf16", "powersgd"]))
    hook = args.hook
    if args.check:
        dtype, contribute = contribution(hook)
        program2_check.check_ddp(f"program2_ddp_hooks --hook={hook}", args.check[0],
                                 int(args.check[1]), dtype, contribute)
    else:
        demo_hook(hook, args.backend, args.out)
