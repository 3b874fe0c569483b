#!/usr/bin/python3
"""Hosts torch's own TCPStore server until killed: the reference the tests
and benchmarks compare cohortd with. Usage: tcpstore_server.py [PORT]
(0 or nothing: a free port). Logs the line cohortd logs, so callers parse
both alike."""
import signal
import sys
from datetime import timedelta

import torch.distributed as dist


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=600))
    print(f"tcpstore_server: serving the TCPStore protocol on 127.0.0.1:{store.port}",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
