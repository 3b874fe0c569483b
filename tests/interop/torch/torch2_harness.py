"""What the torch 2.x interop tests (tests/interop/torch/torch2_*_test.py) add
to harness.py: they run on the project venv's PyTorch 2.x (tools/venv.sh; the
driver tests/interop/torch2_interop_test.sh starts them with it), and so does
the reference server of --backend=torch (tcpstore_server.py, torch's default
libuv server), so that each check holds against the torch it is about.
"""
import os
import re
import socket
import struct
import sys
from datetime import timedelta

import harness as ct

# The reference server and every process a test starts run on the
# interpreter running the test: the venv's.
ct.PYTHON = sys.executable
PYTHON = sys.executable


def import_torch2():
    """Imports torch.distributed 2.x or exits 1: a missing torch fails."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"FAIL: cannot import torch with {sys.executable}: {e} "
              "(tools/setup.sh makes the venv)")
        sys.exit(1)
    if int(torch.__version__.split(".")[0]) < 2:
        print(f"FAIL: {sys.executable} has torch {torch.__version__}, these tests "
              "are about 2.x (run them with the venv's python)")
        sys.exit(1)
    if not dist.is_available():
        print("FAIL: torch.distributed is not available in this torch build")
        sys.exit(1)
    return dist


def client(dist, b, timeout_s=10.0, use_libuv=True):
    """A TCPStore client of b. The constructor's timeout also bounds the
    connect, so a short one is set after connecting on a client made with
    ct.Backend.LONG_S (a set_timeout that did not apply cannot time out
    within the test either)."""
    store = dist.TCPStore(b.host, b.port, is_master=False, use_libuv=use_libuv,
                          timeout=timedelta(seconds=timeout_s if timeout_s >= 10.0
                                            else ct.Backend.LONG_S))
    if timeout_s < 10.0:
        store.set_timeout(timedelta(seconds=timeout_s))
    return store


# TCPStore's handshake in 2.x (TCPStoreBackend.hpp): VALIDATE (query 0,
# u32 magic, no reply), then PING (query 13, u32 nonce), echoed by the
# server. Nothing but a TCPStore server answers it.
_VALIDATE = bytes([0]) + struct.pack("<I", 0x3C85F7CE)
_PING = 13


def answers_tcpstore(host, port, timeout_s=5.0):
    """"tcpstore" if HOST:PORT echoes TCPStore's PING, "refused" if nothing
    listens there any more, "other" if it accepted but did not echo."""
    nonce = 0x5EED0000 | (port & 0xFFFF)
    try:
        s = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return "refused"
    with s:
        try:
            s.sendall(_VALIDATE + bytes([_PING]) + struct.pack("<I", nonce))
            got = b""
            while len(got) < 4:
                chunk = s.recv(4 - len(got))
                if not chunk:
                    break
                got += chunk
        except OSError:
            return "other"
    return "tcpstore" if got == struct.pack("<I", nonce) else "other"


def _socket_inodes(pid):
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(addr_hex):
    """/proc/net/tcp{,6}'s local address (32-bit words in host order) as a
    host to connect to: the wildcard addresses become loopback."""
    raw = bytes.fromhex(addr_hex)
    words = b"".join(struct.pack("@I", struct.unpack(">I", raw[i:i + 4])[0])
                     for i in range(0, len(raw), 4))
    if len(words) == 4:
        host = socket.inet_ntop(socket.AF_INET, words)
        return "127.0.0.1" if host == "0.0.0.0" else host
    host = socket.inet_ntop(socket.AF_INET6, words)
    if host == "::":
        return "127.0.0.1"  # a dual-stack wildcard
    return host[len("::ffff:"):] if host.startswith("::ffff:") else host


def _listening():
    """{inode: (host, port)} of every listening TCP socket in this network
    namespace (/proc/net/tcp{,6}, state 0A)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A":
                        addr_hex, port_hex = local.rsplit(":", 1)
                        out[inode] = (_address(addr_hex), int(port_hex, 16))
        except FileNotFoundError:
            pass
    return out


def job_listeners(root_pids):
    """(pid, host, port) of every listening TCP socket of root_pids and the
    processes below them."""
    listening = _listening()
    found = []
    for pid in sorted(descendants(root_pids)):
        for inode in _socket_inodes(pid):
            if inode in listening:
                found.append((pid, *listening[inode]))
    return found


def descendants(root_pids):
    """root_pids and every process below them, from /proc/*/stat."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may hold spaces and parentheses: the fields follow the last ")".
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), list(root_pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, []))
    return seen


_TIMEOUT_MESSAGE = re.compile(r"^wait timeout after (\d+)ms, keys: (.*)$")


def timeout_message(e):
    """(ms, keys) of torch 2.x's store timeout message, or None."""
    m = _TIMEOUT_MESSAGE.match(str(e).strip())
    return (int(m.group(1)), m.group(2)) if m else None
