#!/usr/bin/env bash
# Runs one of tests/interop/torch/torch2_*_test.py with the project venv's
# PyTorch 2.x (tools/venv.sh; the version tools/requirements.txt pins)
# against the real cohortd's TCPStore listener (--tcpstore_listen),
# cohortctl beside it. Usage: torch2_interop_test.sh NAME [ARGS...]  (NAME:
# store, process_group, kill9, torchrun). The same scripts run against torch
# 2.x's own TCPStore server with --backend=torch (see
# tests/interop/torch/harness.py), e.g.
#   .venv/bin/python tests/interop/torch/torch2_store_test.py --backend=torch
set -uo pipefail

name=${1:?usage: torch2_interop_test.sh NAME [ARGS...]}
shift

# The checkout: requirements.txt is a runfile linked to its source.
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
if ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_available()' 2>"${TEST_TMPDIR:-/tmp}/torch_import.err"; then
  echo "FAIL: $PYTHON cannot import torch.distributed (tools/setup.sh makes the venv):"
  cat "${TEST_TMPDIR:-/tmp}/torch_import.err"
  exit 1
fi

# TORCH_CPP_LOG_LEVEL=ERROR: torch's client logs a warning with a C++
# stack for each connection a server closes, which several checks do.
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 TORCH_CPP_LOG_LEVEL=ERROR
exec "$PYTHON" "tests/interop/torch/torch2_${name}_test.py" --backend=cohortd \
  --cohortd=server/cohortd --cohortctl=client/cohortctl "$@"
