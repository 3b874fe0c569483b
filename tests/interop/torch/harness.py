"""Shared by the torch interop tests: the store under test and the checks.

Every test script takes the same switch:
  --backend=torch    torch's own TCPStore server, hosted by tcpstore_server.py
                     in a separate process (validates the test logic)
  --backend=cohortd  cohortd with --tcpstore_listen, started here on a data
                     dir under TEST_TMPDIR; needs --cohortd and --cohortctl
Checks that need cohortctl (the gRPC side of the same store) or a restart
on the same data run only against cohortd.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

# The folder of the script being run, symlinks kept: under Bazel that is the
# runfiles tree, where tools/torchrun and the binaries also are.
HERE = os.path.dirname(os.path.abspath(sys.argv[0]))
# The workspace root in that tree (this folder is tests/interop/torch).
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
PYTHON = "/usr/bin/python3"
# How long a check waits for what must happen before it gives up and fails
# (only a broken store reaches it; it is not a bound on how fast).
GIVE_UP_S = 60


def import_torch():
    """Imports torch.distributed or exits 1: a missing torch fails the test."""
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
    except ImportError as e:
        print(f"FAIL: cannot import torch with {sys.executable}: {e} "
              "(install Debian's python3-torch; tools/setup.sh does)")
        sys.exit(1)
    if not dist.is_available():
        print("FAIL: torch.distributed is not available in this torch build")
        sys.exit(1)
    return dist


def parse_args(description, extra=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", choices=["torch", "cohortd"], default="torch")
    p.add_argument("--cohortd", default=os.environ.get("COHORTD", ""))
    p.add_argument("--cohortctl", default=os.environ.get("COHORTCTL", ""))
    if extra:
        extra(p)
    args = p.parse_args()
    if args.backend == "cohortd" and not (args.cohortd and args.cohortctl):
        p.error("--backend=cohortd needs --cohortd and --cohortctl")
    return args


_scratch_base = []


def scratch_dir(name):
    """A folder under TEST_TMPDIR (or under one temporary folder per run)."""
    if not _scratch_base:
        _scratch_base.append(os.environ.get("TEST_TMPDIR") or
                             tempfile.mkdtemp(prefix="cohort-torch-"))
    path = os.path.join(_scratch_base[0], name)
    os.makedirs(path, exist_ok=True)
    return path


class Checks:
    """Collects failures so one run reports all of them, like the sh tests."""

    def __init__(self, name):
        self.name = name
        self.failures = 0
        self.passed = 0

    def fail(self, what):
        self.failures += 1
        print(f"FAIL: {what}", flush=True)

    def ok(self, cond, what):
        if cond:
            self.passed += 1
        else:
            self.fail(what)
        return cond

    def eq(self, what, got, want):
        return self.ok(got == want, f"{what}: expected {want!r}, got {got!r}")

    def section(self, title, fn, *a):
        """Runs fn; an exception it raises is one failure, and the run goes on."""
        print(f"-- {title}", flush=True)
        t0 = time.monotonic()
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 (a test reports everything)
            self.fail(f"{title}: {type(e).__name__}: {e}")
            traceback.print_exc()
        print(f"   ({time.monotonic() - t0:.2f}s)", flush=True)

    def finish(self):
        if self.failures:
            print(f"{self.name}: {self.failures} check(s) failed, {self.passed} passed")
            sys.exit(1)
        print(f"{self.name}: all {self.passed} checks passed")
        sys.exit(0)


_SERVING_TCPSTORE = re.compile(r"serving the TCPStore protocol on 127\.0\.0\.1:(\d+)")
_SERVING_GRPC = re.compile(r"serving cohort\.v1\.Store on 127\.0\.0\.1:(\d+);")


class Backend:
    """A TCPStore-protocol server on 127.0.0.1: torch's or cohortd's."""

    # A client timeout that outlasts the test (test timeouts are at most 5
    # minutes): a call that must end some other way cannot end by it.
    LONG_S = 600.0

    def __init__(self, args, name="store"):
        self.kind = args.backend
        self.cohortd_bin = os.path.abspath(args.cohortd) if args.cohortd else ""
        self.cohortctl_bin = os.path.abspath(args.cohortctl) if args.cohortctl else ""
        self.dir = scratch_dir(name)
        self.data_dir = os.path.join(self.dir, "data")
        self.log_path = os.path.join(self.dir, "server.log")
        self.host = "127.0.0.1"
        self.port = 0
        self.grpc_addr = ""
        self.proc = None

    @property
    def is_cohortd(self):
        return self.kind == "cohortd"

    def start(self, port=0, grpc_port=0, flags=()):
        """Starts the server (port 0: a free one) and waits for its log line.
        flags: more cohortd flags."""
        log = open(self.log_path, "ab")
        mark = os.path.getsize(self.log_path)
        if self.is_cohortd:
            cmd = [self.cohortd_bin, f"--listen=127.0.0.1:{grpc_port}",
                   f"--tcpstore_listen=127.0.0.1:{port}", f"--data_dir={self.data_dir}",
                   *flags]
        else:
            cmd = [PYTHON, os.path.join(HERE, "tcpstore_server.py"), str(port)]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(mark)
                text = f.read().decode(errors="replace")
            m = _SERVING_TCPSTORE.search(text)
            g = _SERVING_GRPC.search(text)
            if m and (g or not self.is_cohortd):
                self.port = int(m.group(1))
                if g:
                    self.grpc_addr = f"127.0.0.1:{g.group(1)}"
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill9()
        raise RuntimeError(f"{' '.join(cmd)} did not start serving the TCPStore "
                           f"protocol; its log ({self.log_path}):\n{text}")

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait()

    def stop(self):
        """SIGTERM and wait; returns the exit status."""
        if not self.proc:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def client(self, dist, timeout_s=10.0):
        """A new torch client. 1.13 also uses the timeout to connect, and one
        under a second times out at once ("timed out after 0s while trying to
        connect"), so a short one is set after connecting, on a client made
        with LONG_S: a set_timeout that did not apply cannot time out within
        the test either."""
        store = dist.TCPStore(
            self.host, self.port, is_master=False,
            timeout=timedelta(seconds=timeout_s if timeout_s >= 10.0 else self.LONG_S))
        if timeout_s < 10.0:
            store.set_timeout(timedelta(seconds=timeout_s))
        return store

    def ctl(self, *argv, timeout=30):
        """Runs cohortctl against this cohortd; returns (rc, stdout, stderr)."""
        assert self.is_cohortd, "cohortctl talks only to cohortd"
        p = subprocess.run([self.cohortctl_bin, f"--addr={self.grpc_addr}", *argv],
                           capture_output=True, timeout=timeout)
        return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def run_phase(script, n, port, python=None, timeout_s=120):
    """Runs `script --phase=N --port=PORT` in a process of its own (a phase
    of a kill -9 test, with its own torch clients) and returns the JSON
    object its last line of output holds."""
    p = subprocess.run([python or sys.executable, script, f"--phase={n}", f"--port={port}"],
                       capture_output=True, timeout=timeout_s, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"phase {n} exited {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
