#!/usr/bin/env python3
"""What trace_test.sh checks in a job's timelines (COHORT_TRACE), beyond
the format (tests/testing/check_trace.py):

  trace_checks.py files MODE STEPS DIR
      each rank's file: a step span per step, each step's compute spans
      (forward and backward per layer), comm spans that match the ops the
      mode issues (counts derived from the model's sizes, below), the same
      collectives on every rank in the same order, no op dropped or
      unfinished.
  trace_checks.py summary STEPS MERGED SUMMARY_TEXT
      cohortctl trace summary's per-step rows: one per step, comm =
      exposed + overlap, nothing negative, compute + exposed <= step; each
      figure equal to this script's own computation from the merged file
      (interval unions written independently of client/trace_timeline.cc);
      busbw / algbw is nccl-tests' factor for each op.
Prints FAIL lines; exits 1 if any.
"""
import collections
import json
import os
import re
import sys

# The trainer's default student (train.cc --dims): layer l has a
# dims[l+1] x dims[l] weight and a dims[l+1] bias, one FSDP unit each.
DIMS = [64, 512, 512, 512, 16]
UNITS = [DIMS[l + 1] * DIMS[l] + DIMS[l + 1] for l in range(len(DIMS) - 1)]
PARAMS = sum(UNITS)  # 566,800
LAYERS = len(UNITS)
WORLD = 2

failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL: {message}")


def load(path):
    with open(path) as f:
        return json.load(f)


def spans(trace, cat):
    return [e for e in trace["traceEvents"]
            if e["ph"] == "X" and e.get("cat") == cat]


