#!/usr/bin/env bash
# Runs tests/interop/torch/backend2_NAME_test.py on the project venv's PyTorch
# 2.x (tools/venv.sh) with the torch.distributed backend "cohort" that Bazel
# built for it (//worker/torch:cohort_torch2: torch2/cohort_torch.so and
# torch2/libcohort_gloo.so, in the runfiles), as a user would: the module's
# folder on PYTHONPATH, `import cohort_torch`. Fails, not skips, when the venv,
# its torch or the module is missing.
# Usage: torch_backend2_test.sh NAME [ARGS...]  (NAME: ops, gloo, ddp, trace)
set -uo pipefail

name=${1:?usage: torch_backend2_test.sh NAME [ARGS...]}
shift

# The checkout: requirements.txt is a runfile linked to its source.
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
[[ -x "$PYTHON" ]] || { echo "FAIL: no venv python at $PYTHON: run tools/setup.sh"; exit 1; }
err="${TEST_TMPDIR:-/tmp}/torch_import.err"
if ! "$PYTHON" -c 'import torch, torch.distributed as d; assert d.is_available(); assert int(torch.__version__.split(".")[0]) >= 2, torch.__version__' 2>"$err"; then
  echo "FAIL: $PYTHON cannot import torch 2.x with torch.distributed (tools/setup.sh makes the venv):"
  cat "$err"
  exit 1
fi
module_dir="$PWD/worker/torch/torch2"
if [[ ! -f "$module_dir/cohort_torch.so" ]]; then
  echo "FAIL: no torch2/cohort_torch.so in $PWD/worker/torch (a data dependency of this test)"
  [[ -f "$module_dir/MISSING" ]] && echo "Bazel built none: $(cat "$module_dir/MISSING")"
  exit 1
fi

export PYTHONPATH="$module_dir:$PWD/tests/interop/torch" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" "tests/interop/torch/backend2_${name}_test.py" "$@"
