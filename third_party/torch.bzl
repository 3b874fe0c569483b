# torch_configure: finds the PyTorch 2.x of the project venv (.venv, made by
# tools/setup.sh from tools/requirements.txt) for the torch.distributed
# backend that worker/torch builds against it. Nothing is downloaded: the
# wheel's own headers (with the pybind11 torch was built with) and libraries
# are used where pip put them. (Debian's libtorch 1.13 is //third_party:libtorch.)
#
# The repository it creates (@venv_torch) always has:
#   defs.bzl    TORCH_FOUND (bool), TORCH_VERSION ("2.11.0+cu130"), TORCH_LIB
#               (the folder of libtorch_cpu.so) and TORCH_MISSING (why it was
#               not used; "" when found)
#   //:torch    when found: the headers (include/, include/torch/csrc/api/
#               include/ and torch's pybind11), the C++ ABI torch was built
#               with (_GLIBCXX_USE_CXX11_ABI, asked of torch itself) and the
#               link flags for libtorch_cpu and libc10 with an rpath to them
#   //:torch_python  the same plus libtorch_python and Python's headers, for
#               extension modules
# BUILD files load defs.bzl and define their torch 2.x targets only when
# TORCH_FOUND (worker/torch/BUILD); the tests that need them fail, naming
# TORCH_MISSING, where it is not.
#
# The venv's python is asked for torch's version and ABI (a few seconds to
# import torch). Bazel re-runs the rule when tools/requirements.txt changes;
# after remaking the venv otherwise, `bazel sync --configure` re-detects it.

# Headers an extension of torch 2.x includes, from the wheel's include/.
_HEADERS = ["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"]

# What an extension needs of the wheel, relative to site-packages/torch.
_NEEDED = [
    "include/torch/csrc/distributed/c10d/Backend.hpp",
    "include/pybind11/pybind11.h",
    "lib/libtorch_cpu.so",
    "lib/libc10.so",
    "lib/libtorch_python.so",
]

def _venv(ctx):
    """(site-packages, python) of the project venv, or None."""
    # Naming requirements.txt makes Bazel re-run this rule when it changes.
    ctx.path(Label("//tools:requirements.txt"))
    venv = ctx.path(Label("//:WORKSPACE")).dirname.get_child(".venv")
    lib = venv.get_child("lib")
    python = venv.get_child("bin").get_child("python")
    if not lib.exists or not python.exists:
        return None
    for entry in sorted([e.basename for e in lib.readdir()]):
        site = lib.get_child(entry).get_child("site-packages")
        if entry.startswith("python") and site.exists:
            return (str(site), str(python))
    return None

def _ask_torch(ctx, python):
    """torch.__version__ and its C++ ABI (0 or 1) as (version, abi, error)."""
    result = ctx.execute(
        [python, "-c", "\n".join([
            "import torch",
            "print(torch.__version__)",
            "print(int(torch._C._GLIBCXX_USE_CXX11_ABI))",
        ])],
        timeout = 300,
        quiet = True,
    )
    lines = result.stdout.strip().split("\n")
    if result.return_code != 0 or len(lines) != 2 or lines[1] not in ["0", "1"]:
        tail = (result.stderr.strip().split("\n") or [""])[-1]
        return (None, None, "%s cannot tell torch's version and ABI (%s)" % (python, tail))
    return (lines[0], lines[1], None)

def _missing(ctx, why):
    ctx.file("defs.bzl", "\n".join([
        "TORCH_FOUND = False",
        "TORCH_VERSION = \"\"",
        "TORCH_LIB = \"\"",
        "TORCH_MISSING = %r" % why,
        "",
    ]))
    ctx.file("BUILD", "# %s: nothing to build against.\n" % why)

def _torch_configure_impl(ctx):
    venv = _venv(ctx)
    if not venv:
        _missing(ctx, "no project venv (.venv with bin/python and lib/pythonX.Y/site-packages; tools/setup.sh makes it)")
        return
    site, python = venv
    torch = site + "/torch"
    missing = [torch + "/" + f for f in _NEEDED if not ctx.path(torch + "/" + f).exists]
    if missing:
        _missing(ctx, "no PyTorch 2.x in the venv at %s (missing %s)" % (torch, ", ".join(missing)))
        return
    version, abi, error = _ask_torch(ctx, python)
    if error:
        _missing(ctx, error)
        return

    lib = torch + "/lib"
    ctx.symlink(torch + "/include", "include")
    ctx.file("defs.bzl", "\n".join([
        "TORCH_FOUND = True",
        "TORCH_VERSION = %r" % version,
        "TORCH_LIB = %r" % lib,
        "TORCH_MISSING = \"\"",
        "",
    ]))
    ctx.file("BUILD", "\n".join([
        "# PyTorch %s from %s (third_party/torch.bzl)." % (version, torch),
        "package(default_visibility = [\"//visibility:public\"])",
        "",
        "cc_library(",
        "    name = \"torch\",",
        "    hdrs = glob(%r)," % _HEADERS,
        "    defines = [\"_GLIBCXX_USE_CXX11_ABI=%s\"]," % abi,
        "    includes = [\"include\", \"include/torch/csrc/api/include\"],",
        "    linkopts = %r," % ["-L" + lib, "-Wl,-rpath," + lib, "-ltorch_cpu", "-lc10"],
        ")",
        "",
        "cc_library(",
        "    name = \"torch_python\",",
        "    linkopts = [\"-ltorch_python\"],",
        "    deps = [\":torch\", \"@python_headers\"],",
        ")",
        "",
    ]))

torch_configure = repository_rule(
    implementation = _torch_configure_impl,
    local = True,
)
