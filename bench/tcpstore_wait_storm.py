#!/usr/bin/python3
"""10,000 blocked WAITs on cohortd's TCPStore listener, then one set.

Opens N raw TCP connections to the TCPStore port (RLIMIT_NOFILE raised to
its hard limit), each sending a PyTorch 1.13-dialect WAIT for one key:
  [u8 5 = WAIT][u64 LE count = 1][u64 LE key length][key]
with torch's "/" prefix on the key ("/storm/go"). Checks that no connection
is answered before the key exists, reads the server's thread count and RSS
from /proc/PID/status, then sets the key through a torch TCPStore client
and times until every connection has received its 1-byte STOP_WAITING
(0x00). Prints threads, RSS and the release time.

Usage: bench/tcpstore_wait_storm.py bazel-bin/server/cohortd [--conns=10000]
       bench/tcpstore_wait_storm.py --torch [--conns=10000]   (torch's own
       1.13 server in a separate process, for comparison)
"""
import argparse
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

PYTHON = "/usr/bin/python3"
WAIT, STOP_WAITING = 5, 0
KEY = "storm/go"
SERVING = re.compile(r"serving the TCPStore protocol on 127\.0\.0\.1:(\d+)")
TORCH_SERVER = """
import signal, sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=timedelta(seconds=600))
print(f"serving the TCPStore protocol on 127.0.0.1:{s.port}", file=sys.stderr, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    signal.pause()
"""


def start_server(args, workdir):
    log_path = os.path.join(workdir, "server.log")
    if args.torch:
        cmd = [PYTHON, "-c", TORCH_SERVER]
    else:
        cmd = [os.path.abspath(args.cohortd), "--listen=127.0.0.1:0",
               "--tcpstore_listen=127.0.0.1:0", "--engine=rocksdb",
               f"--data_dir={os.path.join(workdir, 'data')}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                preexec_fn=raise_nofile)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            m = SERVING.search(f.read())
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    with open(log_path, errors="replace") as f:
        sys.exit(f"server did not start: {' '.join(cmd)}\n{f.read()}")


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def proc_status(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024.0


def wait_request(key):
    raw = ("/" + key).encode()
    return bytes([WAIT]) + struct.pack("<QQ", 1, len(raw)) + raw


def open_waiters(port, n):
    request = wait_request(KEY)
    socks = []
    for i in range(n):
        for attempt in range(50):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.connect(("127.0.0.1", port))
                break
            except OSError:
                s.close()
                if attempt == 49:
                    raise
                time.sleep(0.05)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(request)
        s.setblocking(False)
        socks.append(s)
    return socks


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cohortd", nargs="?", help="path to cohortd (bazel-bin/server/cohortd)")
    ap.add_argument("--torch", action="store_true", help="torch's own server instead")
    ap.add_argument("--conns", type=int, default=10000)
    ap.add_argument("--quiet_s", type=float, default=1.0,
                    help="how long to watch for early replies before setting the key")
    args = ap.parse_args()
    if not args.torch and not args.cohortd:
        ap.error("give the cohortd binary, or --torch")
    nofile = raise_nofile()
    if nofile < args.conns + 256:
        sys.exit(f"RLIMIT_NOFILE hard limit {nofile} is below {args.conns} connections")
    import torch.distributed as dist  # after the fd check: importing torch is slow

    workdir = tempfile.mkdtemp(prefix="wait-storm-")
    proc, port = start_server(args, workdir)
    name = "torch TCPStore 1.13" if args.torch else "cohortd --engine=rocksdb"
    socks = []
    try:
        threads0, rss0 = proc_status(proc.pid)
        t0 = time.perf_counter()
        socks = open_waiters(port, args.conns)
        opened = time.perf_counter() - t0

        sel = selectors.DefaultSelector()
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        early = sel.select(timeout=args.quiet_s)
        threads1, rss1 = proc_status(proc.pid)
        if early:
            sys.exit(f"FAIL: {len(early)} of {args.conns} WAITs answered before {KEY!r} existed")

        setter = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=60))
        pending = len(socks)
        bad = 0
        t_set = time.perf_counter()
        setter.set(KEY, b"go")
        deadline = t_set + 120
        while pending and time.perf_counter() < deadline:
            for key, _ in sel.select(timeout=1.0):
                data = key.fileobj.recv(16)
                sel.unregister(key.fileobj)
                pending -= 1
                if data != bytes([STOP_WAITING]):
                    bad += 1
        release = time.perf_counter() - t_set
        threads2, rss2 = proc_status(proc.pid)

        print(f"{name}: {args.conns} connections blocked in WAIT on /{KEY}")
        print(f"  opened and sent in {opened:.2f} s; none answered in the {args.quiet_s:.1f} s "
              "before the set")
        print(f"  server threads: {threads0} idle, {threads1} with {args.conns} waiters, "
              f"{threads2} after release")
        print(f"  server RSS: {rss0:.1f} MB idle, {rss1:.1f} MB with {args.conns} waiters "
              f"({(rss1 - rss0) * 1024 / args.conns:.2f} KiB each), {rss2:.1f} MB after")
        print(f"  release: {args.conns - pending} of {args.conns} got STOP_WAITING in "
              f"{release * 1000:.1f} ms after the set ({bad} wrong replies)")
        if pending or bad:
            sys.exit(f"FAIL: {pending} never released, {bad} wrong replies")
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
