#!/usr/bin/env bash
# Runs tests/interop/torch/queue_durability_test.py with the project venv's
# PyTorch 2.x (tools/venv.sh; queues are 2.4+) against the real cohortd's
# TCPStore listener, cohortctl beside it. Fails, not skips, without the venv.
set -uo pipefail

# The checkout: requirements.txt is a runfile linked to its source.
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
[[ -x "$PYTHON" ]] || { echo "FAIL: no venv python at $PYTHON: run tools/setup.sh"; exit 1; }

export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" tests/interop/torch/queue_durability_test.py --backend=cohortd \
  --cohortd=server/cohortd --cohortctl=client/cohortctl "$@"
