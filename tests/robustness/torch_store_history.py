"""PyTorch's own TCPStore client as recorded clients of the linearizability
campaign: the same workload, keys and JSON Lines as tests/testing/store_history
(tests/robustness/lincheck/README.md), through cohortd's TCPStore listener.

torch's client sends "/" before every key, so the torch key "lin/g0/a" is
the store key "/lin/g0/a", the one gRPC clients use: the history records store
keys. A call that raises leaves the client's connection in an unknown state
(a timed-out get's answer may still arrive), so the client reconnects and goes
on as a new process, as store_history does after an unknown write.

  python torch_store_history.py --port 29400 --clients 2 --client-base 50 \
      --seconds 20 --out torch.jsonl
Runs until --seconds pass or SIGTERM, then writes the history.
"""
import argparse
import datetime
import json
import random
import signal
import threading
import time

import torch
import torch.distributed as dist

WRITES = {"set", "add", "cas", "delete", "multi_set", "append"}
# torch's client sends these and returns without an answer (the protocol
# has none for them): such a write is acknowledged only by the answer to a
# later call on the same connection.
UNANSWERED = {"set", "multi_set", "append"}
# torch's get and multi_get wait for the keys, then read them in a second
# request: a key deleted in between reads as "" (as from torch's own
# server). The checker's tcp_get and tcp_multi_get are that read: all keys
# at one point, a missing one as "".
RECORDED_AS = {"get": "tcp_get", "multi_get": "tcp_multi_get"}


class Client:
    def __init__(self, args, ident, stop):
        self.args = args
        self.ident = ident
        self.generation = 0
        self.seq = 0
        self.stop = stop
        self.rng = random.Random(args.seed + ident)
        self.store = None
        self.history = []
        self.can_multi = hasattr(dist.TCPStore, "multi_get")
        self.can_append = hasattr(dist.TCPStore, "append")

    def connect(self):
        while not self.stop.is_set():
            try:
                self.store = dist.TCPStore(
                    self.args.host, self.args.port, is_master=False,
                    timeout=datetime.timedelta(seconds=self.args.connect_timeout))
                self.store.set_timeout(
                    datetime.timedelta(milliseconds=self.args.op_timeout_ms))
                return True
            except Exception:  # cohortd is down or cut off: try again.
                time.sleep(0.2)
        return False

    def key(self, group, name):
        return "%sg%d/%s" % (self.args.prefix, group, name)

    def fresh(self):
        self.seq += 1
        return "t%d-%d" % (self.ident, self.seq)

    def next_op(self):
        g = self.rng.randrange(self.args.groups)
        skey = self.key(g, self.rng.choice("abc"))
        dice = self.rng.randrange(100)
        if dice < 20:
            return "set", [skey], [self.fresh()]
        if dice < 35:
            return "get", [skey], []
        if dice < 43:
            return "check", [skey, self.key(g, "n")], []
        if dice < 58:
            return "add", [self.key(g, "n")], [str(self.rng.randint(1, 5))]
        if dice < 68:
            return "cas", [skey], [self.rng.choice(["", "c0-1"]), self.fresh()]
        if dice < 73:
            return "delete", [skey], []
        if dice < 78:
            return "wait", [self.key(g, "a"), self.key(g, "b")], []
        if dice < 90 and self.can_multi:
            return "multi_get", [self.key(g, "a"), self.key(g, "b")], []
        if dice < 96 and self.can_multi:
            keys = [self.key(g, "a"), self.key(g, "b")]
            return "multi_set", keys, [self.fresh() for _ in keys]
        if self.can_append:
            return "append", [skey], ["+t%d.%d" % (self.ident, self.seq)]
        return "set", [skey], [self.fresh()]

    def apply(self, op, keys, values):
        s = self.store
        if op == "set":
            s.set(keys[0], values[0])
            return None
        if op == "get":
            return s.get(keys[0]).decode()
        if op == "check":
            return bool(s.check(keys))
        if op == "add":
            return int(s.add(keys[0], int(values[0])))
        if op == "cas":
            return s.compare_set(keys[0], values[0], values[1]).decode()
        if op == "delete":
            return bool(s.delete_key(keys[0]))
        if op == "wait":
            s.wait(keys, datetime.timedelta(milliseconds=self.args.op_timeout_ms))
            return None
        if op == "multi_get":
            return [v.decode() for v in s.multi_get(keys)]
        if op == "multi_set":
            s.multi_set(keys, values)
            return None
        s.append(keys[0], values[0])
        return None

    def settle(self, returned, error=None):
        """Completes the unanswered writes sent before the op that just
        ended: answered (the server handles a connection's requests in
        order) when it returned, else unknown."""
        for r in self.unanswered:
            r["return"] = returned
            if error is None:
                r["status"] = "ok"
            else:
                r["status"] = "unknown"
                r["error"] = "no later answer on this connection: " + error
            self.history.append(r)
        self.unanswered = []

    def run(self):
        self.unanswered = []
        self.pipelined = 0
        if not self.connect():
            return
        while not self.stop.is_set():
            op, keys, values = self.next_op()
            record = {"client": self.ident * 1000 + self.generation, "target": -1,
                      "op": RECORDED_AS.get(op, op), "keys": ["/" + k for k in keys], "values": values,
                      "call": time.time_ns()}
            try:
                out = self.apply(op, keys, values)
                record["return"] = time.time_ns()
                record["status"] = "ok"
                if out is not None:
                    record["out"] = out
            except Exception as e:  # torch raises RuntimeError subclasses.
                record["return"] = time.time_ns()
                record["status"] = "unknown" if op in WRITES else "fail"
                record["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.settle(record["return"], record["error"])
                self.generation += 1
                self.store = None
                time.sleep(self.args.backoff_ms / 1000)
                self.history.append(record)
                if not self.connect():
                    return
                continue
            if op in UNANSWERED:
                # It overlaps the calls after it on this connection, so it
                # is recorded as a client of its own.
                self.pipelined += 1
                record["client"] = (self.ident * 1000 + 999) * 1000000 + self.pipelined
                self.unanswered.append(record)
            else:
                self.settle(record["return"])
                self.history.append(record)
        if self.unanswered:  # An answered call confirms them.
            try:
                self.store.check(["lin/flush"])
                self.settle(time.time_ns())
            except Exception as e:
                self.settle(time.time_ns(), str(e).splitlines()[0] if str(e) else "error")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--client-base", type=int, default=50)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix", default="lin/")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--op-timeout-ms", type=int, default=500)
    p.add_argument("--connect-timeout", type=float, default=5)
    p.add_argument("--backoff-ms", type=int, default=200)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--out", required=True)
    args = p.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    clients = [Client(args, args.client_base + i, stop) for i in range(args.clients)]
    threads = [threading.Thread(target=c.run) for c in clients]
    for t in threads:
        t.start()
    stop.wait(args.seconds if args.seconds > 0 else None)
    stop.set()
    for t in threads:
        t.join()
    counts = {}
    with open(args.out, "w") as f:
        for c in clients:
            for r in c.history:
                f.write(json.dumps(r) + "\n")
                counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("torch_store_history: torch %s, %s: %s" % (
        torch.__version__, args.out,
        " ".join("%s=%d" % kv for kv in sorted(counts.items()))))


if __name__ == "__main__":
    main()
