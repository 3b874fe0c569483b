#!/usr/bin/python3
"""Baseline: throughput and latency of PyTorch's own TCPStore on loopback.

One TCPStore server in this process (127.0.0.1, a free port) and CLIENTS
forked processes, each with a TCPStore client (so a connection) of its own.
For each of set, get and add: the clients connect and, for get, first write
their keys k<client>_<i>; once every client is ready they start together and
each makes OPS calls, one after the other (set and get on its own keys, add
on one shared counter). One line per op:

  torch-TCPStore op=get clients=8 value=64B ops=160000 wall=9.210s ops/s=17372 mean_latency_us=459.9

wall runs from the common start to the last client's end; ops/s is all calls
over wall; mean_latency_us is the clients' summed time over all calls.
TCPStore's set has no reply, so each set client ends with one num_keys(),
answered once the server has handled its sets: the clock covers sets the
server has applied. bench/store_bench --mode=ops prints cohort's figures in
the same fields.

Usage: torch_store_bench.py [CLIENTS=1] [OPS=20000] [VALUE_BYTES=64] [--use_libuv=0|1]
Runs on torch 1.13 (Debian's python3-torch) and 2.x alike.
"""
import argparse
import multiprocessing as mp
import sys
import time

import torch_tcpstore


def run_client(port, idx, n, value_bytes, op, ready, start, results):
    s = torch_tcpstore.client(port)
    value = b"x" * value_bytes
    if op == "get":
        for i in range(n):
            s.set(f"k{idx}_{i}", value)
    ready.put(idx)
    start.wait()
    t0 = time.perf_counter()
    if op == "set":
        for i in range(n):
            s.set(f"k{idx}_{i}", value)
        s.num_keys()
    elif op == "get":
        for i in range(n):
            s.get(f"k{idx}_{i}")
    else:
        for _ in range(n):
            s.add("counter", 1)
    results.put(time.perf_counter() - t0)


def measure(port, op, clients, n, value_bytes):
    ctx = mp.get_context("fork")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=run_client,
                         args=(port, i, n, value_bytes, op, ready, start, results))
             for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    t0 = time.perf_counter()
    start.set()
    busy = sum(results.get(timeout=600) for _ in procs)
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"torch_store_bench: a {op} client exited with {p.exitcode}")
    total = clients * n
    print(f"torch-TCPStore op={op} clients={clients} value={value_bytes}B ops={total} "
          f"wall={wall:.3f}s ops/s={total / wall:.0f} mean_latency_us={1e6 * busy / total:.1f}",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("clients", type=int, nargs="?", default=1)
    p.add_argument("ops", type=int, nargs="?", default=20000, help="calls per client and op")
    p.add_argument("value_bytes", type=int, nargs="?", default=64)
    torch_tcpstore.add_libuv_flag(p)
    a = p.parse_args()
    server = torch_tcpstore.server(a.use_libuv)
    print(f"# {torch_tcpstore.describe(server)}", flush=True)
    for op in ("set", "get", "add"):
        measure(server.port, op, a.clients, a.ops, a.value_bytes)


if __name__ == "__main__":
    main()
