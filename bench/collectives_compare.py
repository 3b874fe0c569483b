#!/usr/bin/python3
"""collectives_bench beside torch-gloo, in one run, alternating, medians.

Each round runs, one right after the other and for every --worlds:
  baselines/torch_gloo_bench.py W              (torch's ProcessGroupGloo)
  collectives_bench --world=W --transport=shm  (cohort, shared memory)
  collectives_bench --world=W --transport=tcp  (cohort, loopback TCP only)
and the table gives each figure's median over the rounds, the speed ratio
against torch (torch's time / cohort's, so > 1 is faster) and the shared-
memory busbw as a share of this machine's memcpy bandwidth (measured by
collectives_bench in the same run). reduce_scatter reads against torch's
all_reduce of the same bytes (torch's Gloo backend has no reduce_scatter).
It prints figures and asserts nothing.

The torch side runs under --python: /usr/bin/python3 (Debian's PyTorch
1.13) by default, or e.g. .venv/bin/python for PyTorch 2.x; the output
names the torch version that ran.

  bazel build //bench:collectives_bench
  bench/collectives_compare.py --rounds=5 --worlds=2,4
  bench/collectives_compare.py --rounds=5 --worlds=2,4 --python=.venv/bin/python
"""
import argparse
import collections
import os
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"^(\S+)\s+(\w+)\s+world=(\d+)\s+bytes=\s*(\d+)\s+time_us=\s*([\d.]+)"
                  r"\s+algbw_GBps=\s*([\d.]+)\s+busbw_GBps=\s*([\d.]+)")
MEMCPY = re.compile(r"^memcpy bytes=\s*\d+ GBps=\s*([\d.]+)")


def run(cmd, figures, memcpy):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"collectives_compare: {' '.join(cmd)} exited with {done.returncode}:\n{done.stderr}")
    for line in done.stdout.splitlines():
        m = LINE.match(line)
        if m:
            label, op, world, nbytes = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
            figures[(label, op, world, nbytes)].append((float(m.group(5)), float(m.group(7))))
        m = MEMCPY.match(line)
        if m:
            memcpy.append(float(m.group(1)))


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worlds", default="2")
    p.add_argument("--python", default="/usr/bin/python3",
                   help="the interpreter, hence the PyTorch, that runs --torch_script")
    p.add_argument("--torch_script", default=os.path.join(root, "bench", "baselines", "torch_gloo_bench.py"))
    p.add_argument("--bench", default=os.path.join(root, "bazel-bin", "bench", "collectives_bench"))
    p.add_argument("--ops", default="all_reduce,all_gather,broadcast,reduce_scatter")
    a = p.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    for path in (a.torch_script, a.bench):
        if not os.path.exists(path):
            sys.exit(f"collectives_compare: {path} does not exist (bazel build //bench:collectives_bench)")
    try:
        version = subprocess.run([a.python, "-c", "import torch; print(torch.__version__)"],
                                 capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"collectives_compare: --python={a.python}: {e}")
    if version.returncode != 0:
        sys.exit(f"collectives_compare: {a.python} cannot import torch:\n{version.stderr}")
    torch_version = version.stdout.strip()
    figures = collections.defaultdict(list)
    memcpy = []
    for r in range(a.rounds):
        for w in worlds:
            run([a.python, a.torch_script, str(w)], figures, memcpy)
            for t in ("shm", "tcp"):
                run([a.bench, f"--world={w}", f"--transport={t}", f"--ops={a.ops}"], figures, memcpy)
        print(f"round {r + 1} of {a.rounds} done", file=sys.stderr, flush=True)
    limit = statistics.median(memcpy)
    print(f"torch: {torch_version} ({a.python})")
    print(f"memcpy (one thread, 64 MiB): {limit:.2f} GB/s, median of {len(memcpy)} runs")
    print(f"medians of {a.rounds} rounds; speed = torch time / cohort time")
    print(f"{'op':<15}{'world':>6}{'bytes':>10}{'torch_us':>11}{'shm_us':>10}{'speed':>7}"
          f"{'tcp_us':>10}{'speed':>7}{'shm_busbw':>10}{'/memcpy':>8}")

    def med(key):
        v = figures.get(key)
        if not v:
            return None, None
        return statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)

    for op in a.ops.split(","):
        for w in worlds:
            sizes = sorted({k[3] for k in figures if k[1] == op and k[2] == w})
            for n in sizes:
                torch_op = "all_reduce" if op == "reduce_scatter" else op
                t_us, _ = med(("torch-gloo", torch_op, w, n))
                s_us, s_bus = med(("cohort-shm", op, w, n))
                c_us, _ = med(("cohort-tcp", op, w, n))
                fmt = lambda x, f: (f % x) if x is not None else "-"
                ratio = lambda c: f"{t_us / c:.2f}" if (t_us and c) else "-"
                share = f"{s_bus / limit:.2f}" if s_bus is not None else "-"
                print(f"{op:<15}{w:>6}{n:>10}{fmt(t_us, '%.1f'):>11}{fmt(s_us, '%.1f'):>10}{ratio(s_us):>7}"
                      f"{fmt(c_us, '%.1f'):>10}{ratio(c_us):>7}{fmt(s_bus, '%.2f'):>10}{share:>8}")


if __name__ == "__main__":
    main()
