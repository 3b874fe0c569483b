#!/usr/bin/env python3
"""torch.distributed.checkpoint (DCP) as "Getting Started with Distributed
Checkpoint" and "Asynchronous Saving with DCP" write it: a model sharded
with FSDP2's fully_shard, an Adam optimizer, and an AppState (Stateful)
whose state_dict/load_state_dict are DCP's get_state_dict/set_state_dict.

  --phase save (world 4): trains 2 steps, dcp.save to OUT/BACKEND/sync;
      trains a third, dcp.async_save to OUT/BACKEND/async on a process
      group of its own (the recipe's advice: the save's collectives run in
      a thread beside training's), trains a fourth while it writes, then
      waits on its future. Rank 0 keeps the full (unsharded) model and
      optimizer state as of each save in OUT/BACKEND/saved-{sync,async}.pt.
  --phase load (world 2, so every parameter is resharded: FSDP2 splits
      dim 0 as torch.chunk does, net1's 12 rows 3+3+3+3 become 6+6 and
      net2's 5 rows 2+2+1+0 become 3+2): a fresh model from another seed loads each checkpoint of this
      backend and the other backend's sync one, if there; rank 0 keeps the
      full state as loaded in OUT/BACKEND/loaded-SOURCE-{sync,async}.pt.
  --check: every loaded state is bit for bit the one saved: both
      backends' own checkpoints, and each backend's written by the other.

Why exact: saving, resharding and loading move bytes (DCP writes each
rank's shards and reads back the slices each new shard overlaps; the full
state dicts are all-gathers, which copy) and do no arithmetic. The async
checkpoint must hold the state as of the call, not the fourth step's. What
the two backends train at world 4 may differ (FSDP2 reduce-scatters
gradients, and the order of a 4-term sum is the backend's): the check
never compares one backend's training with the other's.

Nothing here knows of cohort, except that --backend=cohort imports
cohort_torch first. Usage:
  program2_dcp.py --backend gloo|cohort --out DIR --phase save|load
  program2_dcp.py --check --out DIR
"""
import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from program2_compare import differences, report

BACKENDS = ("gloo", "cohort")


class AppState(Stateful):
    """The recipe's wrapper: DCP calls state_dict() when saving and
    load_state_dict() after loading, so the FQNs and the sharding are
    get_state_dict's."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(16, 12)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(12, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def new_model(seed):
    torch.manual_seed(seed)
    model = ToyModel()
    fully_shard(model.net1)
    fully_shard(model.net2)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, optimizer


def train_step(model, optimizer, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    optimizer.zero_grad()
    model(torch.randn(8, 16, generator=g)).sum().backward()
    optimizer.step()


def full_state(model, optimizer):
    """A copy of the whole model and optimizer state on rank 0 (None
    elsewhere). A copy: the gathered parameters are new tensors, but Adam's
    step counts come back as the optimizer's own, which it increments in
    place."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return None
    return copy.deepcopy({"model": model_sd, "optim": optim_sd})


def save_phase(backend, out):
    rank = dist.get_rank()
    folder = os.path.join(out, backend)
    model, optimizer = new_model(0)
    for step in range(2):
        train_step(model, optimizer, step, rank)

    state_dict = {"app": AppState(model, optimizer)}
    dcp.save(state_dict, checkpoint_id=os.path.join(folder, "sync"))
    saved = full_state(model, optimizer)
    if rank == 0:
        torch.save(saved, os.path.join(folder, "saved-sync.pt"))
        print(f"rank 0: saved {backend}'s checkpoint at step 2 to {folder}/sync", flush=True)

    train_step(model, optimizer, 2, rank)
    saved = full_state(model, optimizer)
    checkpoint_group = dist.new_group(backend=backend)
    checkpoint_future = dcp.async_save(state_dict, checkpoint_id=os.path.join(folder, "async"),
                                       process_group=checkpoint_group)
    train_step(model, optimizer, 3, rank)
    checkpoint_future.result()
    if rank == 0:
        torch.save(saved, os.path.join(folder, "saved-async.pt"))
        print(f"rank 0: saved {backend}'s checkpoint at step 3 to {folder}/async "
              "(async_save, with step 4 trained meanwhile)", flush=True)


def load_phase(backend, out):
    rank = dist.get_rank()
    other = BACKENDS[1 - BACKENDS.index(backend)]
    sources = [(backend, "sync"), (backend, "async")]
    if os.path.exists(os.path.join(out, other, "sync", ".metadata")):
        sources.append((other, "sync"))
    for source, kind in sources:
        model, optimizer = new_model(1)  # not the saved run's initial weights
        train_step(model, optimizer, 0, rank)  # Adam has state to replace
        state_dict = {"app": AppState(model, optimizer)}
        dcp.load(state_dict, checkpoint_id=os.path.join(out, source, kind))
        loaded = full_state(model, optimizer)
        if rank == 0:
            torch.save(loaded, os.path.join(out, backend, f"loaded-{source}-{kind}.pt"))
            print(f"rank 0: loaded {source}'s {kind} checkpoint on {backend} at world "
                  f"{dist.get_world_size()}", flush=True)


def check(out):
    failures = []
    loaded_count = 0
    for backend in BACKENDS:
        for source in BACKENDS:
            for kind in ("sync", "async"):
                path = os.path.join(out, backend, f"loaded-{source}-{kind}.pt")
                if not os.path.exists(path):
                    if source == backend or kind == "sync":
                        failures.append(f"{backend} did not load {source}'s {kind} "
                                        f"checkpoint: no {path}")
                    continue
                loaded_count += 1
                saved = torch.load(os.path.join(out, source, f"saved-{kind}.pt"))
                failures += differences(torch.load(path), saved,
                                        f"{source}'s {kind} checkpoint as {backend} loaded it")
    # Each checkpoint was written by the 4 ranks of the save phase.
    for source in BACKENDS:
        for kind in ("sync", "async"):
            folder = os.path.join(out, source, kind)
            files = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
            if len(files) != 4:
                failures.append(f"{folder} has {files}: not one file from each of 4 ranks")
    # The two saves are different states (the check would pass trivially
    # if, say, the async one were the sync one again).
    for backend in BACKENDS:
        sync, async_ = (torch.load(os.path.join(out, backend, f"saved-{k}.pt"))
                        for k in ("sync", "async"))
        if not differences(sync, async_, ""):
            failures.append(f"{backend}: the states at steps 2 and 3 are the same: "
                            "the optimizer did not step")
    return failures, loaded_count


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo",
                        help='"gloo" or "cohort" (cohort\'s collectives)')
    parser.add_argument("--out", required=True, help="the folder for checkpoints and states")
    parser.add_argument("--phase", choices=["save", "load"])
    parser.add_argument("--check", action="store_true",
                        help="compare what was loaded with what was saved")
    args = parser.parse_args()
    if args.check:
        failures, n = check(args.out)
        sys.exit(report(failures, f"dcp check: {n} checkpoints loaded vs saved"))
    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    dist.init_process_group(args.backend)
    {"save": save_phase, "load": load_phase}[args.phase](args.backend, args.out)
    if args.phase == "save":
        # Its async checkpointer's process is shut down at exit.
        dist.destroy_process_group()
    else:
        # Past the last collective, skip torch's gloo teardown, which now
        # and then aborts at interpreter exit
        # (program2_elastic.exit_past_teardown).
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
