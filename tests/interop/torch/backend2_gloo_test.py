#!/usr/bin/env python3
"""cohort's Gloo and torch's own Gloo in one PyTorch 2.x process.

torch 2.x wheels carry their own Gloo inside libtorch_cpu.so, its functions
exported under the same names as Debian's libgloo, which cohort's backend
is built on. The 2.x module links no Gloo; it loads libcohort_gloo.so, which
holds cohort's Gloo group and links Debian's libgloo, with RTLD_DEEPBIND and
exporting only its two entry points (worker/torch/gloo_group.h). This test
shows that the names do clash and that the clash cannot reach cohort:
 - the files: the module has no libgloo among its needed libraries and no
   gloo symbol to bind; libcohort_gloo.so needs libgloo.so.0 and exports
   exactly its entry points; libtorch_cpu.so exports Gloo's functions;
 - in every rank, the name gloo::transport::tcp::CreateDevice looked up
   from the module's own scope is torch's copy (the clash, had the module
   linked libgloo), while cohort's group code was bound to Debian's
   libgloo.so.0;
 - a 2-process job runs torch's "gloo" and cohort's "cohort" one after the
   other (each as the default group, in both orders), then both at once
   (the default group on one, dist.new_group on the other, each way round)
   with their ops interleaved and in flight together; every result is
   exact (integer-valued floats);
 - all of it again with TORCH_USE_RTLD_GLOBAL=1, where torch's libraries,
   its Gloo included, are global in the process: there the plain global
   lookup of the name is torch's too, and cohort is still on libgloo.so.0;
 - and the control, which shows both that the check above can see a clash
   and that RTLD_DEEPBIND is what prevents it: with TORCH_USE_RTLD_GLOBAL=1,
   a process that loads libcohort_gloo.so itself before importing
   cohort_torch, plainly (RTLD_LOCAL, as ctypes does), gets cohort's Gloo
   group code bound to torch's Gloo in libtorch_cpu.so (it runs no op).

Run: bazel test //tests/interop:torch_backend2_gloo_test, or by hand
  PYTHONPATH=bazel-bin/worker/torch/torch2:tests/interop/torch \\
      .venv/bin/python tests/interop/torch/backend2_gloo_test.py
"""
import ctypes
import os
import subprocess
import sys
from datetime import timedelta

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import backend2_ranks  # noqa: E402
import backend_ranks  # noqa: E402
import harness  # noqa: E402

args = backend2_ranks.parse_args(
    __doc__, lambda p: p.add_argument("--control", action="store_true",
                                      help="print the control's binding"))
dist = backend2_ranks.import_backend()
import cohort_torch  # noqa: E402
import torch  # noqa: E402

CREATE_DEVICE = "_ZN4gloo9transport3tcp12CreateDeviceERKNS1_4attrE"
ENTRY_POINTS = {"cohort_create_gloo_group", "cohort_find_gloo_binding"}
N = 1 << 18  # floats per all_reduce: long enough for ops to overlap


class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def file_defining(handle, symbol):
    """The file that dlsym(handle, symbol) finds `symbol` in, or None."""
    try:
        address = ctypes.cast(handle[symbol], ctypes.c_void_p)
    except AttributeError:
        return None
    info = DlInfo()
    if not ctypes.CDLL(None).dladdr(address, ctypes.byref(info)):
        return None
    return os.path.basename(info.dli_fname.decode())


def dynamic_symbols(path, flag):
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True,
                         text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True,
                         text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines()
            if "(NEEDED)" in line]


def check_files(c):
    module = cohort_torch.__file__
    library = os.path.join(os.path.dirname(module), "libcohort_gloo.so")
    torch_cpu = os.path.join(os.path.dirname(torch.__file__), "lib",
                             "libtorch_cpu.so")
    print(f"module {module}\nlibrary {library}\ntorch {torch_cpu}", flush=True)
    c.ok(not any("gloo" in n for n in needed(module)),
         f"the module needs {needed(module)}: a Gloo among them")
    undefined = [s for s in dynamic_symbols(module, "--undefined-only")
                 if "4gloo" in s]
    c.ok(not undefined, f"the module binds gloo symbols: {undefined[:5]}")
    c.ok("libgloo.so.0" in needed(library),
         f"libcohort_gloo.so needs {needed(library)}, not libgloo.so.0")
    exported = set(dynamic_symbols(library, "--defined-only"))
    c.eq("what libcohort_gloo.so exports", exported, ENTRY_POINTS)
    torch_gloo = [s for s in dynamic_symbols(torch_cpu, "--defined-only")
                  if s.startswith("_ZN4gloo")]
    c.ok(CREATE_DEVICE in torch_gloo,
         "libtorch_cpu.so does not export gloo's CreateDevice (the premise)")
    print(f"libtorch_cpu.so exports {len(torch_gloo)} gloo:: symbols",
          flush=True)


