#!/usr/bin/env bash
# What the flight recorder costs a collective: collectives_bench's 4 KiB
# all_reduce (2 ranks, the shared-memory transport, then TCP loopback) with
# the recorder on (ProcessGroupOptions::flight_records = 2000, the default)
# and off (0), in alternating rounds so that drift hits both alike. Prints
# each round's time per call, then per transport the medians, their
# difference and its share of the call. Asserts nothing.
#
# On a small VM the shared-memory transport is bimodal: with both ranks on
# vCPUs that run, a 4 KiB all_reduce takes ~5 us; when the hypervisor
# deschedules one, ~200 us. The median of a mix says nothing about 50 ns,
# so the summary also gives each side's fast rounds alone (those within
# 1.5x of the fastest round of either side): their count and median.
#
#   bazel build -c opt //bench:collectives_bench //bench:flight_recorder_bench
#   ROUNDS=31 bench/flight_recorder_overhead.sh
#
# The recorder's own cost per op, alone on one thread and contended by two,
# comes from bench/flight_recorder_bench, printed first.
set -euo pipefail
BIN=${BIN:-bazel-bin}
ROUNDS=${ROUNDS:-31}
SIZE=${SIZE:-4096}
CALLS=${CALLS:-2000}
"$BIN/bench/flight_recorder_bench"
for transport in shm tcp; do
  on=() off=()
  for ((i = 0; i < ROUNDS; i++)); do
    for records in 2000 0; do
      t=$("$BIN/bench/collectives_bench" --ops=all_reduce --sizes="$SIZE" \
            --transport="$transport" --flight_records="$records" \
            --calls="$CALLS" 2>/dev/null |
          sed -n 's/.* all_reduce .*time_us= *\([0-9.]*\).*/\1/p')
      if [[ $records == 0 ]]; then off+=("$t"); else on+=("$t"); fi
    done
    echo "round $i $transport on=${on[-1]} us off=${off[-1]} us"
  done
  median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
  m_on=$(median "${on[@]}") m_off=$(median "${off[@]}")
  awk -v t="$transport" -v on="$m_on" -v off="$m_off" -v n="$ROUNDS" -v s="$SIZE" -v c="$CALLS" 'BEGIN {
    printf "%s all_reduce %d B, %d calls a round, medians of %d rounds: recorder on %.2f us, off %.2f us: %+.0f ns per call (%+.2f%%)\n",
      t, s, c, n, on, off, (on - off) * 1000, (on - off) / off * 100 }'
  best=$(printf '%s\n' "${on[@]}" "${off[@]}" | sort -g | head -1)
  fast() { awk -v b="$best" '$1 <= 1.5 * b' | sort -g; }
  f_on=($(printf '%s\n' "${on[@]}" | fast)) f_off=($(printf '%s\n' "${off[@]}" | fast))
  if ((${#f_on[@]} && ${#f_off[@]})); then
    fm_on=$(median "${f_on[@]}") fm_off=$(median "${f_off[@]}")
    awk -v t="$transport" -v on="$fm_on" -v off="$fm_off" -v a="${#f_on[@]}" -v b="${#f_off[@]}" 'BEGIN {
      printf "%s fast rounds (within 1.5x of the fastest): on %d rounds, median %.2f us; off %d rounds, median %.2f us: %+.0f ns per call (%+.2f%%)\n",
        t, a, on, b, off, (on - off) * 1000, (on - off) / off * 100 }'
  fi
done
