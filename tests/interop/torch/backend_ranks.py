"""Runs the ranks of a torch job as separate processes, for the tests of the
torch.distributed backend "cohort" (worker/torch, module cohort_torch).

The parent launches `script --rank=R --world=W` W times with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (plain env://: rank 0 hosts
torch's TCPStore on a free port), waits for them with a deadline and prints
each rank's output. A rank imports cohort_torch from PYTHONPATH (the runner,
tests/interop/torch_backend_test.sh, points it at the built module).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import harness

PYTHON = harness.PYTHON


def parse_args(description, extra=None):
    """--worlds for the parent, --rank/--world for a rank (set by launch)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--worlds", default="2,3",
                   help="world sizes to run, one job each, in order")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    if extra:
        extra(p)
    return p.parse_args()


def import_backend():
    """torch.distributed and the cohort backend, or exits 1 (a failure, not a
    skip, when either is missing)."""
    dist = harness.import_torch()
    try:
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    except ImportError as e:
        print(f"FAIL: cannot import cohort_torch ({e}); PYTHONPATH="
              f"{os.environ.get('PYTHONPATH', '')!r} should hold the folder of "
              "bazel-bin/worker/torch/cohort_torch.so")
        sys.exit(1)
    return dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    def __init__(self, rank, proc, log_path):
        self.rank = rank
        self.proc = proc
        self.log_path = log_path

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")


def launch(script, world, args=(), name="job"):
    """Starts the `world` ranks of `script`; returns them (Rank objects)."""
    port = free_port()
    folder = harness.scratch_dir(f"{name}-world{world}")
    ranks = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        log_path = os.path.join(folder, f"rank{r}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [PYTHON, script, f"--rank={r}", f"--world={world}", *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env)
        ranks.append(Rank(r, proc, log_path))
    return ranks


def wait_all(ranks, deadline_s):
    """Waits for every rank; kills those still running after `deadline_s`.
    Prints each rank's output. Returns {rank: returncode} (None: killed for
    running past the deadline)."""
    end = time.monotonic() + deadline_s
    codes = {}
    for r in ranks:
        try:
            codes[r.rank] = r.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.send_signal(signal.SIGKILL)
            r.proc.wait()
            codes[r.rank] = None
    for r in ranks:
        status = ("killed after the deadline" if codes[r.rank] is None
                  else f"exit {codes[r.rank]}")
        print(f"---- rank {r.rank} ({status}):", flush=True)
        for line in r.output().splitlines():
            if "warnings.warn" in line or "UserWarning" in line:
                continue
            print(f"[rank {r.rank}] {line}", flush=True)
    return codes


def main(args, rank_main, name, deadline_s=90):
    """A rank (--rank given) runs rank_main(rank, world), which exits.
    Otherwise this is the parent: one job per world size of --worlds, in
    order; exits 1 if any rank of any job failed."""
    if args.rank >= 0:
        rank_main(args.rank, args.world)
        sys.exit(0)
    script = os.path.abspath(sys.argv[0])
    failed = 0
    for world in [int(w) for w in args.worlds.split(",")]:
        print(f"== {name}: world {world}", flush=True)
        t0 = time.monotonic()
        codes = wait_all(launch(script, world, name=name), deadline_s)
        bad = {r: c for r, c in codes.items() if c != 0}
        print(f"== {name}: world {world} took {time.monotonic() - t0:.1f}s"
              + (f"; FAILED ranks (exit codes): {bad}" if bad else ""),
              flush=True)
        failed += bool(bad)
    print(f"{name}: " + ("FAILED" if failed else "all jobs passed"))
    sys.exit(1 if failed else 0)
