#!/usr/bin/python3
"""torch.nn.parallel.DistributedDataParallel on the backend "cohort"
(cohort_torch) trains a small model to the same parameters as on torch's
gloo backend, in the same job: each rank builds two replicas of one model
(started from different weights on every rank, so DDP's broadcast of rank
0's state matters), wraps one in DDP over the default "cohort" group and
the other over new_group(backend="gloo"), feeds both the same batches and
compares every parameter and buffer after each step (within 1e-5). The
model has a BatchNorm (buffers broadcast every forward), an unused branch
on even steps (find_unused_parameters) and small buckets (several
all_reduces per backward); steps under no_sync() accumulate gradients.

Run: bazel test //tests/interop:torch_backend_ddp_test, or by hand
  PYTHONPATH=bazel-bin/worker/torch /usr/bin/python3 \
      tests/interop/torch/backend_ddp_test.py --worlds=2,3
"""
import sys
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import backend_ranks  # noqa: E402
import harness  # noqa: E402

args = backend_ranks.parse_args(__doc__)
dist = backend_ranks.import_backend()
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

STEPS = 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64),
                                  nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.extra = nn.Linear(64, 4)  # used on odd steps only

    def forward(self, x, use_extra):
        h = self.body(x)
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


def train(rank, world):
    c = harness.Checks(f"rank {rank} of {world}")
    dist.init_process_group("cohort", timeout=timedelta(seconds=30))
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    torch.manual_seed(100 + rank)  # different weights on every rank
    model = Net()
    replicas = {}
    for name, group in (("cohort", None), ("gloo", gloo)):
        replica = Net()
        replica.load_state_dict(model.state_dict())
        ddp = DDP(replica, process_group=group, bucket_cap_mb=0.01,
                  find_unused_parameters=True)
        replicas[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.05,
                                               momentum=0.9))
    c.eq("cohort replica's backend", dist.get_backend(), "cohort")

    def compare(when):
        cohort = replicas["cohort"][0].module.state_dict()
        gloo_ = replicas["gloo"][0].module.state_dict()
        for key, value in cohort.items():
            other = gloo_[key]
            if value.is_floating_point():
                same = torch.allclose(value, other, rtol=1e-5, atol=1e-6)
                diff = (value - other).abs().max().item()
            else:
                same, diff = torch.equal(value, other), "(integer)"
            c.ok(same, f"{when}: {key} differs between cohort and gloo "
                       f"(max |diff| {diff})")

    compare("after wrapping (rank 0's weights broadcast)")
    data = torch.Generator().manual_seed(7 + rank)
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        use_extra = step % 2 == 1
        accumulate = step % 4 == 2  # this step's gradients wait for the next
        for ddp, opt in replicas.values():
            if accumulate:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x, use_extra), y).backward()
            else:
                nn.functional.mse_loss(ddp(x, use_extra), y).backward()
                opt.step()
                opt.zero_grad()
        compare(f"after step {step + 1}")
    first = next(replicas["cohort"][0].module.parameters()).detach().clone()
    everyone = [torch.zeros_like(first) for _ in range(world)]
    dist.all_gather(everyone, first)
    c.ok(all(torch.equal(e, first) for e in everyone),
         "the cohort replicas differ between ranks")
    print(f"rank {rank}: {STEPS} steps; cohort and gloo replicas agree",
          flush=True)
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    backend_ranks.main(args, train, "backend_ddp_test")
