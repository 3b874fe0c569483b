#!/usr/bin/python3
"""Every c10d op of the torch.distributed backend "cohort" (cohort_torch),
called through torch's Python API, against torch's own gloo backend in the
same job: each rank runs init_process_group("cohort") and
new_group(backend="gloo"), issues each op on both with the same inputs and
compares. For every dtype torch's gloo has (float32, float64, float16,
int8, uint8, int32, int64) and bfloat16 (gloo lacks it: its reference runs
in float32 and is rounded), at world 2 and 3. Ops gloo lacks (AVG,
all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, all_to_all)
are checked against the same data moved by gloo's other ops. Also:
non-contiguous tensors, uneven all_gather and all_to_all_single, async
works and their futures, and the refusals (dtype, reduce op,
recv from any source) and errors (mismatched ops) with their messages, and
a subgroup made by new_group(backend="cohort").

Run: bazel test //tests/interop:torch_backend_ops_test, or by hand
  PYTHONPATH=bazel-bin/worker/torch /usr/bin/python3 \
      tests/interop/torch/backend_ops_test.py --worlds=2,3
"""
import sys
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import backend_ranks  # noqa: E402
import harness  # noqa: E402

args = backend_ranks.parse_args(__doc__)
dist = backend_ranks.import_backend()
import torch  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
R = dist.ReduceOp
NAMES = {R.SUM: "SUM", R.PRODUCT: "PRODUCT", R.MIN: "MIN", R.MAX: "MAX"}


def data(n, dtype, rank, salt=0):
    """Small integers (1..3): sums, products and averages of up to three
    ranks are exact or rounded the same way in every dtype."""
    return ((torch.arange(n) + rank + salt) % 3 + 1).to(dtype)


