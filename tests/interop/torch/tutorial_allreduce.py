#!/usr/bin/python3
"""run(rank, size) as "Writing Distributed Applications with PyTorch" writes
it, started as its launcher variant is: init_process_group("gloo") reads
MASTER_ADDR and MASTER_PORT from the environment (init_method env://), and
RANK and WORLD_SIZE come from there too. Nothing here knows of cohort:
tests/interop/torch_cohortrun_test.sh runs it under cohortrun."""
import os

import torch
import torch.distributed as dist


def run(rank, size):
    """ Simple collective communication. """
    group = dist.new_group(list(range(size)))
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    init_process(rank, size, run)
