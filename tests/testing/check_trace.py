#!/usr/bin/env python3
"""Checks trace files as a trace viewer would need them, without one.

Perfetto's trace processor (PyPI `perfetto`) downloads its
trace_processor_shell binary at first use, which a machine that reaches only
package registries cannot do, so the tests check the files themselves:
  1. each file against trace_event_format.schema.json (beside this script),
     a JSON Schema of the Trace Event Format, with Debian's python3-jsonschema;
  2. what a schema cannot say: on each (pid, tid) the complete events nest
     or are disjoint (viewers draw a thread's spans as a stack), and every
     process and thread with spans is named.

Usage: check_trace.py FILE...   (exit 0: every file passed)
"""
import collections
import json
import os
import sys

import jsonschema

SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "trace_event_format.schema.json")


def problems(trace):
    """What is wrong with a parsed trace, as lines (at most 20)."""
    with open(SCHEMA) as f:
        schema = json.load(f)
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    found = []
    for error in validator.iter_errors(trace):
        where = "/".join(str(p) for p in error.absolute_path)
        found.append(f"schema: at /{where}: {error.message}")
        if len(found) >= 20:
            return found
    if found:
        return found
    events = trace["traceEvents"]
    names = {(e["pid"], e.get("tid")) for e in events
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    spans = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e))
    for (pid, tid), group in sorted(spans.items(), key=str):
        if (pid, None) not in names:
            found.append(f"process {pid} has spans but no process_name")
        if (pid, tid) not in names:
            found.append(f"thread {pid}/{tid} has spans but no thread_name")
        group.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for start, end, event in group:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                found.append(
                    f"thread {pid}/{tid}: span {event['name']} "
                    f"[{start}, {end}] overlaps {stack[-1][2]['name']} "
                    f"[{stack[-1][0]}, {stack[-1][1]}] without nesting in it")
            stack.append((start, end, event))
            if len(found) >= 20:
                return found
    return found


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    failed = 0
    for path in sys.argv[1:]:
        try:
            with open(path) as f:
                trace = json.load(f)
        except (OSError, ValueError) as e:
            print(f"check_trace: {path}: cannot read it as JSON: {e}")
            failed += 1
            continue
        found = problems(trace)
        if found:
            failed += 1
            print(f"check_trace: {path}: FAILED")
            for line in found:
                print(f"  {line}")
        else:
            spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
            print(f"check_trace: {path}: ok ({len(trace['traceEvents'])} "
                  f"events, {spans} spans)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
