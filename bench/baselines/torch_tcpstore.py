#!/usr/bin/python3
"""torch's TCPStore, server and clients, made the same way on torch 1.13 and 2.x.

torch 2.x's TCPStore takes use_libuv (True by default since 2.4) and tells
which server it runs in `libuvBackend`; 1.13 has only the original server
(called "legacy" in 2.x) and neither. The baselines here build their stores
through server() and client() and print describe(), so a figure always says
which torch and which server produced it.

Run as a script it hosts one server on 127.0.0.1 until SIGTERM and prints
  serving the TCPStore protocol on 127.0.0.1:PORT (torch 2.11.0, TCPStore server: libuv)
to stderr (bench/torch_store_compare.py hosts torch's side so).

Usage: torch_tcpstore.py [--port=0] [--use_libuv=0|1]
"""
import argparse
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=600)
# The parameter exists from torch 2.2 on; pybind11 names it in the signature.
HAS_LIBUV = "use_libuv" in (dist.TCPStore.__init__.__doc__ or "")


def add_libuv_flag(parser):
    parser.add_argument(
        "--use_libuv", type=int, choices=(0, 1), default=None,
        help="torch 2.x: 1 runs the libuv server, 0 the legacy one; left out, "
             "torch's default (libuv from 2.4). torch 1.13 has only the legacy one.")


def server(use_libuv=None, port=0):
    """A TCPStore server on 127.0.0.1:port (0: a free port; read .port)."""
    kwargs = {}
    if use_libuv is not None and HAS_LIBUV:
        kwargs["use_libuv"] = bool(use_libuv)
    elif use_libuv:
        sys.exit(f"torch {torch.__version__} has no libuv TCPStore server (--use_libuv=1)")
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=TIMEOUT, **kwargs)


def client(port):
    """A TCPStore client with a connection of its own."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def describe(server_store):
    kind = "libuv" if getattr(server_store, "libuvBackend", False) else "legacy"
    return f"torch {torch.__version__}, TCPStore server: {kind}"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    add_libuv_flag(p)
    a = p.parse_args()
    s = server(a.use_libuv, a.port)
    print(f"serving the TCPStore protocol on 127.0.0.1:{s.port} ({describe(s)})",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
