#!/usr/bin/env bash
# The linearizability checker (tests/robustness/lincheck: Go, porcupine),
# built offline as the robustness tests build it (lincheck/build.sh, from
# the module cache tools/setup.sh fills). Its unit tests: the c10d store
# model's rules, hand-written histories that must pass and fail, bad input,
# the timeout and memory limits, generated histories up to 20k operations.
# Then the binary on histories written here: a legal one (exit 0), one with
# a stale read (exit 1, naming its key group and writing the
# visualization), one with a malformed line (exit 3).
set -uo pipefail

BUILD=tests/robustness/lincheck/build.sh
TMP=${TEST_TMPDIR:-$(mktemp -d)}
LINCHECK=$TMP/lincheck
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$BUILD" "$LINCHECK" || { echo "FAIL: building lincheck (above)"; exit 1; }
"$BUILD" --test -count=1 || fail "lincheck's unit tests (above)"

t0=1700000000000000000
ms() { echo $((t0 + $1 * 1000000)); }
line() { # client op keys values call_ms return_ms status [out]
  printf '{"client": %s, "op": "%s", "keys": %s, "values": %s, "call": %s, "return": %s, "status": "%s"%s}\n' \
    "$1" "$2" "$3" "$4" "$(ms "$5")" "$(ms "$6")" "$7" "${8:+, \"out\": $8}"
}

{
  line 1 set '["g0/a"]' '["c1-1"]' 0 2 ok
  line 2 get '["g0/a"]' '[]' 1 3 ok '"c1-1"'
  line 1 add '["g1/n"]' '["5"]' 3 4 unknown
  line 2 add '["g1/n"]' '["1"]' 5 6 ok 6
  line 3 multi_set '["g0/a", "g0/b"]' '["x", "y"]' 5 6 ok
  line 1 multi_get '["g0/a", "g0/b"]' '[]' 7 8 ok '["x", "y"]'
  line 2 cas '["g0/b"]' '["y", "z"]' 7 8 ok '"z"'
  line 3 wait '["g2/never"]' '[]' 7 9 fail
} >"$TMP/legal.jsonl"
out=$("$LINCHECK" "$TMP/legal.jsonl" 2>&1)
rc=$?
echo "$out"
[[ $rc == 0 ]] || fail "legal history: exit $rc, want 0"
[[ $out == *"7 operations (1 unknown, 1 dropped) in 2 partitions from 1 file, 3 clients: linearizable"* ]] ||
  fail "legal history: unexpected summary"
out=$("$LINCHECK" --json "$TMP/legal.jsonl" 2>&1)
[[ $out == *'"result":"ok"'* ]] || fail "legal history, --json: $out"

{
  line 1 set '["fine/a"]' '["1"]' 0 1 ok
  line 2 get '["fine/a"]' '[]' 2 3 ok '"1"'
  line 1 set '["ring/a"]' '["old"]' 4 5 ok
  line 1 set '["ring/a"]' '["new"]' 6 7 ok
  line 2 get '["ring/a"]' '[]' 8 9 ok '"old"'
} >"$TMP/stale.jsonl"
out=$("$LINCHECK" --html="$TMP/html" "$TMP/stale.jsonl" 2>&1)
rc=$?
echo "$out"
[[ $rc == 1 ]] || fail "stale read: exit $rc, want 1"
[[ $out == *"NOT linearizable: 1 of 2 partitions illegal (group ring)"* ]] || fail "stale read: group ring not named"
[[ $out == *'get ring/a -> "old"'*'the store would return "new"'* ]] || fail "stale read: the read is not explained"
[[ -s $TMP/html/lincheck.html ]] || fail "stale read: no visualization in $TMP/html"

{
  line 1 set '["g0/a"]' '["1"]' 0 1 ok
  echo '{"client": 2, "op": "get", "keys": ["g0/a"], "call": 5'
} >"$TMP/bad.jsonl"
out=$("$LINCHECK" "$TMP/bad.jsonl" 2>&1)
rc=$?
echo "$out"
[[ $rc == 3 && $out == *"bad.jsonl:2: bad JSON"* ]] || fail "malformed line: exit $rc, want 3 and bad.jsonl:2"

if ((failures)); then
  echo "$failures failure(s)"
  exit 1
fi
echo PASS
