#!/usr/bin/env bash
# Compares two builds of cohort side by side on the store, collectives and
# training benchmarks: for checking that a change that should not move
# performance (a restructuring) does not. Rounds alternate A and B, so
# drift on a shared machine hits both alike; the summary gives each
# figure's median over the rounds and the ratio B/A.
#
#   A=/path/to/old/bazel-bin B=bazel-bin ROUNDS=5 bench/ab_compare.sh
#
# A and B are bazel-bin folders holding //server:cohortd,
# //bench:store_bench, //bench:collectives_bench, //worker/launch:cohortrun
# and //worker/parallel/examples:train (build each checkout with
#   bazel build //server:cohortd //bench:store_bench \
#     //bench:collectives_bench //bench:train_bench
# ). Nothing here asserts a figure: it prints them.
set -euo pipefail
A=${A:?A=old bazel-bin}
B=${B:?B=new bazel-bin}
ROUNDS=${ROUNDS:-5}
# Which to run, of: store tcpstore collectives train.
read -r -a benches <<<"${BENCHES:-store tcpstore collectives train}"
STEPS=${STEPS:-60}
OUT=$(mktemp -d)
touch "$OUT"/{store,tcpstore,collectives,train}.log
trap 'rm -rf "$OUT"' EXIT

# store_bench over gRPC (8 clients) and the 256-rank init storm, against an
# in-process cohortd on RocksDB.
store() {
  local bin=$1 tag=$2 log=$3
  "$bin/bench/store_bench" --mode=ops --clients=8 --ops=4000 --value_bytes=64 |
    sed "s/^/$tag /" >>"$log"
  "$bin/bench/store_bench" --mode=init_storm --ranks=256 --storm_gets=multi |
    sed "s/^/$tag /" >>"$log"
}

# The TCPStore listener of a cohortd process, one client.
tcpstore() {
  local bin=$1 tag=$2 log=$3 port dir
  dir=$(mktemp -d)
  "$bin/server/cohortd" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 \
    --engine=memory 2>"$dir/log" &
  local pid=$!
  for _ in $(seq 200); do
    port=$(sed -nE 's/.*TCPStore protocol on [^ ]*:([0-9]+) .*/\1/p' "$dir/log")
    [[ -n $port ]] && break
    sleep 0.05
  done
  "$bin/bench/store_bench" --tcpstore="127.0.0.1:$port" --clients=1 \
    --ops=20000 | sed "s/^/$tag tcpstore /" >>"$OUT/store.log"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}

collectives() {
  local bin=$1 tag=$2 log=$3
  "$bin/bench/collectives_bench" --world=2 \
    --ops=all_reduce,all_gather,broadcast --sizes=4096,262144,4194304 |
    sed "s/^/$tag /" >>"$log"
}

# train's demo model at world 2 under cohortrun (DDP), the step time.
train() {
  local bin=$1 tag=$2 log=$3
  (cd "$bin/bench/train_bench.runfiles/cohort" && ROUNDS=1 STEPS=$STEPS \
    MODES="ddp fsdp" bench/train_bench.sh) 2>/dev/null |
    sed "s/^/$tag /" >>"$log"
}

for round in $(seq "$ROUNDS"); do
  for side in A B; do
    bin=${!side}
    echo "round $round: $side" >&2
    for bench in "${benches[@]}"; do
      "$bench" "$bin" "$side" "$OUT/$bench.log"
    done
  done
done
cat "$OUT"/*.log >"${AB_LOG:-/dev/null}"
python3 - "$OUT" <<'PY'
import collections, re, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
figs = collections.defaultdict(lambda: collections.defaultdict(list))
for line in (out / "store.log").read_text().splitlines():
    side, rest = line.split(" ", 1)
    m = re.search(r"op=(\w+).*ops/s=([\d.]+)", rest)
    if m:
        key = ("tcpstore " if rest.startswith("tcpstore") else "grpc ") + m[1] + " ops/s"
        figs[key][side].append(float(m[2]))
    m = re.search(r"init-storm.*wall_s=([\d.]+)", rest)
    if m:
        figs["init_storm 256 wall_s"][side].append(float(m[1]))
for line in (out / "collectives.log").read_text().splitlines():
    side, rest = line.split(" ", 1)
    m = re.search(r"cohort-(\w+) (\w+)\s+world=\d+ bytes=\s*(\d+) .*busbw_GBps=\s*([\d.]+)", rest)
    if m:
        figs[f"{m[1]} {m[2]} {int(m[3])} B busbw GB/s"][side].append(float(m[4]))
for line in (out / "train.log").read_text().splitlines():
    side, rest = line.split(" ", 1)
    m = re.match(r"\s*(ddp|fsdp)\s+([\d.]+)", rest)
    if m:
        figs[f"train {m[1]} step ms"][side].append(float(m[2]))
print(f"{'figure':34} {'A median':>10} {'B median':>10} {'B/A':>6}  (rounds)")
for key, by in figs.items():
    a, b = by.get("A", []), by.get("B", [])
    if not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{key:34} {ma:10.3f} {mb:10.3f} {mb / ma:6.3f}  ({len(a)}/{len(b)})")
PY
