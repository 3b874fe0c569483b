#!/usr/bin/env python3
"""The Trainer of "Fault-tolerant Distributed Training with torchrun", with
its snapshot in torch.distributed.checkpoint (DCP) rather than torch.save:
a model in DistributedDataParallel, SGD with momentum; at start it loads
the newest complete checkpoint under OUT/checkpoints, if any, and resumes
after its step; after every SAVE_EVERY steps it saves one
(get_state_dict/set_state_dict of the model and optimizer, and the step).
The data of a step is a function of the step and the rank, so a resumed
run trains on what an uninterrupted one would. Rank 0 saves the final
model and optimizer state, and the step each round started from, to
OUT/final.pt.

Under tests/interop/torch/torch2_kill_worker.py in cohortrun with
--max-restarts=1, rank 1 SIGKILLs itself after its 2nd optimizer step in the
first round: after the checkpoint of step 1, before that of step 2. The
launcher restarts the round, and this program resumes from step 1.

--check compares the runs under OUT (gloo-kill, cohort-kill, gloo-whole,
cohort-whole: on each backend, killed and resumed, and uninterrupted):
the final states must be bit-identical, and the killed runs must have
resumed from step 1 in round 1. Why exact: a DCP checkpoint stores and
restores the parameters and the momentum buffers byte for byte, so the
resumed steps start from the state the uninterrupted run had; each step's
data is the same; and at world 2 DDP's gradient all-reduce is one IEEE
addition per element, which rounds the same in either order and on
either backend. So every step after the resume repeats the uninterrupted
run's arithmetic exactly, and the two backends' runs agree too.

Nothing here knows of cohort, except that --backend=cohort imports
cohort_torch first. Usage:
  program2_elastic.py --backend gloo|cohort --out DIR
  program2_elastic.py --check --out DIR
"""
import argparse
import faulthandler
import json
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from program2_compare import differences, report

TOTAL_STEPS = 6
SAVE_EVERY = 1
RUNS = ["gloo-kill", "cohort-kill", "gloo-whole", "cohort-whole"]


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class Trainer:
    def __init__(self, model, optimizer, out):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.optimizer = optimizer
        self.out = out
        self.checkpoints = os.path.join(out, "checkpoints")
        self.steps_run = 0
        self.history = []
        step = self._latest_checkpoint()
        if step is not None:
            print(f"Loading snapshot of step {step}")
            self._load_snapshot(step)
        self.history.append((int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                             self.steps_run))
        print(f"rank {self.rank}: round {self.history[-1][0]} starts after step "
              f"{self.steps_run}", flush=True)

    def _latest_checkpoint(self):
        """The newest step whose checkpoint is complete (DCP writes its
        .metadata last, once every rank's data is written)."""
        if not os.path.isdir(self.checkpoints):
            return None
        steps = [int(m.group(1)) for name in os.listdir(self.checkpoints)
                 if (m := re.fullmatch(r"step-(\d+)", name))
                 and os.path.exists(os.path.join(self.checkpoints, name, ".metadata"))]
        return max(steps, default=None)

    def _state(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd,
                "progress": {"steps_run": self.steps_run, "history": json.dumps(self.history)}}

    def _load_snapshot(self, step):
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(self.checkpoints, f"step-{step}"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.steps_run = state["progress"]["steps_run"]
        self.history = json.loads(state["progress"]["history"])
        assert self.steps_run == step, (self.steps_run, step)

    def _save_snapshot(self):
        dcp.save(self._state(),
                 checkpoint_id=os.path.join(self.checkpoints, f"step-{self.steps_run}"))
        print(f"rank {self.rank}: step {self.steps_run}: checkpoint saved", flush=True)

    def _run_batch(self, step):
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        source = torch.randn(20, 10, generator=g)
        targets = torch.randn(20, 5, generator=g)
        self.optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def train(self, total_steps):
        while self.steps_run < total_steps:
            self._run_batch(self.steps_run)
            self.steps_run += 1
            if self.steps_run % SAVE_EVERY == 0:
                self._save_snapshot()

    def save_final(self):
        if self.rank == 0:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            torch.save({"model": model_sd, "optim": optim_sd, "history": self.history},
                       os.path.join(self.out, "final.pt"))
            print(f"rank 0: trained {self.steps_run} steps, rounds {self.history}", flush=True)


def main(backend, out):
    # An abort prints the Python stack it happened under.
    faulthandler.enable()
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, optimizer, out)
    trainer.train(TOTAL_STEPS)
    trainer.save_final()
    # A rank still here a minute later prints every thread's stack.
    faulthandler.dump_traceback_later(60)
    exit_past_teardown()


def exit_past_teardown():
    """Ends the process once every rank is past its last collective.

    torch 2.11's gloo now and then hangs in destroy_process_group, or aborts
    in the interpreter's teardown ("terminate called without an active
    exception": its worker threads outlive the interpreter, the race
    pytorch/pytorch#179291 describes), a few times in a loaded full suite.
    The results are on disk and, past the barrier, no rank needs another;
    so the process exits at once and skips that teardown.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check(out):
    finals = {}
    failures = []
    for run in RUNS:
        path = os.path.join(out, run, "final.pt")
        if not os.path.exists(path):
            failures.append(f"{run}: no {path}: the job did not finish")
            continue
        finals[run] = torch.load(path)
        want = [(0, 0), (1, 1)] if run.endswith("kill") else [(0, 0)]
        history = [tuple(h) for h in finals[run].pop("history")]
        if history != want:
            failures.append(f"{run}: the rounds started after steps {history} "
                            f"(round, step), expected {want}")
    for run in finals:
        if run != "gloo-whole" and "gloo-whole" in finals:
            failures += differences(finals[run], finals["gloo-whole"],
                                    f"{run}'s final state vs gloo-whole's")
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo",
                        help='"gloo" or "cohort" (cohort\'s collectives)')
    parser.add_argument("--out", required=True, help="the run's folder (with --check: all runs')")
    parser.add_argument("--check", action="store_true",
                        help="compare the final states of the runs under --out")
    args = parser.parse_args()
    if args.check:
        sys.exit(report(check(args.out),
                        f"elastic check: {', '.join(RUNS)}: final states"))
    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    main(args.backend, args.out)
