#!/usr/bin/env python3
"""demo_basic of "Getting Started with Distributed Data Parallel" (as
tests/interop/torch/tutorial_ddp.py has it: a ToyModel in DDP, SGD, each rank's
own random batches) with one of torch's DDP communication hooks registered the
way the "DDP Communication Hooks" documentation registers them:
  --hook=fp16      default_hooks.fp16_compress_hook (gradients all-reduced
                   in float16)
  --hook=bf16      default_hooks.bf16_compress_hook (in bfloat16)
  --hook=powersgd  powerSGD_hook.powerSGD_hook with a PowerSGDState: rank-1
                   gradient compression with error feedback and warm start,
                   plain all-reduce for the first 2 iterations
It trains 8 steps and prints a digest of its final parameters, which must
be the same on every rank. Nothing here knows of cohort, except that
--backend=cohort imports cohort_torch first (it registers the backend
"cohort"; the default is "gloo"), and --save=PATH has rank 0 save the final
parameters (torch.save of the model's state_dict) for a test to compare.
Usage: backend2_ddp_hooks.py --hook=fp16|bf16|powersgd [--backend=gloo|cohort]
       [--save=PATH]"""
import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_hook(hook, backend="gloo", save=None):
    dist.init_process_group(backend)
    rank = dist.get_rank()
    print(f"Start running DDP with the {hook} hook on rank {rank}.")
    torch.manual_seed(rank)

    model = ToyModel()
    ddp_model = DDP(model)
    if hook == "fp16":
        ddp_model.register_comm_hook(state=None,
                                     hook=default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp_model.register_comm_hook(state=None,
                                     hook=default_hooks.bf16_compress_hook)
    else:
        state = powerSGD.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=1,
                                       start_powerSGD_iter=2,
                                       use_error_feedback=True,
                                       warm_start=True)
        ddp_model.register_comm_hook(state, powerSGD.powerSGD_hook)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    for _ in range(8):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    print(f"rank {rank} of {dist.get_world_size()}: params {digest.hexdigest()}")
    if save and rank == 0:
        torch.save(model.state_dict(), save)
        print(f"rank 0: saved the {dist.get_backend()} job's parameters to {save}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--hook", required=True,
                        choices=["fp16", "bf16", "powersgd"])
    parser.add_argument("--backend", default="gloo",
                        help='"gloo" or "cohort" (cohort\'s collectives)')
    parser.add_argument("--save", help="rank 0 saves the final parameters here")
    args = parser.parse_args()
    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    demo_hook(args.hook, args.backend, args.save)
