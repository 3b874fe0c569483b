#!/usr/bin/env python3
"""Reads a cohort checkpoint (docs/checkpoints.md) into NumPy arrays or
torch tensors, checking every shard's CRC-32.

    from cohort_checkpoint import Checkpoint
    ckpt = Checkpoint("/shared/ckpt/step-000000000120")
    ckpt.step, ckpt.world_size, ckpt.attributes
    w = ckpt.tensor("param.0")          # a torch tensor, its global shape
    state = ckpt.state_dict()           # every tensor by name

Which folder is a run's latest committed checkpoint is cohortd's to say:
`cohortctl checkpoints RUN` prints it. A folder whose step was never
committed may hold a metadata.json all the same; this reader does not ask.

As a program: cohort_checkpoint.py FOLDER prints each tensor's name, shape
and sum after reading and checking it, and exits 1 on a damaged shard."""
import json
import os
import sys
import zlib

import numpy as np

FORMAT = "cohort-checkpoint/1"
DTYPES = {"f32": np.dtype("<f4")}


class CheckpointError(Exception):
    pass


class Checkpoint:
    def __init__(self, folder):
        self.folder = folder
        path = os.path.join(folder, "metadata.json")
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT}")
        self.metadata = meta
        # protobuf's JSON mapping writes 64-bit integers as strings.
        self.step = int(meta.get("step", 0))
        self.world_size = int(meta.get("worldSize", 0))
        self.attributes = dict(meta.get("attributes", {}))
        self._tensors = {t["name"]: t for t in meta.get("tensors", [])}

    def names(self):
        return sorted(self._tensors)

    def array(self, name):
        """Tensor `name`, whole, as a NumPy array of its global shape."""
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"checkpoint of step {self.step} has no tensor {name!r}")
        dtype = DTYPES.get(t.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} has dtype {t.get('dtype')!r}")
        shape = tuple(int(d) for d in t.get("shape", []))
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out = np.empty(numel, dtype=dtype)
        covered = 0
        for s in t.get("shards", []):
            start, count = int(s.get("start", 0)), int(s["count"])
            offset = int(s.get("offset", 0))
            path = os.path.join(self.folder, s["file"])
            with open(path, "rb") as f:
                f.seek(offset)
                raw = f.read(count * dtype.itemsize)
            if len(raw) != count * dtype.itemsize:
                raise CheckpointError(f"{path} ends inside tensor {name!r}'s shard at byte {offset}")
            if zlib.crc32(raw) != int(s.get("crc32", 0)):
                raise CheckpointError(f"tensor {name!r}'s shard at bytes {offset}+{len(raw)} "
                                      f"of {path} fails its CRC-32 check")
            out[start:start + count] = np.frombuffer(raw, dtype=dtype)
            covered += count
        if covered != numel:
            raise CheckpointError(f"tensor {name!r}: shards cover {covered} of {numel} elements")
        return out.reshape(shape)

    def tensor(self, name):
        import torch
        return torch.from_numpy(self.array(name))

    def state_dict(self):
        return {name: self.tensor(name) for name in self.names()}


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        print("usage: cohort_checkpoint.py FOLDER", file=sys.stderr)
        return 2
    try:
        ckpt = Checkpoint(argv[1])
        print(f"step {ckpt.step}, saved at world size {ckpt.world_size}, "
              f"attributes {ckpt.attributes}")
        for name in ckpt.names():
            a = ckpt.array(name)
            print(f"{name} {list(a.shape)} sum={float(a.astype(np.float64).sum()):.9g}")
    except (CheckpointError, KeyError) as e:
        print(f"cohort_checkpoint: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
