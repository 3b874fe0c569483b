#!/usr/bin/env bash
# Fuzzes each target in tests/fuzz with libFuzzer (clang, ASan + UBSan) for
# SECONDS_PER_TARGET seconds (default 60), starting from a copy of its seed
# corpus in tests/fuzz/corpus/<target>; the repository is not written to.
# Exits non-zero on the first crash, leak, timeout or failed model check,
# and says where the input that caused it was saved.
#
#   tools/fuzz.sh            # 60 s each
#   tools/fuzz.sh 3600       # an hour each
#   FUZZ_TARGETS=kv_store_fuzz tools/fuzz.sh 600
#
# Set FUZZ_KEEP_CORPUS=DIR to keep the grown corpora in DIR/<target>.
set -euo pipefail
cd "$(dirname "$0")/.."
COHORT_WITH_FUZZ=1 bash tools/setup.sh >/dev/null

seconds=${1:-60}
targets=(${FUZZ_TARGETS:-kv_store_fuzz file_store_parser_fuzz tcpstore_wire_fuzz tcpstore_session_fuzz auth_decision_fuzz})
checkout=$(pwd -P | md5sum | cut -c1-8)  # one output base per checkout
bazel_fuzz=(bazel "--output_base=${COHORT_FUZZ_OUTPUT_BASE:-$HOME/.cache/bazel_fuzz-$checkout}")

labels=()
for t in "${targets[@]}"; do labels+=("//tests/fuzz:$t"); done
"${bazel_fuzz[@]}" build --config=fuzz --jobs="${COHORT_JOBS:-2}" "${labels[@]}"
bin=$("${bazel_fuzz[@]}" info --config=fuzz bazel-bin 2>/dev/null)

work=$(mktemp -d /tmp/cohort-fuzz.XXXXXX)
status=0
for t in "${targets[@]}"; do
  mkdir -p "$work/$t/corpus" "$work/$t/crash"
  cp tests/fuzz/corpus/"$t"/* "$work/$t/corpus/"
  echo "== fuzz.sh: $t for ${seconds}s (corpus: $(ls "$work/$t/corpus" | wc -l) seeds)"
  # -timeout: an input that runs this long is a hang. -rss_limit_mb: a
  # leak or blow-up. Stats and the exit status tell how it went.
  if ! "$bin/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 \
      -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
      -artifact_prefix="$work/$t/crash/" "$work/$t/corpus" \
      >"$work/$t/log" 2>&1; then
    status=1
    tail -60 "$work/$t/log"
    echo "== fuzz.sh: $t FAILED; the input is in $work/$t/crash/:" \
      "$(ls "$work/$t/crash")"
    echo "   reproduce: $bin/tests/fuzz/$t $work/$t/crash/<file>"
    echo "   once fixed, add it to tests/fuzz/corpus/$t/ as a regression seed"
    break
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb|new_units_added)" \
    "$work/$t/log" | tr '\n' ' '
  echo
  echo "== fuzz.sh: $t passed; corpus grew to $(ls "$work/$t/corpus" | wc -l) inputs"
  if [[ -n "${FUZZ_KEEP_CORPUS:-}" ]]; then
    mkdir -p "$FUZZ_KEEP_CORPUS/$t"
    cp "$work/$t/corpus/"* "$FUZZ_KEEP_CORPUS/$t/"
  fi
done
if ((status == 0)); then rm -rf "$work"; fi
exit "$status"
