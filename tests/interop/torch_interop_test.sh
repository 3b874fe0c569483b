#!/usr/bin/env bash
# Runs one of tests/interop/torch/*_test.py with Debian's PyTorch 1.13
# against the real cohortd's TCPStore listener (--tcpstore_listen),
# cohortctl beside it. Usage: torch_interop_test.sh NAME [ARGS...]  (NAME:
# store_ops, process_group, torchrun, kill9). The same scripts run against
# torch's own TCPStore server with --backend=torch (see
# tests/interop/torch/harness.py).
set -uo pipefail

PYTHON=/usr/bin/python3
name=${1:?usage: torch_interop_test.sh NAME [ARGS...]}
shift

# A machine without torch fails here: CI installs python3-torch.
if ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_available()' 2>"${TEST_TMPDIR:-/tmp}/torch_import.err"; then
  echo "FAIL: $PYTHON cannot import torch.distributed (install Debian's python3-torch):"
  cat "${TEST_TMPDIR:-/tmp}/torch_import.err"
  exit 1
fi

export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" "tests/interop/torch/${name}_test.py" --backend=cohortd \
  --cohortd=server/cohortd --cohortctl=client/cohortctl "$@"
