"""A small DDP job for cohortrun: a linear-ReLU-linear model fits a fixed
random linear map. cohortrun sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (its proxy to cohortd's TCPStore listener), so the default env://
init needs nothing else. Rank 0 prints the loss, then checks that every rank
ended with the same parameters and exits 1 if not.
"""
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # The same initial parameters on every rank.
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    data = torch.Generator().manual_seed(1000 + rank)  # Each rank its own.

    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss={loss.item():.4f}", flush=True)

    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(everyone, params)
    equal = all(torch.equal(p, params) for p in everyone)
    if rank == 0:
        print(f"done world_size={world} params_equal={equal}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if equal else 1)


if __name__ == "__main__":
    main()
