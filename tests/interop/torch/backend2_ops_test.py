#!/usr/bin/env python3
"""The torch.distributed backend "cohort" on PyTorch 2.x (the 2.x build of
cohort_torch, a c10d::Backend), through torch's Python API. First every
check of backend_ops_test.py, unchanged: each op against torch's own gloo
backend in the same job, every dtype, non-contiguous tensors, async works
and their futures, refusals and errors, a subgroup. Then what 2.x adds:
 - ReduceOp.AVG and PREMUL_SUM (FSDP2's reductions) in all_reduce and
   reduce_scatter_tensor, with a double and a tensor factor, and the
   refusal of PREMUL_SUM on integers;
 - the coalesced forms torch's _coalescing_manager issues
   (allreduce_coalesced, allgather_into_tensor_coalesced,
   reduce_scatter_tensor_coalesced), with and without a device (the
   backend's startCoalescing/endCoalescing);
 - batch_isend_irecv rings (the path pipeline schedules take);
 - the object collectives DCP uses (broadcast_object_list,
   all_gather_object, gather_object, scatter_object_list: uint8 and int64);
 - the functional collectives DTensor uses (all_reduce, all_gather_tensor,
   reduce_scatter_tensor of torch.distributed._functional_collectives);
 - "cpu" among the default group's device types (DCP's async_save), and
   all_gather into views of one flat tensor (no staging copy);
 - the refusals of backend_ops_test.py, but a complex broadcast works:
   torch 2.x hands it to every backend as float pairs.
Values are small integers, so every expectation is exact; PREMUL_SUM's
factors are powers of two, which scale exactly.

Run: bazel test //tests/interop:torch_backend2_ops_test, or by hand
  PYTHONPATH=bazel-bin/worker/torch/torch2:tests/interop/torch \\
      .venv/bin/python tests/interop/torch/backend2_ops_test.py --worlds=2,3
"""
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import backend2_ranks  # noqa: E402

args = backend2_ranks.parse_args(__doc__)
dist = backend2_ranks.import_backend()
import backend_ops_test  # noqa: E402  (the 1.13 checks, on this torch)
import torch  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

R = dist.ReduceOp


