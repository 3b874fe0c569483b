#!/usr/bin/python3
"""Baseline: the store traffic of RANKS ranks initialising a Gloo-style full
mesh, against PyTorch's own TCPStore server.

One TCPStore server in this process (127.0.0.1, a free port); RANKS threads,
each with a TCPStore client (so a connection) of its own, connected before
the clock starts. Released together, every rank does
  add("arrived", 1); set("addr/<rank>", 64 B); wait(every "addr/*");
  then get("addr/<r>") for every r,
so RANKS^2 gets, as Gloo's connectFullMesh reads every peer's address. It
prints the wall time from the release until the last rank is done:

  torch-TCPStore init-storm ranks=256 gets=65536 wall_s=3.958

bench/store_bench --mode=init_storm runs the same against cohortd
(--storm_gets=single is exactly this traffic).

Usage: torch_init_storm.py [RANKS=128] [--use_libuv=0|1]
Runs on torch 1.13 (Debian's python3-torch) and 2.x alike. Each rank holds two
descriptors (its client and the server's end), so RLIMIT_NOFILE is raised to
its hard limit.
"""
import argparse
import resource
import sys
import threading
import time

import torch_tcpstore


def storm(clients, tag=""):
    """Runs the storm on `clients` (one connected TCPStore client per rank),
    keys under `tag` + "/" when given; returns the wall time in seconds from
    the release until the last rank is done. Raises on any rank's error."""
    n = len(clients)
    key = (lambda k: f"{tag}/{k}") if tag else (lambda k: k)
    release = threading.Barrier(n + 1)
    errors = []

    def rank(r):
        s = clients[r]
        release.wait()
        try:
            s.add(key("arrived"), 1)
            s.set(key(f"addr/{r}"), b"a" * 64)
            s.wait([key(f"addr/{peer}") for peer in range(n)])
            for peer in range(n):
                s.get(key(f"addr/{peer}"))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    release.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"init storm: {len(errors)} of {n} ranks failed; first: {errors[0]}")
    return wall


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ranks", type=int, nargs="?", default=128)
    torch_tcpstore.add_libuv_flag(p)
    a = p.parse_args()
    n = a.ranks
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    server = torch_tcpstore.server(a.use_libuv)
    print(f"# {torch_tcpstore.describe(server)}", flush=True)
    clients = [torch_tcpstore.client(server.port) for _ in range(n)]
    try:
        wall = storm(clients)
    except RuntimeError as e:
        sys.exit(f"torch_init_storm: {e}")
    print(f"torch-TCPStore init-storm ranks={n} gets={n * n} wall_s={wall:.3f}", flush=True)


if __name__ == "__main__":
    main()
