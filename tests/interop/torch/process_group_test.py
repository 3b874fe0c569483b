#!/usr/bin/python3
"""init_process_group("gloo", store=TCPStore(is_master=False)) in 4 processes
bootstraps through the store under test; an all_reduce, an all_gather and a
broadcast then run and every rank checks their results."""
import multiprocessing as mp
import sys
import traceback
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402

dist = ct.import_torch()
WORLD = 4


def rank_main(port, rank, results):
    try:
        import torch
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        problems = []
        t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        dist.all_reduce(t)
        want = [sum(range(1, WORLD + 1)) * 1.0, 10.0 * sum(range(1, WORLD + 1))]
        if t.tolist() != want:
            problems.append(f"all_reduce gave {t.tolist()}, expected {want}")
        gathered = [torch.zeros(1) for _ in range(WORLD)]
        dist.all_gather(gathered, torch.tensor([float(rank)]))
        if [g.item() for g in gathered] != [float(r) for r in range(WORLD)]:
            problems.append(f"all_gather gave {[g.item() for g in gathered]}")
        b = torch.tensor([123.0 if rank == 2 else -1.0])
        dist.broadcast(b, src=2)
        if b.item() != 123.0:
            problems.append(f"broadcast from rank 2 gave {b.item()}")
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, problems))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        results.put((rank, [f"{type(e).__name__}: {e}"]))


def main():
    args = ct.parse_args(__doc__)
    c = ct.Checks("process_group_test")
    b = ct.Backend(args, "process_group")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    try:
        before = set(b.ctl("list")[1].split()) if b.is_cohortd else set()
        ctx = mp.get_context("fork")
        results = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(b.port, r, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        seen = {}
        for _ in range(WORLD):
            try:
                rank, problems = results.get(timeout=120)
            except Exception:  # noqa: BLE001 (queue.Empty)
                break
            seen[rank] = problems
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        c.eq("ranks that reported", sorted(seen), list(range(WORLD)))
        for rank in sorted(seen):
            c.eq(f"rank {rank}'s problems", seen[rank], [])
        for r, p in enumerate(procs):
            c.eq(f"rank {r} exit code", p.exitcode, 0)
        if b.is_cohortd:
            rc, out, err = b.ctl("list")
            new = sorted(set(out.split()) - before)
            print(f"keys gloo's bootstrap left in cohortd: {new}")
            c.ok(len(new) >= WORLD, f"expected at least {WORLD} new keys from the "
                 f"gloo bootstrap in cohortctl list, got {new} ({err})")
            c.eq("cohortd exit status on SIGTERM", b.stop(), 0)
    finally:
        b.kill9()
    c.finish()


if __name__ == "__main__":
    sys.exit(main())
