"""Reports, for each fault of tests/robustness/partition_test.sh, what the
recorded clients were answered while it lasted.

  history_windows.py WINDOWS HISTORY.jsonl...

WINDOWS has a line per fault: NAME REPLICA START_NS END_NS [KEY=VALUE...],
REPLICA being the replica the fault cut off ("none" when it was etcd). A
client's target is the replica it was pinned to (store_history's --targets,
0-2 here) or another number for clients that fail over. An operation counts
for a window when it was invoked and answered inside it.

Exits 1 when a replica cut off from etcd acknowledged a write invoked while
it was cut off: it cannot have committed one.
"""
import collections
import json
import sys

WRITES = {"set", "add", "cas", "delete", "multi_set", "append"}


def main():
    windows = []
    for line in open(sys.argv[1]):
        parts = line.split()
        if parts:
            extra = dict(p.split("=", 1) for p in parts[4:])
            windows.append((parts[0], parts[1], int(parts[2]), int(parts[3]), extra))
    ops = []
    for path in sys.argv[2:]:
        ops.extend(json.loads(line) for line in open(path))
    bad = 0
    for name, replica, start, end, extra in windows:
        inside = [o for o in ops if start <= o["call"] and o["return"] <= end]
        by_target = collections.Counter()
        for o in inside:
            kind = "write" if o["op"] in WRITES else "read"
            by_target[(str(o["target"]), kind, o["status"])] += 1
        print("%s (%.1f s%s):" % (name, (end - start) / 1e9, "".join(
            ", %s %s" % (k, v) for k, v in sorted(extra.items()))))
        targets = sorted({t for t, _, _ in by_target})
        for t in targets:
            label = "replica %s" % t if t in "012" else (
                "torch TCPStore" if t == "-1" else "fail-over clients")
            cut = " (cut off)" if t == replica else ""
            print("  %s%s: %s" % (label, cut, ", ".join(
                "%s %s=%d" % (k, s, n) for (tt, k, s), n in sorted(by_target.items())
                if tt == t)))
        # Availability: the longest time inside the window in which no
        # client got an answer that was not an error.
        answered = sorted([start, end] + [o["return"] for o in ops
                                          if o["status"] == "ok" and start <= o["return"] <= end])
        gap = max(b - a for a, b in zip(answered, answered[1:]))
        print("  longest time without any successful answer: %d ms" % (gap / 1e6))
        if replica != "none":
            errors = collections.Counter(
                o.get("error", "")[:110] for o in inside
                if str(o["target"]) == replica and o["status"] != "ok")
            for text, n in errors.most_common(2):
                print("  the cut-off replica answered %dx: %s" % (n, text))
        if name == "replica_cut_from_etcd":
            acked = by_target[(replica, "write", "ok")]
            print("  writes the cut-off replica acknowledged: %d" % acked)
            if acked:
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
