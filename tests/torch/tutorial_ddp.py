#!/usr/bin/python3
"""demo_basic of "Getting Started with Distributed Data Parallel" in the
form it takes under torchrun (elastic_ddp.py), on the CPU with gloo: the
process group comes from the environment (env://), the ToyModel is wrapped
in DistributedDataParallel and trained with SGD. Two changes for a test:
each rank seeds its own data (so the gradients DDP averages differ), and
it trains a few steps and prints a digest of its final parameters, which
must be the same on every rank. Nothing here knows of cohort."""
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


def demo_basic():
    dist.init_process_group("gloo")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    demo_basic()
