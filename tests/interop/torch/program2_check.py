"""What the program2_*.py programs share: the command line
(`--backend B --out DIR` trains and writes DIR/B/rank<R>.pt; `--check DIR
WORLD` compares DIR/cohort with DIR/gloo), and the comparisons, each with
its bound derived from IEEE 754 arithmetic (the programs' docstrings say
which applies where).

Notation. u is a format's unit roundoff: 2^-24 for float32, 2^-8 for
bfloat16, 2^-11 for float16. gamma(n, u) = n*u/(1-n*u) bounds the relative
error of an n-addition sum in any order (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., Lemma 3.1 and eq. (4.4)): |fl(sum x_i) -
sum x_i| <= gamma(n-1, u) * sum |x_i|, whichever order the additions take,
each addition rounded in the format of u. The exact sums here are taken in
float64 from the per-rank contributions (at most 4 terms, each a float32 or
narrower value), whose own error is at most gamma(3, 2^-53) * S; the bounds
add it. ulp(y) is the float32 spacing at |y|.
"""
import argparse
import glob
import os
import sys

import torch

import program2_compare

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Half the spacing of the subnormals: the most a rounding into the
# subnormal range can lose, where the relative bound u no longer holds.
ETA = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
U64 = 2.0**-53


def gamma(n, u):
    return n * u / (1 - n * u)


def ulp(y):
    """The float32 spacing above |y|, elementwise (float64)."""
    a = y.detach().to(torch.float32).abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()


def parse_args(doc, more=None):
    """The command line; more(parser) adds a program's own arguments."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["gloo", "cohort"])
    parser.add_argument("--out", help="trains and writes OUT/BACKEND/rank<R>.pt")
    parser.add_argument("--check", nargs=2, metavar=("DIR", "WORLD"),
                        help="compares DIR/cohort with DIR/gloo")
    if more:
        more(parser)
    args = parser.parse_args()
    if args.check is None and (args.backend is None or args.out is None):
        parser.error("give --backend and --out, or --check DIR WORLD")
    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  (registers the backend "cohort")
    return args


def save(out, backend, rank, record):
    path = os.path.join(out, backend)
    os.makedirs(path, exist_ok=True)
    torch.save(record, os.path.join(path, f"rank{rank}.pt"))
    print(f"rank {rank}: wrote {path}/rank{rank}.pt", flush=True)


def params(module):
    """The module's parameters by name, as full float32 (or their own dtype)
    tensors: a DTensor's are gathered (an exact copy)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def grads(module):
    out = {}
    for name, p in module.named_parameters():
        g = p.grad.detach()
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g.clone()
    return out


def load(directory, backend, world):
    paths = sorted(glob.glob(os.path.join(directory, backend, "rank*.pt")))
    records = [torch.load(p, weights_only=False) for p in paths]
    records.sort(key=lambda r: r["rank"])
    ranks = [r["rank"] for r in records]
    if ranks != list(range(world)):
        raise SystemExit(f"FAIL: {directory}/{backend} holds ranks {ranks}, expected 0..{world - 1}")
    return records


