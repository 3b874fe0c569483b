#!/usr/bin/python3
"""torchrun's c10d rendezvous against the store under test: two agents
(tools/torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d) rendezvous
at the store's TCPStore port, their 4 workers init_process_group("gloo")
from the environment and all_reduce (torchrun_worker.py checks the sum).

With 1.13 both agents see a loopback endpoint and try to host a TCPStore on
it first; the port is taken, so each falls back to being a client. The
workers' MASTER_ADDR:MASTER_PORT is not the rendezvous store: the rank-0
agent picks a free port and worker rank 0 hosts a TCPStore there."""
import json
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402

ct.import_torch()
TORCHRUN = os.path.join(ct.ROOT, "tools", "torchrun")
WORKER = os.path.join(ct.HERE, "torchrun_worker.py")
RUN_ID = "interop42"
WORLD = 4


def extra_flags(p):
    p.add_argument("--rdzv_conf", default="",
                   help="passed to torchrun as --rdzv_conf (e.g. is_host=False)")


def main():
    args = ct.parse_args(__doc__, extra_flags)
    c = ct.Checks("torchrun_test")
    b = ct.Backend(args, "torchrun")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    out_dir = ct.scratch_dir("torchrun/out")
    for f in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, f))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [ct.PYTHON, TORCHRUN, "--nnodes=2", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{b.port}",
           f"--rdzv_id={RUN_ID}", "--max_restarts=0", "--monitor_interval=0.2"]
    if args.rdzv_conf:
        cmd.append(f"--rdzv_conf={args.rdzv_conf}")
    cmd += [WORKER, out_dir]
    print(" ".join(cmd), flush=True)
    agents, logs = [], []
    try:
        t0 = time.monotonic()
        for i in range(2):
            log_path = os.path.join(b.dir, f"agent{i}.log")
            logs.append(log_path)
            with open(log_path, "wb") as log:
                agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env))
        for i, a in enumerate(agents):
            try:
                a.wait(timeout=max(1, 120 - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
            c.eq(f"agent {i} exit status", a.returncode, 0)
        print(f"both agents done in {time.monotonic() - t0:.1f}s", flush=True)

        reports = {}
        for r in range(WORLD):
            path = os.path.join(out_dir, f"rank{r}.json")
            if c.ok(os.path.exists(path), f"rank {r} wrote no report ({path})"):
                with open(path) as f:
                    reports[r] = json.load(f)
        for r, rep in sorted(reports.items()):
            c.eq(f"rank {r} world size", rep["world_size"], WORLD)
            c.eq(f"rank {r} all_reduce", rep["all_reduce"], rep["expected"])
            print(f"rank {r}: env {rep['env']} hosts MASTER_PORT: {rep['hosts_master_port']}")
        if reports:
            ports = {rep["env"]["MASTER_PORT"] for rep in reports.values()}
            c.eq("one MASTER_PORT for all workers", len(ports), 1)
            master_port = int(next(iter(ports)))
            c.ok(master_port != b.port,
                 "workers' MASTER_PORT is the rendezvous port (expected 1.13's own worker store)")
            c.eq("ranks hosting MASTER_PORT (1.13: worker rank 0)",
                 sorted(r for r, rep in reports.items() if rep["hosts_master_port"]), [0])
            c.eq("TORCHELASTIC_USE_AGENT_STORE (c10d backend)",
                 {rep["env"]["TORCHELASTIC_USE_AGENT_STORE"] for rep in reports.values()},
                 {"False"})

        if b.is_cohortd:
            rc, out, err = b.ctl("list")
            keys = out.split()
            rdzv = [k for k in keys if f"torch.rendezvous.{RUN_ID}" in k]
            print(f"rendezvous keys in cohortd: {rdzv}")
            c.ok(f"/torch.rendezvous.{RUN_ID}" in keys,
                 f"cohortctl list lacks /torch.rendezvous.{RUN_ID}: {keys} {err}")
            mp_key = f"/torch.rendezvous.{RUN_ID}.0/MASTER_PORT"
            if reports:
                c.eq(f"cohortctl get {mp_key}", b.ctl("get", mp_key, "--timeout=5")[1].strip(),
                     next(iter(reports.values()))["env"]["MASTER_PORT"])
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
        b.kill9()
        if c.failures:
            for path in logs:
                print(f"==== {path}")
                with open(path, errors="replace") as f:
                    print(f.read()[-6000:])
    c.finish()


if __name__ == "__main__":
    main()
