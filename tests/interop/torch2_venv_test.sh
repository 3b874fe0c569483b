#!/usr/bin/env bash
# The project venv (tools/venv.sh) is what docs/pytorch.md says: its python
# imports the torch pinned in tools/requirements.txt, and that torch's own
# distributed stack runs a job: two processes join a gloo process group
# through torch 2.x's TCPStore (libuv server, the 2.x default) and
# all_reduce, whose result both ranks check.
set -uo pipefail

# The checkout: requirements.txt is a runfile linked to its source.
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
[[ -x "$PYTHON" ]] || { echo "FAIL: no venv python at $PYTHON: run tools/setup.sh"; exit 1; }

want=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$requirements")
got=$("$PYTHON" -c 'import torch; print(torch.__version__)') ||
  { echo "FAIL: $PYTHON cannot import torch"; exit 1; }
if [[ "${got%%+*}" != "$want" ]]; then
  echo "FAIL: the venv has torch $got, tools/requirements.txt pins $want"
  exit 1
fi

# A file, not stdin: the spawned ranks import it.
job=${TEST_TMPDIR:-$(mktemp -d)}/gloo_job.py
cat >"$job" <<'PY'
import datetime
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def rank_main(rank, port, world):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=(rank == 0),
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    want = float(world * (world + 1) // 2)
    assert torch.equal(t, torch.full((1000,), want)), (rank, t[:4])
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port, 2), nprocs=2,
                       start_method="spawn")
    print("ok")
PY
"$PYTHON" "$job" || { echo "FAIL: a 2-rank gloo job on the venv's torch"; exit 1; }
echo "torch2_venv_test: torch $got from $PYTHON ran a 2-rank gloo job"
