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
Runs until --seconds pass or SIGTERM. Each completed operation is appended
to OUT at once; those in flight are kept in OUT.inflight.<client> (as
unknown) and removed at a clean exit. torch 1.13's client can abort the
process when cohortd resets its connection (a background thread throws):
the test then appends the in-flight files and starts the client again
under new client numbers (linearizability_test.sh).
"""
import argparse
import datetime
import json
import os
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
    def __init__(self, args, ident, stop, sink):
        self.args = args
        self.sink = sink
        self.inflight_path = "%s.inflight.%d" % (args.out, ident)
        self.ident = ident
        self.generation = 0
        self.seq = 0
        self.stop = stop
        self.rng = random.Random(args.seed + ident)
        self.store = None
        self.broken = []
        self.can_multi = hasattr(dist.TCPStore, "multi_get")
        self.can_append = hasattr(dist.TCPStore, "append")
        self.can_check = hasattr(dist.TCPStore, "check")  # not in 1.13

    def record(self, r):
        """Appends a completed operation to the history file at once, so
        that a crash loses nothing but the operations in flight."""
        with self.sink.lock:
            self.sink.file.write(json.dumps(r) + "\n")
            self.sink.file.flush()
            self.sink.counts[r["status"]] = self.sink.counts.get(r["status"], 0) + 1

    def in_flight(self, records):
        """Keeps the operations about to run in OUT.inflight.<client>, as of
        unknown outcome: if torch takes the process down meanwhile, the
        test appends them to the history (a call whose end nobody saw)."""
        with open(self.inflight_path, "w") as f:
            for r in records:
                f.write(json.dumps(dict(r, status="unknown", **{"return": r["call"]})) + "\n")

    def drop_connection(self):
        """Leaves the broken client alive: torch 1.13's TCPStore can abort
        the process from its destructor when its connection was reset
        ("terminate called ... Connection reset by peer"). They are never
        destroyed: main() leaves with os._exit."""
        self.broken.append(self.store)
        self.store = None

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

    def fresh(self):
        self.seq += 1
        return "t%d-%d" % (self.ident, self.seq)

    def next_op(self):
        g = self.rng.randrange(self.args.groups)
        # The wall clock's epoch, as store_history's (its header says why),
        # once for all of the op's keys.
        epoch = time.time_ns() // (self.args.epoch_seconds * 1000000000)
        key = lambda name: "%se%dg%d/%s" % (self.args.prefix, epoch, g, name)
        skey = key(self.rng.choice("abc"))
        dice = self.rng.randrange(100)
        if dice < 20:
            return "set", [skey], [self.fresh()]
        if dice < 35:
            return "get", [skey], []
        if dice < 43 and self.can_check:
            return "check", [skey, key("n")], []
        if dice < 58:
            return "add", [key("n")], [str(self.rng.randint(1, 5))]
        if dice < 68:
            return "cas", [skey], [self.rng.choice(["", "c0-1"]), self.fresh()]
        if dice < 73:
            return "delete", [skey], []
        if dice < 78:
            return "wait", [key("a"), key("b")], []
        if dice < 90 and self.can_multi:
            return "multi_get", [key("a"), key("b")], []
        if dice < 96 and self.can_multi:
            keys = [key("a"), key("b")]
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
            self.record(r)
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
            self.in_flight(self.unanswered + [record])
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
                self.drop_connection()
                time.sleep(self.args.backoff_ms / 1000)
                self.record(record)
                if not self.connect():
                    return
                continue
            if op in UNANSWERED:
                # It overlaps the call that confirms it, so it is recorded
                # as a client of its own; num_keys, answered, confirms it at
                # once (else a later failed call, a timed-out get say,
                # would leave it unknown).
                self.pipelined += 1
                record["client"] = (self.ident * 1000 + 999) * 1000000 + self.pipelined
                self.unanswered.append(record)
                self.in_flight(self.unanswered)
                try:
                    self.store.num_keys()
                    self.settle(time.time_ns())
                except Exception as e:
                    self.settle(time.time_ns(), str(e).splitlines()[0] if str(e) else "error")
                    self.generation += 1
                    self.drop_connection()
                    if not self.connect():
                        return
            else:
                self.settle(record["return"])
                self.record(record)
        if self.unanswered:  # An answered call confirms them.
            try:
                self.store.num_keys()
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
    p.add_argument("--epoch-seconds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--op-timeout-ms", type=int, default=500)
    p.add_argument("--connect-timeout", type=float, default=5)
    p.add_argument("--backoff-ms", type=int, default=200)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--out", required=True)
    args = p.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sink = argparse.Namespace(lock=threading.Lock(), file=open(args.out, "a"), counts={})
    clients = [Client(args, args.client_base + i, stop, sink) for i in range(args.clients)]
    threads = [threading.Thread(target=c.run) for c in clients]
    for t in threads:
        t.start()
    stop.wait(args.seconds if args.seconds > 0 else None)
    stop.set()
    for t in threads:
        t.join()
    sink.file.close()
    for c in clients:
        if os.path.exists(c.inflight_path):
            os.remove(c.inflight_path)
    counts = sink.counts
    print("torch_store_history: torch %s, %s: %s" % (
        torch.__version__, args.out,
        " ".join("%s=%d" % kv for kv in sorted(counts.items()))), flush=True)
    # Skips the TCPStore destructors (drop_connection says why).
    os._exit(0)


if __name__ == "__main__":
    main()
