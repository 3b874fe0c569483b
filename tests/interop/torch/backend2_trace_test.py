#!/usr/bin/env python3
"""Timelines from the backend "cohort" on PyTorch 2.x (docs/debugging.md):
torch's DDP tutorial (tests/interop/torch/tutorial_ddp.py, unmodified) runs
as a 2-process job on "cohort" with COHORT_TRACE set, and then:
 - each rank wrote trace-rank<R>.json (its rank from RANK), source "torch",
   a thread "comm pg0" for the default group and no compute or step spans
   (the backend cannot see torch's compute);
 - the comm spans are the ops DDP issues, counted from the model: the
   ToyModel has 10x10 + 10 + 10x5 + 5 = 165 parameters, all in one bucket,
   so each of the tutorial's 5 steps all_reduces 165 float32 once; both
   ranks recorded the same collectives in the same order, all ended OK;
 - cohortctl trace merge makes one file of both, which, like each rank's,
   passes tests/testing/check_trace.py (the Trace Event Format's JSON
   Schema and the nesting viewers need, with Debian's python3: the venv has
   no jsonschema);
 - cohortctl trace summary says that compute, exposed communication and
   overlap cannot be told, and gives the all_reduce's bandwidths, busbw =
   algbw x 2(n-1)/n = algbw at n = 2.

Run: bazel test //tests/interop:torch_backend2_trace_test
"""
import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import backend2_ranks  # noqa: E402
import backend_ranks  # noqa: E402
import harness  # noqa: E402

args = backend2_ranks.parse_args(__doc__)
dist = backend2_ranks.import_backend()

WORLD = 2
STEPS = 5
PARAMS = 10 * 10 + 10 + 10 * 5 + 5
HERE = os.path.dirname(os.path.abspath(sys.argv[0]))
CTL = os.path.abspath("client/cohortctl")
CHECK_TRACE = os.path.abspath("tests/testing/check_trace.py")
SYSTEM_PYTHON = "/usr/bin/python3"


def main():
    c = harness.Checks("backend2_trace_test")
    folder = os.path.join(harness.scratch_dir("trace"), "timelines")
    os.environ["COHORT_TRACE"] = folder
    ranks = backend2_ranks.launch_script(
        os.path.join(HERE, "tutorial_ddp.py"), WORLD, ["--backend=cohort"],
        name="trace")
    del os.environ["COHORT_TRACE"]
    codes = backend_ranks.wait_all(ranks, 120)
    if not c.ok(all(code == 0 for code in codes.values()),
                f"the DDP tutorial on cohort failed: exit codes {codes}"):
        c.finish()
    files = [os.path.join(folder, f"trace-rank{r}.json") for r in range(WORLD)]
    issued = []
    for rank, path in enumerate(files):
        if not c.ok(os.path.exists(path), f"rank {rank} wrote no {path}"):
            continue
        with open(path) as f:
            trace = json.load(f)
        other = trace["otherData"]
        c.eq(f"rank {rank}: otherData rank, world_size, source",
             (other["rank"], other["world_size"], other["source"]),
             (rank, WORLD, "torch"))
        c.eq(f"rank {rank}: dropped ops", other["dropped_ops"], 0)
        events = trace["traceEvents"]
        threads = {e["args"]["name"] for e in events
                   if e["ph"] == "M" and e["name"] == "thread_name"}
        c.ok("comm pg0" in threads, f"rank {rank}: threads {threads}")
        cats = {e.get("cat") for e in events if e["ph"] == "X"}
        c.eq(f"rank {rank}: span categories", cats, {"comm"})
        comm = sorted((e["args"] for e in events if e["ph"] == "X"),
                      key=lambda a: a["seq"])
        c.eq(f"rank {rank}: op states", {a["state"] for a in comm}, {"done"})
        buckets = [a for a in comm if a["op"] == "AllReduce" and
                   a["dtype"] == "f32" and a["count"] == PARAMS]
        c.eq(f"rank {rank}: all_reduces of the {PARAMS}-parameter bucket",
             len(buckets), STEPS)
        c.ok(all(a["bytes"] == 4 * PARAMS and a["ranks"] == WORLD
                 for a in buckets), f"rank {rank}: bucket args {buckets[:1]}")
        issued.append([(a["seq"], a["op"], a["dtype"], a["count"])
                       for a in comm])
    if len(issued) == WORLD:
        c.eq("the ranks' collectives, in order", issued[1], issued[0])

    merged = os.path.join(folder, "..", "merged.json")
    merge = subprocess.run([CTL, "trace", "merge", folder, "-o", merged],
                           capture_output=True, text=True)
    c.eq(f"cohortctl trace merge: {merge.stderr}", merge.returncode, 0)
    check = subprocess.run([SYSTEM_PYTHON, CHECK_TRACE, *files, merged],
                           capture_output=True, text=True)
    print(check.stdout, end="", flush=True)
    c.eq(f"check_trace.py: {check.stdout}{check.stderr}", check.returncode, 0)
    summary = subprocess.run([CTL, "trace", "summary", merged],
                             capture_output=True, text=True)
    print(summary.stdout, flush=True)
    c.eq(f"cohortctl trace summary: {summary.stderr}", summary.returncode, 0)
    c.ok("cannot be told" in summary.stdout,
         "the summary does not say what a torch trace cannot tell")
    c.ok("per step" not in summary.stdout, "the summary shows steps")
    rows = [line.split() for line in summary.stdout.splitlines()
            if line.startswith("AllReduce ") and f" {WORLD} " in line]
    bucket = [r for r in rows if r[2] == f"{4 * PARAMS}B"]
    if c.ok(len(bucket) == 1, f"no AllReduce row of {4 * PARAMS}B: {rows}"):
        calls, algbw, busbw = int(bucket[0][4]), bucket[0][7], bucket[0][8]
        c.eq("the bucket all_reduce's calls, both ranks", calls, WORLD * STEPS)
        c.eq("busbw = algbw at world 2", busbw, algbw)
    c.finish()


if __name__ == "__main__":
    main()