def check_files(mode, steps, folder):
    per_rank = {}
    for rank in range(WORLD):
        path = os.path.join(folder, f"trace-rank{rank}.json")
        if not os.path.exists(path):
            fail(f"{mode}: no {path}")
            continue
        trace = load(path)
        per_rank[rank] = trace
        other = trace["otherData"]
        if other["rank"] != rank or other["world_size"] != WORLD:
            fail(f"{mode} rank {rank}: otherData {other}")
        if other["dropped_ops"] != 0:
            fail(f"{mode} rank {rank}: {other['dropped_ops']} ops dropped")
        step_spans = spans(trace, "step")
        if sorted(s["args"]["step"] for s in step_spans) != list(
                range(1, steps + 1)):
            fail(f"{mode} rank {rank}: step spans "
                 f"{[s['args']['step'] for s in step_spans]}")
        compute = spans(trace, "compute")
        for name in ("forward", "backward"):
            for s in range(1, steps + 1):
                n = sum(1 for c in compute
                        if c["name"] == name and c["args"].get("step") == s)
                if n != LAYERS:
                    fail(f"{mode} rank {rank} step {s}: {n} {name} spans, "
                         f"expected {LAYERS}")
        if not any(c["name"] == "optimizer" for c in compute):
            fail(f"{mode} rank {rank}: no optimizer span")
        # Compute spans lie inside their step's span.
        bounds = {s["args"]["step"]: (s["ts"], s["ts"] + s["dur"])
                  for s in step_spans}
        for c in compute:
            b = bounds.get(c["args"].get("step"))
            if b and not (b[0] <= c["ts"] and c["ts"] + c["dur"] <= b[1]):
                fail(f"{mode} rank {rank}: {c['name']} outside its step")
        comm = spans(trace, "comm")
        if not comm:
            fail(f"{mode} rank {rank}: no comm spans")
            continue
        states = collections.Counter(c["args"]["state"] for c in comm)
        if set(states) != {"done"}:
            fail(f"{mode} rank {rank}: op states {dict(states)}")
        for c in comm:
            a = c["args"]
            size = {"f32": 4, "i64": 8, "i32": 4, "u8": 1}[a["dtype"]]
            if a["bytes"] != a["count"] * size or a["ranks"] != WORLD:
                fail(f"{mode} rank {rank}: args {a}")
            if a["queued_us"] > c["ts"]:
                fail(f"{mode} rank {rank}: op {a['seq']} started before it "
                     "was queued")
        seqs = sorted(c["args"]["seq"] for c in comm)
        if seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            fail(f"{mode} rank {rank}: collective seqs have gaps: {seqs}")
        by_step = collections.defaultdict(list)
        for c in comm:
            if "step" in c["args"]:
                by_step[c["args"]["step"]].append(c["args"])
        for s in range(1, steps + 1):
            ops = by_step.get(s, [])
            if mode == "ddp":
                # The buckets hold every gradient once; the loss is one
                # element (--log_every=1).
                buckets = sum(a["count"] for a in ops
                              if a["op"] == "AllReduce" and a["count"] > 1)
                losses = [a for a in ops
                          if a["op"] == "AllReduce" and a["count"] == 1]
                if buckets != PARAMS or len(losses) != 1:
                    fail(f"ddp rank {rank} step {s}: buckets all_reduce "
                         f"{buckets} elements (expected {PARAMS}), "
                         f"{len(losses)} loss all_reduces")
            else:
                # Each unit's gradient is reduce_scattered once (the input:
                # the whole unit); each all_gather passes one unit's shard.
                scattered = sum(a["count"] for a in ops
                                if a["op"] == "ReduceScatter")
                gathers = [a["count"] for a in ops if a["op"] == "AllGather"]
                shards = {u // WORLD for u in UNITS}
                if scattered != PARAMS:
                    fail(f"fsdp rank {rank} step {s}: reduce_scatter of "
                         f"{scattered} elements, expected {PARAMS}")
                if not gathers or not set(gathers) <= shards:
                    fail(f"fsdp rank {rank} step {s}: all_gather counts "
                         f"{gathers}, expected among {sorted(shards)}")
    if len(per_rank) == WORLD:
        issued = [sorted((c["args"]["seq"], c["args"]["op"], c["args"]["count"],
                          c["args"]["dtype"]) for c in spans(t, "comm"))
                  for t in per_rank.values()]
        if issued[0] != issued[1]:
            fail(f"{mode}: the ranks' comm spans differ")
    return per_rank


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def covered(u, lo, hi):
    return sum(max(0, min(e, hi) - max(s, lo)) for s, e in u)


def intersect(a, b):
    out = []
    for s1, e1 in a:
        for s2, e2 in b:
            s, e = max(s1, s2), min(e1, e2)
            if s < e:
                out.append([s, e])
    return union(out)


def check_summary(steps, merged_path, summary_path):
    trace = load(merged_path)
    with open(summary_path) as f:
        text = f.read()
    if f"{WORLD} rank(s) (0,1), {steps} step(s)" not in text:
        fail(f"summary's first line: {text.splitlines()[0]}")
    # Expected per-step means from the merged file.
    expected = collections.defaultdict(list)
    for rank in range(WORLD):
        mine = [e for e in trace["traceEvents"]
                if e["ph"] == "X" and e["pid"] == rank]
        compute = union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                         if e.get("cat") == "compute"])
        comm = union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                      if e.get("cat") == "comm"])
        both = intersect(compute, comm)
        for s in mine:
            if s.get("cat") != "step":
                continue
            lo, hi = s["ts"], s["ts"] + s["dur"]
            c, m, o = (covered(compute, lo, hi), covered(comm, lo, hi),
                       covered(both, lo, hi))
            expected[s["args"]["step"]].append(
                (hi - lo, c, m, m - o, o, hi - lo - c - (m - o)))
    section = text.split("per step")[1].split("\n\n")[0]
    rows = {}
    for line in section.splitlines():
        cols = line.split()
        if cols and cols[0].isdigit():
            rows[int(cols[0])] = [float(x.rstrip("%")) for x in cols[1:]]
    if sorted(rows) != list(range(1, steps + 1)):
        fail(f"summary's step rows: {sorted(rows)}")
    # Each figure is printed in ms to 3 decimals: off by at most 0.0005,
    # so a sum of two is off by at most 0.0015 from a third.
    for step, row in rows.items():
        step_ms, compute, comm, exposed, overlap, share, other = row
        if min(step_ms, compute, comm, exposed, overlap, other) < 0:
            fail(f"step {step}: a negative figure: {row}")
        if abs(exposed + overlap - comm) > 0.0015:
            fail(f"step {step}: exposed {exposed} + overlap {overlap} != "
                 f"comm {comm}")
        if compute + exposed > step_ms + 0.0015:
            fail(f"step {step}: compute {compute} + exposed {exposed} > "
                 f"step {step_ms}")
        means = [sum(v) / len(v) / 1000 for v in zip(*expected[step])]
        for name, got, want in zip(
                ("step", "compute", "comm", "exposed", "overlap"),
                (step_ms, compute, comm, exposed, overlap), means):
            if abs(got - want) > 0.0005 + 1e-9:
                fail(f"step {step}: {name} {got} ms, recomputed {want:.4f}")
    # busbw = algbw x nccl-tests' factor (n = 2): all_reduce 2(n-1)/n = 1,
    # all_gather and reduce_scatter (n-1)/n = 0.5, broadcast 1. Printed to
    # 4 significant digits: the ratio is good to about 1e-3.
    factors = {"AllReduce": 1.0, "AllGather": 0.5, "ReduceScatter": 0.5,
               "Broadcast": 1.0}
    ops = text.split("per op")[1].splitlines()[2:]
    seen = set()
    for line in ops:
        cols = line.split()
        if len(cols) != 9 or cols[7] == "-":
            continue
        op, algbw, busbw = cols[0], float(cols[7]), float(cols[8])
        if op in factors and algbw > 0:
            seen.add(op)
            if abs(busbw / algbw - factors[op]) > 2e-3:
                fail(f"{op}: busbw {busbw} / algbw {algbw} is not "
                     f"{factors[op]}")
    if not seen:
        fail(f"no op with bandwidths in the summary:\n{text}")


def main():
    if sys.argv[1] == "files":
        check_files(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "summary":
        check_summary(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        print(__doc__)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
