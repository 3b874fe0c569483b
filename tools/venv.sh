#!/usr/bin/env bash
# Makes the project's PyTorch 2.x virtual environment, .venv in the checkout
# (git-ignored): Debian's python3 with the packages pinned in
# tools/requirements.txt (torch 2.11.0 and the CUDA toolkit wheels).
#
# A torch wheel with its CUDA libraries is several GB, so the environment
# itself lives in a cache keyed by the hash of requirements.txt and the
# Python version ($COHORT_VENV_CACHE, default ~/.cache/cohort), and .venv is
# a link to it: a second checkout, or CI's fresh clone on the same machine,
# reuses it, and a run after the first needs no network. Changing
# requirements.txt makes a new environment in place of the old one.
#
#   tools/venv.sh          # make it if needed, print nothing else when there
#   .venv/bin/python -c 'import torch; print(torch.__version__)'
set -euo pipefail
cd "$(dirname "$0")/.."

python=/usr/bin/python3
requirements=tools/requirements.txt
key=$( { cat "$requirements"; "$python" -c 'import sys; print(sys.version)'; } |
  sha256sum | cut -c1-16)
cache=${COHORT_VENV_CACHE:-$HOME/.cache/cohort}
venv=$cache/venv-$key
mkdir -p "$cache"

# One maker at a time (two checkouts set up at once wait here for each other).
exec 9>"$cache/venv.lock"
flock 9

if [[ ! -f "$venv/.complete" ]]; then
  echo "setup: making the PyTorch 2.x venv $venv (from $requirements; a few minutes the first time)"
  rm -rf "$venv"  # What an interrupted attempt left.
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-input -r "$requirements"
  # The pins must have held: the venv's torch is the pinned one.
  want=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$requirements")
  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  if [[ "${got%%+*}" != "$want" ]]; then
    echo "setup: the venv has torch $got, but $requirements pins $want" >&2
    exit 1
  fi
  touch "$venv/.complete"
  # Environments of earlier requirements are several GB each: drop them (a
  # checkout still on those requirements makes its own again).
  for old in "$cache"/venv-*; do
    [[ "$old" == "$venv" ]] || rm -rf "$old"
  done
fi

# .venv -> the cached environment (replacing a link to an older one).
if [[ -L .venv || ! -e .venv ]]; then
  [[ "$(readlink .venv 2>/dev/null)" == "$venv" ]] || ln -sfn "$venv" .venv
else
  echo "setup: .venv exists and is not a link; leaving it (remove it to use $venv)" >&2
fi
