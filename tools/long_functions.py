#!/usr/bin/env python3
"""Lists production C++ functions longer than a limit (default 80 lines).

A function may be longer when the comment right above it says why, in a
line starting "Long:" ("// Long: one switch over every query type."). Tests,
benchmarks and examples are left out. Exit status 1 when a function is over
the limit without such a line. A brace-matching scan, not a parser: a
definition starts on a line whose text ends in "{" after a ")" (or a
"const", "override" or initializer list), at the indent of its block.
"""
import pathlib
import re
import sys

LIMIT = int(sys.argv[1]) if len(sys.argv) > 1 else 80
ROOTS = ["base", "client", "proto", "server", "store", "worker"]
SKIP = re.compile(r"(_test|_fuzz|_bench)\.(cc|cu)$|/examples/|/testing/")
START = re.compile(
    r"^(\s*)(?!if\b|for\b|while\b|switch\b|else\b|do\b|catch\b|return\b)"
    r"[\w:<>,~*&\s\[\]=!+\-/]*\w[\w:<>~]*\s*\(.*\)\s*"
    r"(const\s*)?(override\s*)?(noexcept\s*)?(->\s*[\w:<>*&]+\s*)?\{\s*$")


def functions(lines):
    i = 0
    while i < len(lines):
        line = lines[i]
        m = START.match(line)
        # A signature may span lines: find where it started.
        if not m and line.rstrip().endswith("{") and not line.strip().startswith(
                ("if", "for", "while", "switch", "}", "else", "do", "namespace",
                 "class", "struct", "enum", "union", "extern", "//", "case",
                 "return", "[")):
            j = i
            while j > 0 and "(" not in lines[j] and i - j < 6:
                j -= 1
            sig = " ".join(l.strip() for l in lines[j:i + 1])
            if re.search(r"\)\s*(const\s*)?(override\s*)?(noexcept\s*)?"
                         r"(:.*)?\{$", sig) and not re.match(
                             r"(if|for|while|switch|else|return)\b",
                             lines[j].strip()) and "=" not in sig.split("(")[0]:
                indent = len(lines[j]) - len(lines[j].lstrip())
                m = (j, indent)
        elif m:
            m = (i, len(m.group(1)))
        if not m:
            i += 1
            continue
        start, indent = m
        depth = 0
        end = None
        for k in range(i, len(lines)):
            code = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'|//.*', "",
                          lines[k])
            depth += code.count("{") - code.count("}")
            if depth <= 0:
                end = k
                break
        if end is None:
            return
        yield start, end
        i = end + 1


def justified(lines, start):
    k = start - 1
    while k >= 0 and lines[k].strip().startswith("//"):
        if lines[k].strip().startswith("// Long:"):
            return True
        k -= 1
    return False


def main():
    bad = 0
    for root in ROOTS:
        for path in sorted(pathlib.Path(root).rglob("*")):
            if path.suffix not in (".cc", ".h", ".cu") or SKIP.search(
                    str(path)):
                continue
            lines = path.read_text(errors="replace").split("\n")
            for start, end in functions(lines):
                n = end - start + 1
                if n > LIMIT:
                    ok = justified(lines, start)
                    bad += not ok
                    print(f"{'ok  ' if ok else 'LONG'} {n:4d} {path}:{start + 1}"
                          f" {lines[start].strip()[:70]}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
