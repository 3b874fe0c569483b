#!/usr/bin/python3
"""demo_basic of "Getting Started with Distributed Data Parallel" in the
form it takes under torchrun (elastic_ddp.py), on the CPU with gloo: the
process group comes from the environment (env://), the ToyModel is wrapped
in DistributedDataParallel and trained with SGD. Two changes for a test:
each rank seeds its own data (so the gradients DDP averages differ), and
it trains a few steps and prints a digest of its final parameters, which
must be the same on every rank. Nothing here knows of cohort, except that
--backend=cohort imports cohort_torch first (it registers the backend
"cohort"; the default is "gloo"), and --save=PATH has rank 0 save the final
parameters (torch.save of the model's state_dict) for a test to compare.
Usage: tutorial_ddp.py [--backend=gloo|cohort] [--save=PATH]"""
import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(backend="gloo", save=None):
    dist.init_process_group(backend)
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(rank)

    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    for _ in range(5):
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
    parser.add_argument("--backend", default="gloo",
                        help='"gloo" or "cohort" (cohort\'s collectives)')
    parser.add_argument("--save", help="rank 0 saves the final parameters here")
    args = parser.parse_args()
    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    demo_basic(args.backend, args.save)
