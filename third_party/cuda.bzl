# cuda_configure: finds the CUDA runtime and NCCL that the NCCL backend
# (worker/collective/nccl) builds against, the way the other system
# libraries are found: nothing is downloaded or vendored.
#
# The repository it creates (@cuda) always has:
#   defs.bzl    CUDA_FOUND (bool), CUDA_PATH (the toolkit looked at),
#               NVCC (its compiler, for the backend's kernels) and
#               CUDA_MISSING (why it was not used; "" when found)
#   //:cuda     headers (cuda_runtime.h, nccl.h) and the link flags for
#               libnccl and libcudart with an rpath to them, when found;
#               otherwise only cuda_missing.h, whose COHORT_NO_CUDA_REASON
#               says why (no_cuda_nccl_api.cc puts it in its error)
# BUILD files load defs.bzl and define their CUDA targets only when
# CUDA_FOUND, and a test that prints "SKIPPED: ..." in their place
# otherwise (see worker/collective/nccl/BUILD), so a machine without CUDA
# builds and tests everything else and says what it skipped.
#
# Where it looks: $COHORT_CUDA_PATH alone when that is set; else
# /usr/local/cuda, then the project venv (.venv, made by tools/setup.sh from
# tools/requirements.txt), whose NVIDIA wheels carry nvcc, the runtime and
# NCCL under site-packages/nvidia/{cu13,nccl}. A toolkit directory is used
# when bin/nvcc, include/cuda_runtime.h, include/nccl.h and lib64's
# libcudart and libnccl (plain .so or versioned .so.N) all exist (nccl.h may
# instead sit in /usr/include and libnccl in /usr/lib/x86_64-linux-gnu, as
# Debian's libnccl-dev puts them). Bazel re-runs the rule when
# COHORT_CUDA_PATH or tools/requirements.txt changes; after installing or
# removing CUDA otherwise, `bazel sync --configure` re-detects it.

_DEFAULT_PATH = "/usr/local/cuda"

def _first_existing(ctx, candidates):
    for c in candidates:
        if ctx.path(c).exists:
            return c
    return None

def _shared_lib(ctx, lib_dir, name):
    """lib_dir/libNAME.so, else its one versioned file (libNAME.so.N), as
    (path, the -l flag that links it); None when there is neither."""
    plain = "%s/lib%s.so" % (lib_dir, name)
    if ctx.path(plain).exists:
        return (plain, "-l" + name)
    if not ctx.path(lib_dir).exists:
        return None
    prefix = "lib%s.so." % name
    for entry in sorted([e.basename for e in ctx.path(lib_dir).readdir()]):
        rest = entry[len(prefix):] if entry.startswith(prefix) else ""
        if rest and rest.isdigit():
            return ("%s/%s" % (lib_dir, entry), "-l:" + entry)
    return None

def _toolkit_layout(ctx, root):
    """A toolkit installed as NVIDIA ships it: ROOT/{bin,include,lib64}, with
    NCCL beside it or where Debian's libnccl-dev puts it."""
    return struct(
        where = root,
        nvcc = root + "/bin/nvcc",
        runtime_h = root + "/include/cuda_runtime.h",
        nccl_h = _first_existing(ctx, [root + "/include/nccl.h", "/usr/include/nccl.h"]) or
                 root + "/include/nccl.h",
        cudart = _shared_lib(ctx, root + "/lib64", "cudart"),
        cudart_want = root + "/lib64/libcudart.so",
        nccl = _shared_lib(ctx, root + "/lib64", "nccl") or
               _shared_lib(ctx, "/usr/lib/x86_64-linux-gnu", "nccl"),
        nccl_want = root + "/lib64/libnccl.so",
    )

def _wheel_layout(ctx, site):
    """The toolkit from NVIDIA's PyPI wheels in a venv's site-packages
    (tools/requirements.txt): nvidia/cu13/{bin,include,lib} from
    cuda-toolkit 13's nvcc, crt, nvvm, cccl and cudart wheels, and
    nvidia/nccl/{include,lib} from nvidia-nccl-cu13. The wheels carry only
    versioned libraries (libcudart.so.13, libnccl.so.2)."""
    cu = site + "/nvidia/cu13"
    return struct(
        where = site + "/nvidia",
        nvcc = cu + "/bin/nvcc",
        runtime_h = cu + "/include/cuda_runtime.h",
        nccl_h = site + "/nvidia/nccl/include/nccl.h",
        cudart = _shared_lib(ctx, cu + "/lib", "cudart"),
        cudart_want = cu + "/lib/libcudart.so.N",
        nccl = _shared_lib(ctx, site + "/nvidia/nccl/lib", "nccl"),
        nccl_want = site + "/nvidia/nccl/lib/libnccl.so.N",
    )