class Checks:
    """Counts failures; each message says what differs, where, by how much
    and what the bound was."""

    def __init__(self, name):
        self.name = name
        self.failures = 0
        self.count = 0
        self.nonzero = 0  # bounded comparisons that found a difference
        self.worst = 0.0  # the largest |diff| / bound seen, and where
        self.worst_what = ""

    def fail(self, message):
        self.failures += 1
        print(f"FAIL: {message}", flush=True)

    def equal(self, what, a, b):
        """a and b, dicts of tensors or tensors, are bit-identical; returns
        whether they are."""
        if isinstance(a, dict):
            if sorted(a) != sorted(b):
                self.fail(f"{what}: names {sorted(a)} != {sorted(b)}")
                return False
            return all([self.equal(f"{what} [{k}]", a[k], b[k]) for k in a])
        self.count += 1
        if a.dtype != b.dtype or a.shape != b.shape:
            self.fail(f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            return False
        if not program2_compare.same_bits(a, b):
            diff = (a.double() - b.double()).abs()
            i = int(diff.view(-1).argmax())
            n = int((a != b).sum())
            self.fail(f"{what}: not bit-identical: {n} of {a.numel()} elements differ, "
                      f"the most at flat index {i}: {a.view(-1)[i].item()!r} vs "
                      f"{b.view(-1)[i].item()!r} (|diff| {diff.view(-1)[i].item():.3e})")
            return False
        return True

    def within(self, what, a, b, bound):
        """|a - b| <= bound elementwise (computed in float64)."""
        self.count += 1
        diff = (a.double() - b.double()).abs()
        excess = diff - bound
        if bool((diff > 0).any()):
            self.nonzero += 1
            ratio = float((diff / bound).max())
            if ratio > self.worst:
                self.worst, self.worst_what = ratio, what
        if not bool((excess <= 0).all()):
            i = int(excess.view(-1).argmax())
            n = int((excess > 0).sum())
            self.fail(f"{what}: {n} of {a.numel()} elements exceed the bound, the most at flat "
                      f"index {i}: {a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}, "
                      f"|diff| {diff.view(-1)[i].item():.3e} > bound "
                      f"{bound.reshape(-1)[i].item():.3e}")
        return diff

    def finish(self):
        if self.failures:
            print(f"{self.name}: {self.failures} of {self.count} checks FAILED", flush=True)
            sys.exit(1)
        print(f"{self.name}: all {self.count} checks passed ({self.nonzero} bounded "
              f"comparisons found differences, the largest {self.worst:.3g} of its bound, "
              f"in: {self.worst_what})",
              flush=True)


def sum_bound(contributions, dtype):
    """For contributions c_r (the per-rank tensors a SUM all-reduce adds, of
    the collective's dtype): (s, S, bound) with s the exact sum, S = sum |c_r|
    and bound on |fl(s) - s| for any backend that adds them in any order,
    rounding each addition to dtype (torch's gloo) or adding in float32 and
    rounding once to dtype (cohort's op engine): gamma(n-1, u) * S for the
    former; u * (S + e) + e, e = gamma(n-1, 2^-24) * S, for the latter, which
    is below gamma(n-1, u) * S + 2 * gamma(n-1, 2^-24) * S. Plus eta(dtype)
    where the result is subnormal (addition is exact there, the one final
    rounding is not), plus the float64 reference's own error."""
    c = torch.stack([x.double() for x in contributions])
    n = c.shape[0]
    s = c.sum(0)
    S = c.abs().sum(0)
    bound = (gamma(n - 1, U[dtype]) + 2 * gamma(n - 1, U[torch.float32])
             + gamma(n - 1, U64)) * S + ETA[dtype]
    return s, S, bound


def sgd_bound(lr, g_a, g_b, p_a, p_b):
    """Bound on |p_a - p_b| after one step p <- p - lr * g (SGD without
    momentum: torch adds g with alpha = -lr) from the same p, given the two
    gradients: the products differ by at most lr * |g_a - g_b| * (1 + u) +
    u * lr * (|g_a| + |g_b|) (each product rounded once, or not at all where
    fused), and each sum is then rounded once, by at most half an ulp of its
    result: + ulp(max(|p_a|, |p_b|)). u = 2^-24 (float32 parameters); lr is
    taken with one float32 rounding of its own, (1 + u)."""
    u = U[torch.float32]
    lr = lr * (1 + u)
    ga, gb = g_a.double(), g_b.double()
    return (lr * (ga - gb).abs() * (1 + u) + u * lr * (ga.abs() + gb.abs())
            + torch.maximum(ulp(p_a), ulp(p_b)))


def check_ddp(name, directory, world, comm_dtype, contribute):
    """The checks of a DDP program's records (see program2_ddp_hooks.py's
    docstring for the derivation). contribute(g, world) is what a rank adds
    into the step-1 all-reduce, from its local gradient g, as the program's
    hook computes it, in comm_dtype."""
    c = Checks(name)
    runs = {b: load(directory, b, world) for b in ("gloo", "cohort")}
    for b, rs in runs.items():
        # DDP's invariant: every rank holds the same parameters.
        for r in rs[1:]:
            for key in ("p0", "reduced", "p1", "final"):
                c.equal(f"{b}: {key} of rank {r['rank']} vs rank 0", r[key], rs[0][key])
        for pname in rs[0]["p0"]:
            parts = [contribute(r["local"][pname], world) for r in rs]
            got = rs[0]["reduced"][pname]
            if world == 2:
                # One addition, rounded once to comm_dtype, either order.
                c.equal(f"{b}: step 1's all-reduced gradient of {pname} vs "
                        "fl(c_0 + c_1) of the ranks' contributions",
                        got, (parts[0] + parts[1]).to(got.dtype))
            s, S, bound = sum_bound(parts, comm_dtype)
            c.within(f"{b}: step 1's all-reduced gradient of {pname} vs the exact sum "
                     f"of {world} contributions (bound gamma({world - 1}, u) * S)",
                     got, s, bound)
    g, k = runs["gloo"][0], runs["cohort"][0]
    c.equal("the parameters DDP broadcast (p0), gloo vs cohort", k["p0"], g["p0"])
    for r in range(world):
        c.equal(f"rank {r}'s local step-1 gradients, gloo vs cohort",
                runs["cohort"][r]["local"], runs["gloo"][r]["local"])
    if world == 2:
        for key in ("reduced", "p1", "final"):
            c.equal(f"{key}, gloo vs cohort", k[key], g[key])
    else:
        for pname in g["p1"]:
            bound = sgd_bound(g["lr"], k["reduced"][pname], g["reduced"][pname],
                              k["p1"][pname], g["p1"][pname])
            c.within(f"{pname} after one SGD step, cohort vs gloo "
                     "(bound: lr * |g_cohort - g_gloo| + roundings)",
                     k["p1"][pname], g["p1"][pname], bound)
            _, S, bound = sum_bound([contribute(r["local"][pname], world)
                                     for r in runs["gloo"]], comm_dtype)
            c.within(f"{pname}'s step-1 gradient, cohort vs gloo (bound 2 * gamma(3, u) * S)",
                     k["reduced"][pname], g["reduced"][pname], 2 * bound)
    c.finish()
