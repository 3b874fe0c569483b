# cuda_configure: finds the CUDA runtime and NCCL that the NCCL backend
# (worker/collective/nccl) builds against, the way the other system
# libraries are found: nothing is downloaded or vendored.
#
# The repository it creates (@cuda) always has:
#   defs.bzl    CUDA_FOUND (bool), CUDA_PATH (the toolkit looked at) and
#               CUDA_MISSING (why it was not used; "" when found)
#   //:cuda     headers (cuda_runtime.h, nccl.h) and the link flags for
#               libnccl and libcudart with an rpath to them, when found;
#               an empty library otherwise (never depend on it then)
# BUILD files load defs.bzl and define their CUDA targets only when
# CUDA_FOUND, and a test that prints "SKIPPED: ..." in their place
# otherwise (see worker/collective/nccl/BUILD), so a machine without CUDA
# builds and tests everything else and says what it skipped.
#
# The toolkit is $COHORT_CUDA_PATH, else /usr/local/cuda. It is used when
# include/cuda_runtime.h, include/nccl.h, lib64/libcudart.so and
# lib64/libnccl.so all exist (nccl.h may instead sit in /usr/include and
# libnccl.so in /usr/lib/x86_64-linux-gnu, as Debian's libnccl-dev puts
# them). Bazel re-runs the rule when COHORT_CUDA_PATH changes; after
# installing or removing CUDA, `bazel sync --configure` re-detects it.

_DEFAULT_PATH = "/usr/local/cuda"

def _first_existing(ctx, candidates):
    for c in candidates:
        if ctx.path(c).exists:
            return c
    return None

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("COHORT_CUDA_PATH", _DEFAULT_PATH).rstrip("/")
    runtime_h = _first_existing(ctx, [root + "/include/cuda_runtime.h"])
    nccl_h = _first_existing(ctx, [
        root + "/include/nccl.h",
        "/usr/include/nccl.h",
    ])
    cudart = _first_existing(ctx, [root + "/lib64/libcudart.so"])
    nccl = _first_existing(ctx, [
        root + "/lib64/libnccl.so",
        "/usr/lib/x86_64-linux-gnu/libnccl.so",
    ])
    missing = []
    if not runtime_h:
        missing.append(root + "/include/cuda_runtime.h")
    if not nccl_h:
        missing.append(root + "/include/nccl.h")
    if not cudart:
        missing.append(root + "/lib64/libcudart.so")
    if not nccl:
        missing.append(root + "/lib64/libnccl.so")

    if missing:
        why = "no CUDA toolkit at %s (missing %s)" % (root, ", ".join(missing))
        ctx.file("defs.bzl", "\n".join([
            "CUDA_FOUND = False",
            "CUDA_PATH = %r" % root,
            "CUDA_MISSING = %r" % why,
            "",
        ]))
        ctx.file("BUILD", "\n".join([
            "# " + why + ": nothing to build against.",
            "cc_library(",
            "    name = \"cuda\",",
            "    visibility = [\"//visibility:public\"],",
            ")",
            "",
        ]))
        return

    # The headers Bazel may see: the toolkit's top-level headers and crt/
    # (all that cuda_runtime.h needs in host code), and nccl.h beside them
    # when it lives elsewhere.
    ctx.symlink(runtime_h.rsplit("/", 1)[0], "include")
    extra_hdrs = []
    if nccl_h.rsplit("/", 1)[0] != runtime_h.rsplit("/", 1)[0]:
        ctx.symlink(nccl_h, "nccl_include/nccl.h")
        extra_hdrs.append("nccl_include/nccl.h")
    lib_dirs = []
    for lib in [cudart, nccl]:
        d = lib.rsplit("/", 1)[0]
        if d not in lib_dirs:
            lib_dirs.append(d)
    linkopts = []
    for d in lib_dirs:
        linkopts += ["-L" + d, "-Wl,-rpath," + d]
    linkopts += ["-lnccl", "-lcudart"]

    ctx.file("defs.bzl", "\n".join([
        "CUDA_FOUND = True",
        "CUDA_PATH = %r" % root,
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
