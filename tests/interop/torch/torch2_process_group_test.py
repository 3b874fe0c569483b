#!/usr/bin/env python3
"""init_process_group("gloo", store=TCPStore(is_master=False), rank,
world_size=4) with PyTorch 2.x in 4 processes bootstraps through the store
under test (ranks 0 and 2 on use_libuv=True clients, 1 and 3 on
use_libuv=False); all_reduce, broadcast, all_gather and barrier then run
and every rank checks their results: the barrier by a store counter each
rank adds to before it, which every rank must read as 4 after it. Against
cohortd, gloo's bootstrap keys are then in cohortctl list."""
import multiprocessing as mp
import sys
import traceback
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402
import torch2_harness as t2  # noqa: E402

WORLD = 4


def rank_main(port, rank, results):
    try:
        dist = t2.import_torch2()
        import torch
        store = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=(rank % 2 == 0),
                              timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=120))
        problems = []
        total = sum(range(1, WORLD + 1))
        t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        dist.all_reduce(t)
        if t.tolist() != [total * 1.0, 10.0 * total]:
            problems.append(f"all_reduce SUM gave {t.tolist()}")
        m = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        if m.item() != WORLD - 1:
            problems.append(f"all_reduce MAX gave {m.item()}")
        b = torch.tensor([123.0, -7.5]) if rank == 2 else torch.zeros(2)
        dist.broadcast(b, src=2)
        if b.tolist() != [123.0, -7.5]:
            problems.append(f"broadcast from rank 2 gave {b.tolist()}")
        gathered = [torch.zeros(2) for _ in range(WORLD)]
        dist.all_gather(gathered, torch.tensor([float(rank), rank * 2.0]))
        if [g.tolist() for g in gathered] != [[float(r), r * 2.0] for r in range(WORLD)]:
            problems.append(f"all_gather gave {[g.tolist() for g in gathered]}")
        # Everyone adds before the barrier, so after it nobody can read less
        # than WORLD: a barrier that let a rank through early would.
        store.add("pg2/arrived", 1)
        dist.barrier()
        arrived = int(store.get("pg2/arrived"))
        if arrived != WORLD:
            problems.append(f"after the barrier {arrived} of {WORLD} ranks had arrived")
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, problems))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        results.put((rank, [f"{type(e).__name__}: {e}"]))


def main():
    args = ct.parse_args(__doc__)
    t2.import_torch2()
    c = ct.Checks("torch2_process_group_test")
    b = ct.Backend(args, "torch2_process_group")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    try:
        before = set(b.ctl("list")[1].split()) if b.is_cohortd else set()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(b.port, r, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        seen = {}
        for _ in range(WORLD):
            try:
                rank, problems = results.get(timeout=240)
            except Exception:  # noqa: BLE001 (queue.Empty)
                break
            seen[rank] = problems
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        c.eq("ranks that reported", sorted(seen), list(range(WORLD)))
        for rank in sorted(seen):
            c.eq(f"rank {rank}'s problems", seen[rank], [])
        for r, p in enumerate(procs):
            c.eq(f"rank {r} exit code", p.exitcode, 0)
        if b.is_cohortd:
            rc, out, err = b.ctl("list")
            new = sorted(set(out.split()) - before)
            print(f"keys the job left in cohortd: {new}")
            c.eq("cohortctl get /pg2/arrived", b.ctl("get", "/pg2/arrived")[1], str(WORLD))
            # gloo's full mesh: each rank publishes its address under its
            # rank, in the group's and the device's prefixes (with store=
            # there is no "default_pg"; the client's "/" comes first).
            c.eq(f"keys the job left in cohortd (stderr: {err})", new,
                 [f"/0//cpu//0/{r}" for r in range(WORLD)] + ["/pg2/arrived"])
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    sys.exit(main())
