"""Repository rules that find vmm's dependencies on the machine; nothing is downloaded.

- @local_cuda:   CUDA toolkit headers ($CUDA_PATH, else /usr/local/cuda). Headers only:
                 libcuda is opened at run time, so vmm builds and runs where no driver exists.
- @system_libs:  Abseil, GoogleTest, Google Benchmark and nlohmann/json from Debian packages.
- @local_torch:  LibTorch from the user's Python (the first python3 on PATH, or $VMM_PYTHON,
                 whose `import torch` works), else Debian's libtorch-dev.
- @local_python: a Python toolchain for py_test/py_binary using that same interpreter.
"""

def _cuda_impl(rctx):
    root = rctx.os.environ.get("CUDA_PATH", "") or "/usr/local/cuda"
    if rctx.path(root + "/include/cuda.h").exists:
        rctx.symlink(root + "/include", "include")
        hdrs = 'glob(["include/*.h"])'
        found = "True"
    else:
        rctx.file("include/cuda_missing.h", "#error \"CUDA toolkit headers not found: set CUDA_PATH\"\n")
        hdrs = '["include/cuda_missing.h"]'
        found = "False"
    rctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

# CUDA driver API headers (cuda.h, cudaTypedefs.h). No library: libcuda.so.1 is dlopen'ed.
cc_library(
    name = "cuda_headers",
    hdrs = {hdrs},
    includes = ["include"],
)

# The CUDA runtime, for benchmarks that compare against cudaMallocAsync.
cc_library(
    name = "cudart",
    deps = [":cuda_headers"],
    linkopts = ["-L{root}/lib64", "-Wl,-rpath,{root}/lib64", "-lcudart"],
)
""".format(hdrs = hdrs, root = root))
    rctx.file("defs.bzl", "CUDA_FOUND = %s\nCUDA_ROOT = %r\n" % (found, root))

local_cuda = repository_rule(
    implementation = _cuda_impl,
    environ = ["CUDA_PATH"],
    local = True,
)

def _find_python_with_torch(rctx):
    """Returns (python, torch_dir) for the first interpreter whose `import torch` works."""
    candidates = []
    if rctx.os.environ.get("VMM_PYTHON"):
        candidates.append(rctx.os.environ["VMM_PYTHON"])
    for name in ["python3"]:
        p = rctx.which(name)
        if p:
            candidates.append(str(p))
    candidates.append("/usr/bin/python3")
    for py in candidates:
        res = rctx.execute([py, "-c", "import os, torch; print(os.path.dirname(torch.__file__))"], timeout = 120)
        if res.return_code == 0 and res.stdout.strip():
            return py, res.stdout.strip().splitlines()[-1]
    return (candidates[0] if candidates else "/usr/bin/python3"), None

def _torch_impl(rctx):
    py, torch_dir = _find_python_with_torch(rctx)
    includes = []
    libdir = None
    if torch_dir and rctx.path(torch_dir + "/include/torch/extension.h").exists:
        rctx.symlink(torch_dir + "/include", "include")
        includes = ["include", "include/torch/csrc/api/include"]
        libdir = torch_dir + "/lib"
        if not rctx.path(libdir + "/libtorch.so").exists:
            libdir = "/usr/lib/x86_64-linux-gnu"  # Debian's python3-torch links the system LibTorch
    elif rctx.path("/usr/include/torch/extension.h").exists:
        rctx.symlink("/usr/include/torch", "include/torch")
        rctx.symlink("/usr/include/ATen", "include/ATen")
        rctx.symlink("/usr/include/c10", "include/c10")
        rctx.symlink("/usr/include/caffe2", "include/caffe2")
        includes = ["include", "include/torch/csrc/api/include"]
        libdir = "/usr/lib/x86_64-linux-gnu"
    if libdir:
        # Debian's python3-torch keeps its headers under /usr/include; follow its symlinks.
        body = """
cc_library(
    name = "libtorch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"], allow_empty = True),
    includes = {includes},
    linkopts = ["-L{libdir}", "-Wl,-rpath,{libdir}", "-ltorch", "-ltorch_cpu", "-lc10"],
)
""".format(includes = includes, libdir = libdir)
        found = "True"
    else:
        rctx.file("include/torch_missing.h", "#error \"LibTorch not found: install python3-torch/libtorch-dev or set VMM_PYTHON\"\n")
        body = """
cc_library(
    name = "libtorch",
    hdrs = ["include/torch_missing.h"],
)
"""
        found = "False"
    rctx.file("BUILD.bazel", 'package(default_visibility = ["//visibility:public"])\n' + body)
    rctx.file("defs.bzl", "TORCH_FOUND = %s\nPYTHON = %r\nTORCH_DIR = %r\n" % (found, py, torch_dir or ""))

local_torch = repository_rule(
    implementation = _torch_impl,
    environ = ["VMM_PYTHON", "PATH"],
    local = True,
)

def _python_impl(rctx):
    py, _ = _find_python_with_torch(rctx)
    rctx.file("BUILD.bazel", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

# The interpreter that has torch (or python3): py_test and py_binary run with it.
py_runtime(
    name = "py3_runtime",
    interpreter_path = "{py}",
    python_version = "PY3",
    # The launcher stub runs with it too (Bazel's default, "python", may not exist).
    stub_shebang = "#!{py}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(py = py))

local_python = repository_rule(
    implementation = _python_impl,
    environ = ["VMM_PYTHON", "PATH"],
    local = True,
)

def vmm_local_deps():
    local_cuda(name = "local_cuda")
    local_torch(name = "local_torch")
    local_python(name = "local_python")
    native.new_local_repository(
        name = "system_libs",
        path = "/usr",
        build_file = "//third_party:system_libs.BUILD",
    )
