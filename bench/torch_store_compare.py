#!/usr/bin/python3
"""The same torch.distributed.TCPStore client code against (a) torch's own
TCPStore server, hosted by a separate python process
(baselines/torch_tcpstore.py), and (b) cohortd's TCPStore listener
(--engine=rocksdb on a temporary data dir, so every write is durable), one
after the other, for several rounds. Prints every round's figures and a
markdown table of medians with the ratio cohort/torch.

PyTorch: that of --python, /usr/bin/python3 by default (Debian's
python3-torch, 1.13); --python=.venv/bin/python runs it all on PyTorch 2.x
(the script runs itself again under that interpreter, so the clients and
torch's server share one torch). The first lines name the torch version and
which of torch's servers ran (2.x: libuv by default, --use_libuv=0 the
legacy one).

Workloads, in the shapes of baselines/torch_store_bench.py and
baselines/torch_init_storm.py:
  set / get / add   C client processes (1 and 8), each its own TCPStore;
                    ops timed from a start event; ops/s = all ops / wall.
                    TCPStore's set has no reply, so each set client ends with
                    one num_keys() round trip: its sets were all served.
  init storm N      N ranks as threads of one process, each its own
                    TCPStore client: add('arrived'), set('addr/<r>', 64 B),
                    wait for every addr, get every addr (N^2 gets); wall s.

Usage: bench/torch_store_compare.py bazel-bin/server/cohortd [--rounds=3]
       [--ops=5000] [--storm=256,1024] [--quick] [--python=.venv/bin/python]
       [--use_libuv=0|1]
"""
import argparse
import multiprocessing as mp
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BASELINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines")
VALUE_BYTES = 64
SERVING = re.compile(r"serving the TCPStore protocol on 127\.0\.0\.1:(\d+)(?: \((.*)\))?")


class Server:
    """cohortd, or torch's server in a process of its own (so that neither
    side shares the GIL with the clients)."""

    def __init__(self, kind, cohortd, workdir, use_libuv=None):
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)
        self.log_path = os.path.join(self.dir, "server.log")
        if kind == "cohort":
            cmd = [cohortd, "--listen=127.0.0.1:0", "--tcpstore_listen=127.0.0.1:0",
                   "--engine=rocksdb", f"--data_dir={os.path.join(self.dir, 'data')}"]
        else:
            cmd = [sys.executable, os.path.join(BASELINES, "torch_tcpstore.py")]
            if use_libuv is not None:
                cmd.append(f"--use_libuv={use_libuv}")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as f:
                m = SERVING.search(f.read())
            if m:
                self.port = int(m.group(1))
                self.description = m.group(2)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        with open(self.log_path, errors="replace") as f:
            raise RuntimeError(f"{kind} server did not start: {' '.join(cmd)}\n{f.read()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def connect(port):
    return torch_tcpstore.client(port)


def op_client(port, idx, n, op, q, start_evt):
    s = connect(port)
    val = b"x" * VALUE_BYTES
    if op == "get":
        for i in range(n):
            s.set(f"k{idx}_{i}", val)
    q.put("ready")
    start_evt.wait()
    t0 = time.perf_counter()
    if op == "set":
        for i in range(n):
            s.set(f"k{idx}_{i}", val)
        s.num_keys()  # set has no reply: one round trip drains them
    elif op == "get":
        for i in range(n):
            s.get(f"k{idx}_{i}")
    elif op == "add":
        for i in range(n):
            s.add("counter", 1)
    q.put(time.perf_counter() - t0)


def ops_per_s(port, op, clients, n):
    ctx = mp.get_context("fork")
    q, ev = ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=op_client, args=(port, i, n, op, q, ev)) for i in range(clients)]
    for p in ps:
        p.start()
    for _ in ps:
        assert q.get(timeout=300) == "ready"
    t0 = time.perf_counter()
    ev.set()
    for _ in ps:
        q.get(timeout=600)
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{op} client exited {p.exitcode}")
    return clients * n / wall