class Job:
    def __init__(self, rank, world):
        self.rank = rank
        self.world = world
        self.c = harness.Checks(f"rank {rank} of {world}")
        dist.init_process_group("cohort", timeout=timedelta(seconds=30))
        self.gloo = dist.new_group(backend="gloo",
                                   timeout=timedelta(seconds=30))

    def same(self, what, got, want):
        if got.dtype != want.dtype or got.shape != want.shape:
            return self.c.fail(f"{what}: got {got.dtype} {tuple(got.shape)}, "
                               f"gloo {want.dtype} {tuple(want.shape)}")
        if got.is_floating_point():
            ok = torch.allclose(got.double(), want.double(), rtol=1e-3)
        else:
            ok = torch.equal(got, want)
        return self.c.ok(ok, f"{what}: cohort {got.tolist()} != gloo "
                             f"{want.tolist()}")

    def gloo_run(self, dtype, fn, *tensors_or_lists):
        """Runs fn on the gloo group, in float32 for bfloat16 (which torch's
        gloo lacks), writing the results back into the given tensors."""
        if dtype != torch.bfloat16:
            fn(*tensors_or_lists)
            return

        def up(x):
            return [t.float() for t in x] if isinstance(x, list) else x.float()
        wide = [up(x) for x in tensors_or_lists]
        fn(*wide)
        for orig, w in zip(tensors_or_lists, wide):
            for o, t in (zip(orig, w) if isinstance(orig, list) else [(orig, w)]):
                o.copy_(t.to(torch.bfloat16))

    # -- one dtype, every op ---------------------------------------------

    def ops(self, dt):
        rank, world, g = self.rank, self.world, self.gloo
        n = 7

        t, ref = data(n, dt, rank), data(n, dt, rank)
        dist.broadcast(t, src=world - 1)
        self.gloo_run(dt, lambda x: dist.broadcast(x, world - 1, group=g), ref)
        self.same("broadcast", t, ref)

        for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX):
            t, ref = data(n, dt, rank), data(n, dt, rank)
            dist.all_reduce(t, op=op)
            self.gloo_run(dt, lambda x: dist.all_reduce(x, op, group=g), ref)
            self.same(f"all_reduce {NAMES[op]}", t, ref)

        t, total = data(n, dt, rank), data(n, dt, rank)
        dist.all_reduce(t, op=R.AVG)
        self.gloo_run(dt, lambda x: dist.all_reduce(x, group=g), total)
        if dt.is_floating_point:
            want = (total.double() / world).to(dt)
        else:
            want = torch.div(total, world, rounding_mode="trunc")
        self.same("all_reduce AVG (gloo: SUM / world)", t, want)

        ts = [data(5, dt, rank), data(6, dt, rank, 1).view(2, 3)]
        refs = [x.clone() for x in ts]
        dist.all_reduce_coalesced(ts, op=R.MAX)
        self.gloo_run(dt, lambda a, b: dist.all_reduce_coalesced(
            [a, b], op=R.MAX, group=g), *refs)
        for i in range(2):
            self.same(f"all_reduce_coalesced MAX [{i}]", ts[i], refs[i])

        for op in (R.SUM, R.MIN):
            t, ref = data(n, dt, rank), data(n, dt, rank)
            dist.reduce(t, dst=world - 1, op=op)
            self.gloo_run(dt, lambda x: dist.reduce(x, world - 1, op, group=g),
                          ref)
            if rank == world - 1:
                self.same(f"reduce {NAMES[op]} (root)", t, ref)
            else:
                self.same(f"reduce {NAMES[op]} (non-root keeps its tensor)", t,
                          data(n, dt, rank))

        outs = [torch.zeros(n, dtype=dt) for _ in range(world)]
        refs = [torch.zeros(n, dtype=dt) for _ in range(world)]
        dist.all_gather(outs, data(n, dt, rank))
        self.gloo_run(dt, lambda lst, x: dist.all_gather(lst, x, group=g),
                      refs, data(n, dt, rank))
        for r in range(world):
            self.same(f"all_gather [{r}]", outs[r], refs[r])

        flat = torch.zeros(n * world, dtype=dt)
        dist.all_gather_into_tensor(flat, data(n, dt, rank))
        self.same("all_gather_into_tensor (gloo: all_gather)", flat,
                  torch.cat(refs))

        outs = [torch.zeros(n, dtype=dt) for _ in range(world)]
        refs = [torch.zeros(n, dtype=dt) for _ in range(world)]
        dist.gather(data(n, dt, rank), outs if rank == 0 else None, dst=0)
        self.gloo_run(dt, lambda x, *lst: dist.gather(
            x, list(lst) if rank == 0 else None, dst=0, group=g),
            data(n, dt, rank), *refs)
        if rank == 0:
            for r in range(world):
                self.same(f"gather [{r}]", outs[r], refs[r])

        parts = [data(n, dt, r, 2) for r in range(world)]
        t, ref = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
        dist.scatter(t, parts if rank == 0 else None, src=0)
        self.gloo_run(dt, lambda x, *lst: dist.scatter(
            x, list(lst) if rank == 0 else None, src=0, group=g),
            ref, *[p.clone() for p in parts])
        self.same("scatter", t, ref)

        # Reference: every block all_reduced by gloo; this rank's block kept.
        for op in (R.SUM, R.MAX):
            ins = [data(n, dt, rank, j) for j in range(world)]
            t = torch.zeros(n, dtype=dt)
            dist.reduce_scatter(t, ins, op=op)
            ref = torch.cat(ins)
            self.gloo_run(dt, lambda x: dist.all_reduce(x, op, group=g), ref)
            self.same(f"reduce_scatter {NAMES[op]} (gloo: all_reduce)", t,
                      ref[rank * n:(rank + 1) * n])

        big = data(n * world, dt, rank)
        t = torch.zeros(n, dtype=dt)
        dist.reduce_scatter_tensor(t, big)
        ref = big.clone()
        self.gloo_run(dt, lambda x: dist.all_reduce(x, group=g), ref)
        self.same("reduce_scatter_tensor (gloo: all_reduce)", t,
                  ref[rank * n:(rank + 1) * n])

        src = data(2 * world, dt, rank)
        t, ref = torch.zeros(2 * world, dtype=dt), torch.zeros(2 * world, dtype=dt)
        dist.all_to_all_single(t, src)
        self.gloo_run(dt, lambda o, i: dist.all_to_all_single(o, i, group=g),
                      ref, src)
        self.same("all_to_all_single", t, ref)

        # Rank r sends j + 1 rows of 2 to rank j, so receives rank + 1 from each.
        in_splits = [j + 1 for j in range(world)]
        out_splits = [rank + 1] * world
        src = data(2 * sum(in_splits), dt, rank).view(-1, 2)
        t = torch.zeros(sum(out_splits), 2, dtype=dt)
        ref = torch.zeros(sum(out_splits), 2, dtype=dt)
        dist.all_to_all_single(t, src, out_splits, in_splits)
        self.gloo_run(dt, lambda o, i: dist.all_to_all_single(
            o, i, out_splits, in_splits, group=g), ref, src)
        self.same("all_to_all_single with splits", t, ref)

        ins = [data(3, dt, rank, j) for j in range(world)]
        outs = [torch.zeros(3, dtype=dt) for _ in range(world)]
        dist.all_to_all(outs, ins)
        flat = torch.zeros(3 * world, dtype=dt)
        self.gloo_run(dt, lambda o, i: dist.all_to_all_single(o, i, group=g),
                      flat, torch.cat(ins))
        for r in range(world):
            self.same(f"all_to_all [{r}] (gloo: all_to_all_single)", outs[r],
                      flat[3 * r:3 * (r + 1)])

        nxt, prv = (rank + 1) % world, (rank - 1) % world
        t, ref = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
        works = [dist.isend(data(n, dt, rank), nxt, tag=5),
                 dist.irecv(t, prv, tag=5)]
        for w in works:
            w.wait()
        self.gloo_run(dt, lambda x: [w.wait() for w in (
            dist.isend(data(n, dt, rank).to(x.dtype), nxt, group=g, tag=5),
            dist.irecv(x, prv, group=g, tag=5))], ref)
        self.same("isend/irecv ring", t, ref)

        dist.barrier()

    # -- the rest --------------------------------------------------------

    def shapes_and_async(self):
        rank, world, g = self.rank, self.world, self.gloo
        # A transposed view and a strided slice: handled through copies.
        base = data(12, torch.float32, rank).view(3, 4)
        ref = base.clone()
        view = base.t()
        dist.all_reduce(view)
        dist.all_reduce(ref, group=g)
        self.same("all_reduce of a transposed view", base, ref)
        x = torch.zeros(10)
        if rank == 0:
            x[::2] = torch.arange(5.0) + 1
        dist.broadcast(x[::2], src=0)
        self.same("broadcast into a strided slice", x,
                  torch.stack([torch.arange(5.0) + 1, torch.zeros(5)], 1).view(-1))

        # all_gather with a size per rank (torch's gloo needs equal sizes).
        outs = [torch.zeros(r + 1, dtype=torch.int64) for r in range(world)]
        dist.all_gather(outs, torch.full((rank + 1,), rank, dtype=torch.int64))
        for r in range(world):
            self.same(f"uneven all_gather [{r}]", outs[r],
                      torch.full((r + 1,), r, dtype=torch.int64))

        # Async: outputs filled when wait() returns, and the future's value.
        outs = [torch.zeros(3) for _ in range(world)]
        work = dist.all_gather(outs, torch.full((3,), float(rank)),
                               async_op=True)
        fut = work.get_future()
        work.wait()
        self.c.ok(work.is_completed(), "all_gather work not completed after wait()")
        for r in range(world):
            self.same(f"async all_gather [{r}]", outs[r], torch.full((3,), float(r)))
        value = fut.wait()
        self.c.ok(len(value) == world and value[1] is not None and
                  torch.equal(value[1], outs[1]),
                  f"future value {value} is not the output list")
        t = torch.ones(4)
        fut = dist.all_reduce(t, async_op=True).get_future()
        doubled = fut.then(lambda f: f.value()[0] * 2).wait()
        self.same("all_reduce future .then()", doubled, torch.full((4,), 2.0 * world))

    def subgroup(self):
        rank, world = self.rank, self.world
        members = [0, world - 1]
        sub = dist.new_group(members, backend="cohort",
                             timeout=timedelta(seconds=30))
        if rank in members:
            self.c.eq("subgroup size", sub.size(), 2)
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=sub)
            self.same("all_reduce in new_group([0, last], backend=cohort)", t,
                      torch.tensor([float(1 + world)]))
        dist.barrier()

    def refusals(self):
        rank, world = self.rank, self.world

        def error_of(fn):
            try:
                fn()
            except RuntimeError as e:
                return str(e)
            return "(no error)"

        def expect(what, message, part):
            self.c.ok(part in message, f"{what}: expected an error containing "
                                       f"{part!r}, got {message!r}")

        expect("bool all_reduce",
               error_of(lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool))),
               "allreduce does not support dtype Bool")
        expect("BAND all_reduce",
               error_of(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                op=R.BAND)),
               "allreduce does not support ReduceOp.BAND")
        expect("BXOR reduce_scatter",
               error_of(lambda: dist.reduce_scatter(
                   torch.zeros(2, dtype=torch.int32),
                   [torch.ones(2, dtype=torch.int32)] * world, op=R.BXOR)),
               "reduce_scatter does not support ReduceOp.BXOR")
        expect("complex broadcast",
               error_of(lambda: dist.broadcast(torch.ones(2, dtype=torch.complex64), 0)),
               "broadcast does not support dtype ComplexFloat")
        expect("recv from any source",
               error_of(lambda: dist.recv(torch.zeros(2))),
               "cohort does not support recvAnysource")
        # Ranks that disagree: cohort's verify_ops fails the op on every rank
        # (INVALID_ARGUMENT) and the group stays usable.
        expect("mismatched all_reduce",
               error_of(lambda: dist.all_reduce(torch.ones(4 + rank))),
               "cohort: INVALID_ARGUMENT: AllReduce SUM of")
        t = torch.ones(2)
        dist.all_reduce(t)
        self.same("all_reduce after the refusals", t, torch.full((2,), float(world)))

    def run(self):
        print(f"rank {self.rank}: backend {dist.get_backend()}, "
              f"gloo group backend {dist.get_backend(self.gloo)}", flush=True)
        self.c.eq("default group's backend", dist.get_backend(), "cohort")
        for dt in DTYPES:
            self.c.section(f"every op, {dt}", self.ops, dt)
        self.c.section("layouts, uneven sizes, async", self.shapes_and_async)
        self.c.section("a subgroup", self.subgroup)
        self.c.section("refusals and errors", self.refusals)
        dist.destroy_process_group()
        self.c.finish()


if __name__ == "__main__":
    backend_ranks.main(args, lambda rank, world: Job(rank, world).run(),
                       "backend_ops_test")