def check_binding(c, rtld_global):
    """Where the name resolves from the module's scope and globally, and
    where cohort's group was bound."""
    from_module = file_defining(ctypes.CDLL(cohort_torch.__file__), CREATE_DEVICE)
    c.eq("gloo's CreateDevice looked up from the module's scope",
         from_module, "libtorch_cpu.so")
    from_global = file_defining(ctypes.CDLL(None), CREATE_DEVICE)
    c.eq("gloo's CreateDevice looked up globally", from_global,
         "libtorch_cpu.so" if rtld_global else None)
    binding = cohort_torch._gloo_binding()
    c.eq("the file holding cohort's Gloo group",
         os.path.basename(binding["group_library"]), "libcohort_gloo.so")
    c.eq("the Gloo cohort's group is bound to",
         os.path.basename(binding["gloo_library"]), "libgloo.so.0")


def ops(c, rank, world, group, what):
    """A few ops on `group`, each checked exactly."""
    t = torch.full((N,), float(rank + 1))
    dist.all_reduce(t, group=group)
    c.ok(torch.equal(t, torch.full((N,), float(world * (world + 1) // 2))),
         f"{what}: all_reduce")
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=world - 1, group=group)
    c.ok(torch.equal(b, torch.full((5,), float(world - 1))), f"{what}: broadcast")
    outs = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), rank, dtype=torch.int64), group=group)
    c.ok(all(torch.equal(o, torch.full((3,), r, dtype=torch.int64))
             for r, o in enumerate(outs)), f"{what}: all_gather")
    dist.barrier(group=group)


def at_once(c, rank, world, a, b, what):
    """Ops on groups a and b issued alternately, all in flight together."""
    total = float(world * (world + 1) // 2)
    pending = []
    for i in range(4):
        for name, group in (("a", a), ("b", b)):
            t = torch.full((N,), float((rank + 1) * (i + 1)))
            pending.append((f"{name} #{i}", t, total * (i + 1),
                            dist.all_reduce(t, group=group, async_op=True)))
    for label, t, want, work in pending:
        work.wait()
        c.ok(torch.equal(t, torch.full((N,), want)),
             f"{what}: all_reduce {label} got {t[:2].tolist()}, want {want}")
    ops(c, rank, world, a, f"{what}, first group")
    ops(c, rank, world, b, f"{what}, second group")


def rank_main(rank, world):
    rtld_global = bool(os.environ.get("TORCH_USE_RTLD_GLOBAL"))
    c = harness.Checks(f"rank {rank} of {world}"
                       + (" (TORCH_USE_RTLD_GLOBAL=1)" if rtld_global else ""))
    check_binding(c, rtld_global)
    store = dist.TCPStore(os.environ["MASTER_ADDR"],
                          int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=timedelta(seconds=60))
    timeout = timedelta(seconds=60)

    def init(backend, phase):
        dist.init_process_group(backend, store=dist.PrefixStore(phase, store),
                                rank=rank, world_size=world, timeout=timeout)
        c.eq(f"{phase}: the default group's backend", dist.get_backend(),
             backend)

    for i, backend in enumerate(("gloo", "cohort", "cohort", "gloo")):
        phase = f"one after the other #{i}"
        init(backend, phase)
        ops(c, rank, world, None, f"{phase} ({backend})")
        dist.destroy_process_group()
    for default, other in (("cohort", "gloo"), ("gloo", "cohort")):
        phase = f"at once, default {default}"
        init(default, phase)
        second = dist.new_group(backend=other, timeout=timeout)
        c.eq(f"{phase}: new_group's backend", dist.get_backend(second), other)
        at_once(c, rank, world, None, second, phase)
        dist.destroy_process_group()
    check_binding(c, rtld_global)
    c.finish()


def control():
    """Run with TORCH_USE_RTLD_GLOBAL=1 and --control: loads the library
    without RTLD_DEEPBIND before the module does, prints the binding."""
    library = os.path.join(os.path.dirname(cohort_torch.__file__),
                           "libcohort_gloo.so")
    ctypes.CDLL(library, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    print("binding:", os.path.basename(
        cohort_torch._gloo_binding()["gloo_library"]), flush=True)


def check_control(c):
    out = subprocess.run(
        [sys.executable, os.path.abspath(sys.argv[0]), "--control"],
        env=dict(os.environ, TORCH_USE_RTLD_GLOBAL="1"), capture_output=True,
        text=True, timeout=120)
    print(out.stdout + out.stderr, flush=True)
    c.ok("binding: libtorch_cpu.so" in out.stdout,
         "the control (library loaded without RTLD_DEEPBIND, torch global) "
         "did not bind cohort's Gloo code to torch's")


def parent():
    c = harness.Checks("backend2_gloo_test")
    c.section("the module, its library and torch's", check_files, c)
    c.section("control: without RTLD_DEEPBIND, torch's Gloo stands in",
              check_control, c)
    script = os.path.abspath(sys.argv[0])
    for rtld_global in (False, True):
        env = "TORCH_USE_RTLD_GLOBAL=1" if rtld_global else "default loading"
        print(f"== backend2_gloo_test: world 2, {env}", flush=True)
        if rtld_global:
            os.environ["TORCH_USE_RTLD_GLOBAL"] = "1"
        ranks = backend_ranks.launch(script, 2, name=f"gloo-{int(rtld_global)}")
        codes = backend_ranks.wait_all(ranks, 120)
        c.ok(all(code == 0 for code in codes.values()),
             f"the job with {env} failed: exit codes {codes}")
    c.finish()


if __name__ == "__main__":
    if args.control:
        control()
    elif args.rank >= 0:
        rank_main(args.rank, args.world)
    else:
        parent()
