#!/usr/bin/env bash
# Runs cohortd on its embedded default, RocksDB in ./cohort-data, listening
# on 127.0.0.1:29500, after installing what it needs and building it.
# Extra arguments are cohortd flags (see `cohortd --help`). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bazel build //server:cohortd //client:cohortctl
echo "cohortd: try 'bazel-bin/client/cohortctl set hello world' in another terminal"
exec bazel-bin/server/cohortd --listen=127.0.0.1:29500 --data_dir=./cohort-data "$@"
