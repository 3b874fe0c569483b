"""What the tests of the backend "cohort" on PyTorch 2.x
(tests/interop/torch/backend2_*_test.py) add to backend_ranks.py: their ranks
run on the interpreter running the test (the venv's, which
tests/interop/torch_backend2_test.sh starts them with), and the imports fail,
not skip, unless that is torch 2.x with the 2.x build of cohort_torch.
"""
import os
import sys

import backend_ranks
import torch2_harness

# launch() starts every rank with this interpreter.
backend_ranks.PYTHON = sys.executable
parse_args = backend_ranks.parse_args
main = backend_ranks.main


def import_backend():
    """torch.distributed 2.x with the backend "cohort" registered, or exits 1."""
    dist = torch2_harness.import_torch2()
    try:
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    except ImportError as e:
        print(f"FAIL: cannot import cohort_torch ({e}); PYTHONPATH="
              f"{os.environ.get('PYTHONPATH', '')!r} should hold "
              "bazel-bin/worker/torch/torch2")
        sys.exit(1)
    return dist


def launch_script(script, world, script_args=(), name="job"):
    """Starts `world` ranks of an unmodified torch program (env:// with a
    free MASTER_PORT, as torchrun would set it up); returns them for
    backend_ranks.wait_all."""
    port = backend_ranks.free_port()
    folder = backend_ranks.harness.scratch_dir(f"{name}-world{world}")
    ranks = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log_path = os.path.join(folder, f"rank{r}.log")
        with open(log_path, "wb") as log:
            proc = backend_ranks.subprocess.Popen(
                [sys.executable, script, *script_args], stdout=log,
                stderr=backend_ranks.subprocess.STDOUT,
                stdin=backend_ranks.subprocess.DEVNULL, env=env)
        ranks.append(backend_ranks.Rank(r, proc, log_path))
    return ranks