class Job(backend_ops_test.Job):
    def exact(self, what, got, want):
        return self.c.ok(got.dtype == want.dtype and torch.equal(got, want),
                         f"{what}: got {got.dtype} {got.tolist()}, want "
                         f"{want.dtype} {want.tolist()}")

    def reductions(self):
        rank, world = self.rank, self.world
        total = sum(r + 1 for r in range(world))
        for dt in (torch.float32, torch.float64, torch.bfloat16):
            t = torch.full((5,), float(rank + 1), dtype=dt)
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
            self.exact(f"all_reduce PREMUL_SUM(0.5) {dt}", t,
                      torch.full((5,), total * 0.5, dtype=dt))
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.25])))
        self.exact("all_reduce PREMUL_SUM(tensor 0.25)", t,
                  torch.full((5,), total * 0.25))

        # Block j of rank r holds j + r + 1: the reduced block j is
        # world * (j + 1) + world * (world - 1) / 2.
        n = 3
        big = torch.cat([torch.full((n,), float(j + rank + 1))
                         for j in range(world)])
        block = float(world * (rank + 1) + world * (world - 1) // 2)
        for op, want in ((R.SUM, block), (R.AVG, block / world),
                         (dist._make_nccl_premul_sum(0.5), block * 0.5)):
            out = torch.zeros(n)
            dist.reduce_scatter_tensor(out, big, op=op)
            self.exact(f"reduce_scatter_tensor {op}", out, torch.full((n,), want))

        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32),
                            op=dist._make_nccl_premul_sum(2.0))
            message = "(no error)"
        except RuntimeError as e:
            message = str(e)
        self.c.ok("allreduce does not support ReduceOp.PREMUL_SUM on dtype Int"
                  in message, f"PREMUL_SUM of int32: {message!r}")

    def coalesced(self):
        rank, world = self.rank, self.world
        for device in (None, torch.device("cpu")):
            how = "fast path" if device is None else "start/endCoalescing"
            ins = [torch.full((2,), rank, dtype=torch.uint8),
                   torch.full((3,), rank, dtype=torch.uint8)]
            outs = [torch.zeros(2 * world, dtype=torch.uint8),
                    torch.zeros(3 * world, dtype=torch.uint8)]
            with dist._coalescing_manager(device=device, async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            cm.wait()
            for o, i in zip(outs, ins):
                self.exact(f"coalesced all_gather_into_tensor ({how})", o,
                          torch.arange(world, dtype=torch.uint8)
                          .repeat_interleave(i.numel()))

            bigs = [torch.ones(2 * world) * (rank + 1),
                    torch.ones(world, dtype=torch.float64) * (rank + 1)]
            smalls = [torch.zeros(2), torch.zeros(1, dtype=torch.float64)]
            with dist._coalescing_manager(device=device, async_ops=True) as cm:
                for s, b in zip(smalls, bigs):
                    dist.reduce_scatter_tensor(s, b)
            cm.wait()
            total = float(world * (world + 1) // 2)
            for s in smalls:
                self.exact(f"coalesced reduce_scatter_tensor ({how})", s,
                          torch.full_like(s, total))

            ts = [torch.ones(4) * (rank + 1), torch.ones(2) * (rank + 1)]
            with dist._coalescing_manager(device=device, async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t)
            cm.wait()
            for t in ts:
                self.exact(f"coalesced all_reduce ({how})", t,
                          torch.full_like(t, total))

    def point_to_point(self):
        rank, world = self.rank, self.world
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        # Both directions at once: every rank posts its receives first, and
        # nothing may block until all are posted.
        got_prv, got_nxt = torch.zeros(4), torch.zeros(4)
        ops = [dist.P2POp(dist.irecv, got_prv, prv),
               dist.P2POp(dist.irecv, got_nxt, nxt),
               dist.P2POp(dist.isend, torch.full((4,), float(rank)), nxt),
               dist.P2POp(dist.isend, torch.full((4,), float(rank)), prv)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.exact("batch_isend_irecv from the previous rank", got_prv,
                  torch.full((4,), float(prv)))
        self.exact("batch_isend_irecv from the next rank", got_nxt,
                  torch.full((4,), float(nxt)))
        # A blocking send on one side, an irecv posted later on the other.
        t = torch.zeros(3, dtype=torch.int64)
        if rank == 0:
            dist.send(torch.arange(3), dst=world - 1)
        elif rank == world - 1:
            work = dist.irecv(t, src=0)
            work.wait()
            self.exact("send / irecv", t, torch.arange(3))
        dist.barrier()

    def objects(self):
        rank, world = self.rank, self.world
        objs = [{"from": rank, "data": list(range(rank + 3))}, "x" * (rank + 1)]
        if rank != 0:
            objs = [None, None]
        dist.broadcast_object_list(objs, src=0)
        self.c.eq("broadcast_object_list", objs,
                  [{"from": 0, "data": [0, 1, 2]}, "x"])
        everyone = [None] * world
        dist.all_gather_object(everyone, ("rank", rank, "y" * rank))
        self.c.eq("all_gather_object", everyone,
                  [("rank", r, "y" * r) for r in range(world)])
        gathered = [None] * world if rank == 0 else None
        dist.gather_object({"r": rank}, gathered, dst=0)
        if rank == 0:
            self.c.eq("gather_object", gathered, [{"r": r} for r in range(world)])
        out = [None]
        dist.scatter_object_list(
            out, [f"for {r}" * (r + 1) for r in range(world)] if rank == 0
            else None, src=0)
        self.c.eq("scatter_object_list", out[0], f"for {rank}" * (rank + 1))

    def functional(self):
        rank, world = self.rank, self.world
        group = dist.group.WORLD
        t = funcol.all_reduce(torch.full((4,), float(rank + 1)), "sum", group)
        self.exact("funcol.all_reduce", funcol.wait_tensor(t),
                  torch.full((4,), float(world * (world + 1) // 2)))
        g = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, group)
        self.exact("funcol.all_gather_tensor", funcol.wait_tensor(g),
                  torch.arange(world).float().repeat_interleave(2))
        s = funcol.reduce_scatter_tensor(torch.ones(2 * world), "avg", 0, group)
        self.exact("funcol.reduce_scatter_tensor avg", funcol.wait_tensor(s),
                  torch.ones(2))

    def devices_and_views(self):
        rank, world = self.rank, self.world
        pg = dist.distributed_c10d._get_default_group()
        self.c.ok(torch.device("cpu") in pg._device_types,
                  f"cpu not among the default group's devices {pg._device_types}")
        self.c.eq("the backend's name", pg._get_backend(torch.device("cpu")).name(),
                  "cohort")
        flat = torch.zeros(3 * world, dtype=torch.int64)
        views = list(flat.chunk(world))
        dist.all_gather(views, torch.full((3,), rank, dtype=torch.int64))
        self.exact("all_gather into views of one tensor", flat,
                  torch.arange(world).repeat_interleave(3))

        # Separate output tensors go through the group's staging buffer,
        # which one op reuses only when no op in flight holds it: three list
        # all_gathers and reduce_scatters in flight at once (each needs a
        # buffer of its own), then the same one after the other (each reuses
        # the cached one, which a bigger op replaces).
        for how, together in (("in flight at once", True), ("in turn", False)):
            for sizes in ((5, 5, 5), (2, 7, 3)):
                pending = []  # (work, [(what, got, want)])
                for k, n in enumerate(sizes):
                    outs = [torch.full((n,), -1.0) for _ in range(world)]
                    work = dist.all_gather(outs, torch.full((n,), rank * 10.0 + k),
                                           async_op=True)
                    pending.append((work, [
                        (f"list all_gather {sizes} {how}", o,
                         torch.full((n,), r * 10.0 + k))
                        for r, o in enumerate(outs)]))
                    # Rank r's output: the sum over ranks q of ins_q[r].
                    out = torch.zeros(n)
                    ins = [torch.full((n,), (rank + 1) * 100.0 + j + k)
                           for j in range(world)]
                    work = dist.reduce_scatter(out, ins, async_op=True)
                    total = sum((q + 1) * 100.0 for q in range(world))
                    pending.append((work, [(
                        f"list reduce_scatter {sizes} {how}", out,
                        torch.full((n,), total + world * (rank + k)))]))
                    if not together:
                        for work, checks in pending[-2:]:
                            work.wait()
                for work, checks in pending:
                    work.wait()
                    for what, got, want in checks:
                        self.exact(what, got, want)

    def refusals(self):
        """backend_ops_test's refusals, but for complex tensors: torch 2.x
        hands every backend a complex tensor's broadcast as a view of float
        pairs (torch.view_as_real), so that one works."""
        rank, world = self.rank, self.world

        def error_of(fn):
            try:
                fn()
            except RuntimeError as e:
                return str(e)
            return "(no error)"

        for what, fn, part in (
                ("bool all_reduce",
                 lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)),
                 "allreduce does not support dtype Bool"),
                ("BAND all_reduce",
                 lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                         op=R.BAND),
                 "allreduce does not support ReduceOp.BAND"),
                ("BXOR reduce_scatter",
                 lambda: dist.reduce_scatter(
                     torch.zeros(2, dtype=torch.int32),
                     [torch.ones(2, dtype=torch.int32)] * world, op=R.BXOR),
                 "reduce_scatter does not support ReduceOp.BXOR"),
                ("int16 all_gather_into_tensor",
                 lambda: dist.all_gather_into_tensor(
                     torch.zeros(2 * world, dtype=torch.int16),
                     torch.ones(2, dtype=torch.int16)),
                 "_allgather_base does not support dtype Short"),
                ("recv from any source", lambda: dist.recv(torch.zeros(2)),
                 "cohort does not support recvAnysource"),
                ("mismatched all_reduce",
                 lambda: dist.all_reduce(torch.ones(4 + rank)),
                 "cohort: INVALID_ARGUMENT: AllReduce SUM of")):
            message = error_of(fn)
            self.c.ok(part in message, f"{what}: expected an error containing "
                                       f"{part!r}, got {message!r}")
        z = torch.full((3,), complex(rank, -rank), dtype=torch.complex64)
        dist.broadcast(z, src=world - 1)
        self.exact("complex broadcast (as float pairs)", z,
                   torch.full((3,), complex(world - 1, 1 - world),
                              dtype=torch.complex64))
        t = torch.ones(2)
        dist.all_reduce(t)
        self.exact("all_reduce after the refusals", t,
                   torch.full((2,), float(world)))

    def run(self):
        self.c.section("2.x: AVG and PREMUL_SUM", self.reductions)
        self.c.section("2.x: coalesced forms", self.coalesced)
        self.c.section("2.x: batch_isend_irecv and p2p", self.point_to_point)
        self.c.section("2.x: object collectives", self.objects)
        self.c.section("2.x: functional collectives", self.functional)
        self.c.section("2.x: devices, views", self.devices_and_views)
        super().run()  # the 1.13 checks; destroys the group and exits


if __name__ == "__main__":
    backend2_ranks.main(args, lambda rank, world: Job(rank, world).run(),
                        "backend2_ops_test")
