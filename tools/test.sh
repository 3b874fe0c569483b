#!/usr/bin/env bash
# Runs cohort's whole test suite on a fresh Debian 12 machine: installs what
# it needs (tools/setup.sh), checks that the build enforces the layering
# (tools/layering.sh), builds everything offline and runs every test.
# Extra arguments go to `bazel test` (e.g. a target pattern).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh

targets=("$@")
((${#targets[@]})) || targets=(//...)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
bash tools/layering.sh
layering=$?
bazel test --nocache_test_results "${targets[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e

# One plain summary line, whatever bazel's own wording.
summary=$(grep -E "^Executed [0-9]+ out of [0-9]+ tests?" "$log" | tail -1)
passed=$(sed -nE 's/.* ([0-9]+) tests? pass.*/\1/p' <<<"$summary")
failed=$(sed -nE 's/.* ([0-9]+) fails? locally.*/\1/p' <<<"$summary")
echo "tests: ${passed:-0} passed, ${failed:-0} failed"
if ((layering)); then
  echo "layering: failed (see 'layering: FAIL' above)"
  ((status)) || status=1
fi
exit "$status"
