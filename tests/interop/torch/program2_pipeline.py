#!/usr/bin/env python3
"""torch.distributed.pipelining as "Introduction to Distributed Pipeline
Parallelism" writes it: the tutorial's small Transformer split in 2 stages
(one process each), trained a few steps of SGD with 4 microbatches, three
ways:
  manual-gpipe  the tutorial's manual split (each rank deletes the layers
                it does not run) into a PipelineStage, ScheduleGPipe;
  manual-1f1b   the same stages under Schedule1F1B;
  tracer-1f1b   the tracer frontend: pipeline() with a SplitPoint before
                layers.2, pipe.build_stage, Schedule1F1B.
Each rank saves its stage's final parameters and the last stage the
losses, as OUT/BACKEND/NAME.rank<r>.pt. Nothing here knows of cohort,
except that --backend=cohort imports cohort_torch first. The tutorial's
TransformerDecoderLayer has dropout 0.1; here it is 0, so that the run is a
function of the seed alone and a single process can redo it (below).

--check compares, bit for bit, what the runs on "cohort" and on "gloo"
saved under OUT, and both with a single process that trains the unsplit
model the way the schedules do (the steps of _reference). Why exact: the
stages exchange activations and their gradients by send/recv, copies with
no arithmetic; there are no reductions. Every stage therefore runs the same
kernels on the same inputs in both jobs and in the single process: the
forward of each microbatch, its backward (the last stage's loss, then
autograd.backward of stage 0's output with the gradient received, which is
what autograd does at that point of the whole graph), the gradients summed
into .grad microbatch by microbatch in order (GPipe and 1F1B both run the
backwards in microbatch order), then divided by the number of microbatches
(scale_grads) and applied by SGD.

Usage: program2_pipeline.py --backend gloo|cohort --out DIR
       program2_pipeline.py --check --out DIR
"""
import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from program2_compare import differences, report
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          SplitPoint, pipeline)

RUNS = ["manual-gpipe", "manual-1f1b", "tracer-1f1b"]
STEPS = 3
N_MICROBATCHES = 4
BATCH, SEQ = 8, 6
LR = 0.05


@dataclass
class ModelArgs:
    dim: int = 16
    n_layers: int = 4
    n_heads: int = 2
    vocab_size: int = 32


class Transformer(nn.Module):
    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # ModuleDict lets the manual split delete layers and keep the FQNs.
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim, model_args.n_heads, dim_feedforward=32, dropout=0.0,
                batch_first=True)
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor):
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        output = self.output(h).clone() if self.output else h
        return output


def tokenwise_loss_fn(outputs, targets):
    loss_fn = nn.CrossEntropyLoss()
    outputs = outputs.reshape(-1, ModelArgs.vocab_size)
    targets = targets.reshape(-1)
    return loss_fn(outputs, targets)


def batch(step):
    """Step `step`'s tokens and targets, the same in every run."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, ModelArgs.vocab_size, (BATCH, SEQ), generator=g)
    y = torch.randint(0, ModelArgs.vocab_size, (BATCH, SEQ), generator=g)
    return x, y


def new_model():
    torch.manual_seed(0)
    return Transformer(ModelArgs())


def manual_model_split(model, stage_index, num_stages):
    if stage_index == 0:
        # prepare the first stage model
        for i in range(2, 4):
            del model.layers[str(i)]
        model.norm = None
        model.output = None
    elif stage_index == 1:
        # prepare the second stage model
        for i in range(2):
            del model.layers[str(i)]
        model.tok_embeddings = None
    return PipelineStage(model, stage_index, num_stages, torch.device("cpu"))


def tracer_model_split(model, rank, world_size):
    x, _ = batch(0)  # a microbatch for the tracer
    pipe = pipeline(model, mb_args=(x.chunk(N_MICROBATCHES)[0],),
                    split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    return stage, stage.submod


def train(run, rank, world_size):
    """One of RUNS; returns (the stage's module, the losses or None)."""
    frontend, schedule_name = run.split("-")
    model = new_model()
    if frontend == "manual":
        stage = manual_model_split(model, rank, world_size)
        module = model
    else:
        stage, module = tracer_model_split(model, rank, world_size)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    Schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = Schedule(stage, n_microbatches=N_MICROBATCHES, loss_fn=tokenwise_loss_fn)
    all_losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == 1:
            losses = []
            schedule.step(target=y, losses=losses)
            all_losses.append(torch.stack([l.detach() for l in losses]))
        optimizer.step()
    return module, (torch.stack(all_losses) if all_losses else None)


def run_all(backend, out):
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert world_size == 2, f"the model is split in 2 stages, not {world_size}"
    os.makedirs(os.path.join(out, backend), exist_ok=True)
    for run in RUNS:
        module, losses = train(run, rank, world_size)
        params = {k: v.detach().clone() for k, v in module.state_dict().items()}
        torch.save({"params": params, "losses": losses, "threads": torch.get_num_threads()},
                   os.path.join(out, backend, f"{run}.rank{rank}.pt"))
        print(f"rank {rank}: {run} on {backend}: trained {STEPS} steps"
              + (f", last losses {losses[-1].tolist()}" if losses is not None else ""),
              flush=True)
    dist.destroy_process_group()


def _reference():
    """The unsplit model trained in one process as the schedules train it:
    per microbatch forward, loss and backward in order, grads divided by the
    number of microbatches, SGD. Returns (state_dict, losses [STEPS, N])."""
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    all_losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        losses = []
        for xm, ym in zip(x.tensor_split(N_MICROBATCHES), y.tensor_split(N_MICROBATCHES)):
            loss = tokenwise_loss_fn(model(xm), ym)
            loss.backward()
            losses.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(N_MICROBATCHES)
        optimizer.step()
        all_losses.append(torch.stack(losses))
    return model.state_dict(), torch.stack(all_losses)


def check(out):
    """Returns the list of failures, each a sentence that says what to look at."""
    failures = []
    runs = {(run, b): [torch.load(os.path.join(out, b, f"{run}.rank{r}.pt")) for r in (0, 1)]
             for run in RUNS for b in ("gloo", "cohort")}
    # CPU kernels may split their sums among threads: the single process
    # runs on as many as the stages did (the harness sets 1).
    threads = {rank["threads"] for ranks in runs.values() for rank in ranks}
    if len(threads) != 1:
        return [f"the stages ran on different numbers of threads {threads}: "
                "set OMP_NUM_THREADS for all"]
    torch.set_num_threads(threads.pop())
    ref_params, ref_losses = _reference()
    for run in RUNS:
        saved = {b: runs[run, b] for b in ("gloo", "cohort")}
        for backend, ranks in saved.items():
            # Both frontends keep the model's FQNs.
            params = {**ranks[0]["params"], **ranks[1]["params"]}
            failures += differences({"params": params, "losses": ranks[1]["losses"]},
                                    {"params": ref_params, "losses": ref_losses},
                                    f"{run} on {backend} vs one process")
        for r in (0, 1):
            failures += differences(saved["cohort"][r], saved["gloo"][r],
                                    f"{run}: stage {r} on cohort vs gloo")
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo",
                        help='"gloo" or "cohort" (cohort\'s collectives)')
    parser.add_argument("--out", required=True, help="the folder for the runs' results")
    parser.add_argument("--check", action="store_true",
                        help="compare the runs under --out with each other and one process")
    args = parser.parse_args()
    if args.check:
        sys.exit(report(check(args.out),
                        f"pipeline check: {len(RUNS)} runs on cohort and gloo, and one process"))
    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    run_all(args.backend, args.out)
