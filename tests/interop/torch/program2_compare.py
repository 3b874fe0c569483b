"""Bit-for-bit comparison of tensors and (nested) state dicts, for the check
phases of tests/interop/torch/program2_{pipeline,dcp,elastic}.py (and the bit
test under program2_check.Checks.equal): each difference comes back as a
sentence that names the entry and how far apart the values are."""
import torch

SHOWN = 30  # failures printed; the count says how many there were


def same_bits(a, b):
    """a and b have the same dtype, shape and bytes (so -0.0 != 0.0, and a
    NaN equals the same NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8))


def describe(a, b):
    """How two tensors that are not the same bits differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.numel() == 0:
        return "same values, other bits"
    diff = (a.detach().double() - b.detach().double()).abs()
    return (f"{int((diff > 0).sum())} of {a.numel()} elements differ, "
            f"max |diff| {diff.max().item():.3g}")


def flatten(tree, prefix=""):
    """A nested dict/list of tensors and plain values as {"a.b.0": leaf}."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    flat = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def differences(got, want, what):
    """The entries in which the state `got` is not bit for bit `want`, each
    as "WHAT: ..."; [] when they are the same."""
    got, want = flatten(got), flatten(want)
    out = []
    if sorted(got) != sorted(want):
        out.append(f"{what}: entries only in the first: {sorted(set(got) - set(want))}; "
                   f"only in the second: {sorted(set(want) - set(got))}")
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not same_bits(a, b):
                out.append(f"{what}: {key} differs: {describe(a, b)}")
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            out.append(f"{what}: {key} is {a!r}, expected {b!r}")
    return out


def report(failures, summary):
    """Prints the failures and a summary line; returns the exit status."""
    for f in failures[:SHOWN]:
        print(f"FAIL: {f}")
    if len(failures) > SHOWN:
        print(f"FAIL: ... and {len(failures) - SHOWN} more")
    print(f"{summary}: " + ("bit-identical" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0