def _missing(ctx, layout):
    missing = []
    for f in [layout.nvcc, layout.runtime_h, layout.nccl_h]:
        if not ctx.path(f).exists:
            missing.append(f)
    if not layout.cudart:
        missing.append(layout.cudart_want)
    if not layout.nccl:
        missing.append(layout.nccl_want)
    return missing

def _venv_site_packages(ctx):
    """The project venv's site-packages (.venv/lib/pythonX.Y/site-packages
    in the workspace), or None."""
    # Naming requirements.txt makes Bazel re-run this rule when it changes.
    ctx.path(Label("//tools:requirements.txt"))
    lib = ctx.path(Label("//:WORKSPACE")).dirname.get_child(".venv").get_child("lib")
    if not lib.exists:
        return None
    for entry in sorted([e.basename for e in lib.readdir()]):
        site = lib.get_child(entry).get_child("site-packages")
        if entry.startswith("python") and site.exists:
            return str(site)
    return None

def _cuda_configure_impl(ctx):
    # Where to look, in order: $COHORT_CUDA_PATH alone when it is set; else
    # /usr/local/cuda, then the wheels in the project venv.
    explicit = ctx.os.environ.get("COHORT_CUDA_PATH", "").rstrip("/")
    root = explicit or _DEFAULT_PATH
    layouts = [_toolkit_layout(ctx, root)]
    if not explicit:
        site = _venv_site_packages(ctx)
        if site:
            layouts.append(_wheel_layout(ctx, site))
    found = None
    reasons = []
    for layout in layouts:
        missing = _missing(ctx, layout)
        if not missing:
            found = layout
            break
        reasons.append("no CUDA toolkit at %s (missing %s)" % (layout.where, ", ".join(missing)))
    if not found and not explicit and len(layouts) == 1:
        reasons.append("no project venv with CUDA wheels (tools/setup.sh makes .venv)")

    if not found:
        why = "; ".join(reasons)
        ctx.file("defs.bzl", "\n".join([
            "CUDA_FOUND = False",
            "CUDA_PATH = %r" % root,
            "NVCC = \"\"",
            "CUDA_MISSING = %r" % why,
            "",
        ]))
        ctx.file("cuda_missing.h", "\n".join([
            "// Generated by third_party/cuda.bzl: why the build has no CUDA.",
            "#define COHORT_NO_CUDA_REASON \"%s\"" %
            why.replace("\\", "\\\\").replace("\"", "\\\""),
            "",
        ]))
        ctx.file("BUILD", "\n".join([
            "# " + why + ": nothing to build against but the reason.",
            "cc_library(",
            "    name = \"cuda\",",
            "    hdrs = [\"cuda_missing.h\"],",
            "    includes = [\".\"],",
            "    visibility = [\"//visibility:public\"],",
            ")",
            "",
        ]))
        return

    root = found.where
    runtime_h = found.runtime_h
    nccl_h = found.nccl_h
    nvcc = found.nvcc
    # The headers Bazel may see: the toolkit's top-level headers and crt/
    # (all that cuda_runtime.h needs in host code), and nccl.h beside them
    # when it lives elsewhere.
    ctx.symlink(runtime_h.rsplit("/", 1)[0], "include")
    extra_hdrs = []
    if nccl_h.rsplit("/", 1)[0] != runtime_h.rsplit("/", 1)[0]:
        ctx.symlink(nccl_h, "nccl_include/nccl.h")
        extra_hdrs.append("nccl_include/nccl.h")
    lib_dirs = []
    for lib, _ in [found.cudart, found.nccl]:
        d = lib.rsplit("/", 1)[0]
        if d not in lib_dirs:
            lib_dirs.append(d)
    linkopts = []
    for d in lib_dirs:
        linkopts += ["-L" + d, "-Wl,-rpath," + d]
    linkopts += [found.nccl[1], found.cudart[1]]

    ctx.file("defs.bzl", "\n".join([
        "CUDA_FOUND = True",
        "CUDA_PATH = %r" % root,
        "NVCC = %r" % nvcc,
        "CUDA_MISSING = \"\"",
        "",
    ]))
    ctx.file("BUILD", "\n".join([
        "# The CUDA runtime and NCCL of %s (third_party/cuda.bzl)." % root,
        "cc_library(",
        "    name = \"cuda\",",
        "    hdrs = glob([\"include/*.h\", \"include/*.hpp\", \"include/crt/**\"]) + %r," % extra_hdrs,
        "    includes = [\"include\"%s]," % (", \"nccl_include\"" if extra_hdrs else ""),
        "    linkopts = %r," % linkopts,
        "    visibility = [\"//visibility:public\"],",
        ")",
        "",
    ]))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["COHORT_CUDA_PATH"],
    local = True,
)
