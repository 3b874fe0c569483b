#!/usr/bin/env bash
# Runs tests/interop/torch/backend_NAME_test.py with Debian's PyTorch 1.13 and
# the torch.distributed backend "cohort" that Bazel built
# (//worker/torch:cohort_torch.so, in the runfiles), as a user would: the
# module's folder on PYTHONPATH, `import cohort_torch`.
# Usage: torch_backend_test.sh NAME [ARGS...]  (NAME: ops, ddp, kill)
set -uo pipefail

PYTHON=/usr/bin/python3
name=${1:?usage: torch_backend_test.sh NAME [ARGS...]}
shift

# A machine without torch fails here: CI installs python3-torch.
err="${TEST_TMPDIR:-/tmp}/torch_import.err"
if ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_available()' 2>"$err"; then
  echo "FAIL: $PYTHON cannot import torch.distributed (install Debian's python3-torch):"
  cat "$err"
  exit 1
fi
module_dir="$PWD/worker/torch"
if [[ ! -f "$module_dir/cohort_torch.so" ]]; then
  echo "FAIL: no cohort_torch.so in $module_dir (a data dependency of this test)"
  exit 1
fi

export PYTHONPATH="$module_dir" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" "tests/interop/torch/backend_${name}_test.py" "$@"
