#!/usr/bin/env bash
# The long linearizability campaign: the robustness tests' runs, longer and
# with more faults, repeated ROUNDS times; prints the checked operations,
# the unknown (ambiguous) writes, the faults injected and the violations of
# every run (each must be 0), and their totals.
#
#   bench/linearizability.sh                      # defaults below
#   ROUNDS=5 LIN_SECONDS=300 LIN_FAULTS=60 PARTITION_HOLD_S=20 bench/linearizability.sh
#
# Runs from the repository root of a clone on which tools/setup.sh ran.
# Each round runs, one after the other:
#   - one cohortd (RocksDB), kill -9 and restart LIN_FAULTS times;
#   - 3 etcd members and 3 replicas: LIN_FAULTS of each of cohortd leader
#     killed, etcd leader killed, etcd member stopped, replica stopped;
#   - the partition cases, each held PARTITION_HOLD_S seconds.
# A round takes about LIN_SECONDS per run plus the partitions' holds.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
export LIN_SECONDS=${LIN_SECONDS:-120}
export LIN_FAULTS=${LIN_FAULTS:-25}
export PARTITION_HOLD_S=${PARTITION_HOLD_S:-15}
targets=(//tests/robustness:linearizability_single_test
         //tests/robustness:linearizability_ha_test
         //tests/robustness:partition_test)
bazel build "${targets[@]}" >/dev/null 2>&1 || { bazel build "${targets[@]}"; exit 1; }
echo "linearizability campaign: $ROUNDS rounds, LIN_SECONDS=$LIN_SECONDS LIN_FAULTS=$LIN_FAULTS PARTITION_HOLD_S=$PARTITION_HOLD_S, commit $(git rev-parse --short HEAD)"
total_ops=0 total_unknown=0 total_violations=0 failed=0
for round in $(seq "$ROUNDS"); do
  for t in "${targets[@]}"; do
    name=${t##*:}
    bazel test "$t" --nocache_test_results --test_timeout=7200 \
      --test_env=LIN_SECONDS --test_env=LIN_FAULTS --test_env=PARTITION_HOLD_S \
      >/dev/null 2>&1
    rc=$?
    log=bazel-testlogs/tests/robustness/$name/test.log
    summary=$(grep -h '^lincheck: {' "$log" | tail -1)
    read -r ops unknown violations < <(python3 -c '
import json, sys
s = json.loads(sys.argv[1][len("lincheck: "):]) if sys.argv[1] else {}
print(s.get("operations", 0), s.get("unknown", 0), s.get("violations", -1))' "$summary")
    faults=$(grep -h '^faults:\|new leader\|elected a leader' "$log" | tr '\n' ';' | sed 's/  */ /g')
    printf 'round %d %-32s %s ops %7d unknown %4d violations %d  %s\n' "$round" "$name" \
      "$([[ $rc == 0 ]] && echo pass || echo FAIL)" "$ops" "$unknown" "$violations" "$faults"
    ((rc == 0)) || failed=$((failed + 1))
    total_ops=$((total_ops + ops)) total_unknown=$((total_unknown + unknown))
    ((violations > 0)) && total_violations=$((total_violations + violations))
  done
done
echo "total: $total_ops operations checked, $total_unknown of unknown outcome, $total_violations violations, $failed failed runs"
((failed == 0 && total_violations == 0))