def storm_ranks(port, n, tag, ranks, start, done):
    """Runs `ranks` (of n) as threads of this process; for storm_procs."""
    clients = {r: connect(port) for r in ranks}
    errors = []

    def rank(r):
        s = clients[r]
        try:
            s.add(f"{tag}/arrived", 1)
            s.set(f"{tag}/addr/{r}", b"a" * 64)
            s.wait([f"{tag}/addr/{p}" for p in range(n)])
            for p in range(n):
                s.get(f"{tag}/addr/{p}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    start.wait()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    done.put(repr(errors[0]) if errors else "")


def init_storm_procs(port, n, procs, tag):
    """The same storm with the ranks spread over `procs` processes, so the
    client's GIL no longer serialises them and the server's share shows."""
    ctx = mp.get_context("fork")
    start, done = ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=storm_ranks,
                      args=(port, n, tag, range(i, n, procs), start, done))
          for i in range(procs)]
    for p in ps:
        p.start()
    start.wait(timeout=600)
    t0 = time.perf_counter()
    errors = [done.get(timeout=1800) for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
    if any(errors):
        raise RuntimeError(f"init storm {n} over {procs} processes: {[e for e in errors if e][0]}")
    return wall


def init_storm(port, n, tag):
    clients = [connect(port) for _ in range(n)]
    wall = torch_init_storm.storm(clients, tag)
    del clients
    return wall


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cohortd", help="path to the cohortd binary (bazel-bin/server/cohortd)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", type=int, default=5000, help="ops per client process")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--storm", default="256,1024", help="init storm rank counts")
    ap.add_argument("--storm_procs", default="1",
                    help="client processes to spread each storm's ranks over "
                         "(1: threads of one process, as baselines/torch_init_storm.py)")
    ap.add_argument("--backends", default="torch,cohort",
                    help="which servers to run (torch alone needs no cohortd)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 round, 500 ops, storm of 64")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the interpreter whose PyTorch runs the clients and torch's server "
                         "(/usr/bin/python3: Debian's 1.13; .venv/bin/python: 2.x)")
    ap.add_argument("--use_libuv", type=int, choices=(0, 1), default=None,
                    help="torch 2.x: which server torch's side runs (1 libuv, 0 legacy); "
                         "left out, torch's default")
    args = ap.parse_args()
    python = shutil.which(args.python)
    if python is None:
        sys.exit(f"torch_store_compare: --python={args.python} is not an interpreter here")
    if os.path.abspath(python) != os.path.abspath(sys.executable):
        if os.environ.get("TORCH_STORE_COMPARE_REEXEC"):
            sys.exit(f"running under {sys.executable}, not {python}")
        os.environ["TORCH_STORE_COMPARE_REEXEC"] = "1"
        os.execv(python, [python, os.path.abspath(__file__)] + sys.argv[1:])
    # Imported only now, so that the torch is --python's.
    global torch_tcpstore, torch_init_storm
    sys.path.insert(0, BASELINES)
    import torch_tcpstore
    import torch_init_storm
    if args.quick:
        args.rounds, args.ops, args.storm = 1, 500, "64"
    backends = args.backends.split(",")
    clients = [int(x) for x in args.clients.split(",") if x]
    storms = [int(x) for x in args.storm.split(",") if x]
    storm_procs = [int(x) for x in args.storm_procs.split(",") if x]

    def storm_name(n, procs):
        return f"init storm {n}" + (f" ({procs} procs)" if procs > 1 else "")
    nofile = raise_nofile()
    if storms and 2 * max(storms) + 64 > nofile:
        sys.exit(f"RLIMIT_NOFILE hard limit {nofile} is too low for {max(storms)} ranks")
    cohortd = os.path.abspath(args.cohortd)
    workdir = tempfile.mkdtemp(prefix="torch-store-compare-")

    rows = [(f"{op} x{c}", "ops/s") for c in clients for op in ("set", "get", "add")]
    rows += [(storm_name(n, p), "s") for n in storms for p in storm_procs]
    results = {(name, kind): [] for name, _ in rows for kind in ("torch", "cohort")}
    print(f"# {args.rounds} round(s), {args.ops} ops per client, {VALUE_BYTES} B values, "
          f"{os.cpu_count()} cores; cohortd: {cohortd} --engine=rocksdb", flush=True)
    print(f"# clients: torch {torch_tcpstore.torch.__version__} ({sys.executable})", flush=True)
    torch_side = None
    try:
        for rnd in range(args.rounds):
            order = ("torch", "cohort") if rnd % 2 == 0 else ("cohort", "torch")
            for kind in (k for k in order if k in backends):
                server = Server(kind, cohortd, workdir, args.use_libuv)
                if kind == "torch" and torch_side is None:
                    torch_side = server.description
                    print(f"# torch's server: {torch_side}", flush=True)
                try:
                    for c in clients:
                        for op in ("set", "get", "add"):
                            v = ops_per_s(server.port, op, c, args.ops)
                            results[(f"{op} x{c}", kind)].append(v)
                            print(f"round {rnd} {kind:6} {op} x{c}: {v:,.0f} ops/s", flush=True)
                    for n in storms:
                        for procs in storm_procs:
                            tag = f"storm{n}p{procs}"
                            v = (init_storm(server.port, n, tag) if procs == 1
                                 else init_storm_procs(server.port, n, procs, tag))
                            results[(storm_name(n, procs), kind)].append(v)
                            print(f"round {rnd} {kind:6} {storm_name(n, procs)}: {v:.3f} s",
                                  flush=True)
                finally:
                    server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(f"| workload | unit | {torch_side or 'torch TCPStore'} (median of {args.rounds}) | "
          f"cohortd --engine=rocksdb | cohort/torch |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, unit in rows:
        t = statistics.median(results[(name, "torch")] or [float("nan")])
        c = statistics.median(results[(name, "cohort")] or [float("nan")])
        fmt = (lambda x: f"{x:,.0f}") if unit == "ops/s" else (lambda x: f"{x:.3f}")
        print(f"| {name} | {unit} | {fmt(t)} | {fmt(c)} | {c / t:.2f} |")
    print("\nops/s: higher is better; init storm seconds: lower is better "
          "(a ratio below 1 means cohortd was faster).")


if __name__ == "__main__":
    main()
