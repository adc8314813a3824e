"""Builds the vmm_torch package against the torch installed in the running Python.

    pip install --no-build-isolation ./torch_plugin/python

- The LibTorch extension ``vmm_torch/_C.so`` is compiled from ``../csrc/vmm_ops.cpp`` with
  ``torch.utils.cpp_extension`` (C++ only; CUDA headers are added to the include path when
  found, no CUDA code is compiled). Where torch has CUDA (2.3 or later), the Python module
  ``vmm_torch/_cuda_allocator.so`` is compiled from ``../csrc/vmm_cuda_allocator.cpp``: vmm as
  a full CUDA allocator of PyTorch (statistics, snapshots, CUDA graph pools, MemPool). It
  follows PyTorch's internal allocator interface, so a torch where that differs fails to
  build it: the build says so and goes on, and vmm_torch falls back to
  CUDAPluggableAllocator (``VMM_NO_CUDA_ALLOCATOR=1`` skips it). It is linked against the very ``libstdc++`` shared object
  that torch's ``libc10.so`` loads: errors thrown in the extension are caught in torch, and
  both must use one C++ runtime. A compiler that links its runtime statically by default
  (``/opt/gcc/bin/g++`` on our GPU machine) otherwise gives an extension whose every thrown
  error kills the process (SIGSEGV) instead of raising RuntimeError in Python.
- ``vmm_torch_autoenable.pth`` and its module ``_vmm_torch_autoenable`` go to site-packages:
  with ``VMM_TORCH_ENABLE`` set, every Python process of the environment enables vmm when it
  imports torch (see that module); unset, they cost one environment lookup per interpreter.
- vmm's C library ``libvmm.so`` is copied into the package: from ``$VMM_LIB`` (a path to the
  file) or, when that is unset, from a Bazel build of
  ``//torch_plugin:python/vmm_torch/libvmm.so`` in this repository (extra Bazel arguments in
  ``$VMM_BAZEL_ARGS``, e.g. ``-c opt``). The Abseil shared libraries it links (``libabsl_*``)
  are copied beside it, from the folder of ``$VMM_LIB`` if they are there, else from where
  the dynamic loader finds them; libvmm.so looks for them in its own folder first.
"""

import os
import shlex
import shutil
import subprocess

import torch
from setuptools import setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension, library_paths

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LIBVMM_TARGET = "//torch_plugin:python/vmm_torch/libvmm.so"
BUNDLED_PREFIXES = ("libabsl_",)


def _bazel_libvmm():
    """Builds libvmm.so with Bazel and returns its path."""
    if not os.path.exists(os.path.join(REPO, "WORKSPACE")):
        raise RuntimeError("set VMM_LIB to the path of a built libvmm.so (no Bazel workspace "
                           f"at {REPO})")
    args = shlex.split(os.environ.get("VMM_BAZEL_ARGS", ""))
    subprocess.run(["bazel", "build", *args, LIBVMM_TARGET], cwd=REPO, check=True)
    bazel_bin = subprocess.run(["bazel", "info", *args, "bazel-bin"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout.strip()
    return os.path.join(bazel_bin, "torch_plugin", "python", "vmm_torch", "libvmm.so")


def libvmm_path():
    path = os.environ.get("VMM_LIB") or _bazel_libvmm()
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise RuntimeError(f"libvmm.so not found at {path} (VMM_LIB)")
    return path


def _ldd(path):
    """{library name: resolved path or None} for every library `path` loads."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if not arrow:
            continue
        target = rest.split(" (")[0].strip()
        found[name] = target if target and target != "not found" else None
    return found


def bundled_libraries(libvmm):
    """{file name: source path} of the shared libraries shipped beside libvmm.so."""
    beside = os.path.dirname(libvmm)
    result = {}
    for name, resolved in _ldd(libvmm).items():
        if not name.startswith(BUNDLED_PREFIXES):
            continue
        local = os.path.join(beside, name)
        source = local if os.path.exists(local) else resolved
        if source is None:
            raise RuntimeError(f"{name}, which libvmm.so needs, is neither beside {libvmm} "
                               f"nor found by the dynamic loader")
        result[name] = source
    return result


def _copy(source, destination):
    shutil.copyfile(source, destination)  # follows symbolic links
    os.chmod(destination, 0o755)


def torch_cxx_runtime():
    """The libstdc++ shared object torch's libc10.so loads (a path), or None when torch does
    not load one (then the compiler's default runtime is used)."""
    for folder in library_paths():
        libc10 = os.path.join(folder, "libc10.so")
        if os.path.exists(libc10):
            return _ldd(libc10).get("libstdc++.so.6")
    return None


class BuildExt(BuildExtension.with_options(no_python_abi_suffix=True)):
    """Builds _C.so (and _cuda_allocator.so where it can), then puts libvmm.so and its
    libraries beside them."""

    def build_extension(self, ext):
        if ext.name != OPTIONAL_EXTENSION:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as error:  # another torch's allocator interface: fall back
            print(f"warning: {ext.name} not built ({error}); vmm_torch will use "
                  f"CUDAPluggableAllocator without statistics, snapshots or graph pools")

    def run(self):
        super().run()
        libvmm = libvmm_path()
        files = {"libvmm.so": libvmm, **bundled_libraries(libvmm)}
        folders = [os.path.join(self.build_lib, "vmm_torch")]
        if self.inplace:
            folders.append(os.path.join(HERE, "vmm_torch"))
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
            for name, source in files.items():
                _copy(source, os.path.join(folder, name))


class BuildPy(build_py):
    """Also puts vmm_torch_autoenable.pth at the top of the build, so that it lands in
    site-packages, where Python runs it at every interpreter start (VMM_TORCH_ENABLE)."""

    def run(self):
        super().run()
        os.makedirs(self.build_lib, exist_ok=True)
        self.copy_file(os.path.join(HERE, PTH_FILE), os.path.join(self.build_lib, PTH_FILE))


PTH_FILE = "vmm_torch_autoenable.pth"


def _cuda_home():
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def _include_dirs():
    """The repository (for torch_plugin/vmm_c.h), and CUDA's headers when found."""
    include = os.path.join(_cuda_home(), "include")
    return [REPO] + ([include] if os.path.isdir(include) else [])


CXX_RUNTIME = torch_cxx_runtime()
OPTIONAL_EXTENSION = "vmm_torch._cuda_allocator"


def _torch_at_least(major, minor):
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def _extensions():
    """_C (always), and _cuda_allocator where torch has CUDA and the allocator interface it
    is written for (2.3 or later; VMM_NO_CUDA_ALLOCATOR=1 skips it)."""
    common = dict(include_dirs=_include_dirs(), extra_compile_args=["-O2", "-Wno-unused-parameter"],
                  extra_link_args=[CXX_RUNTIME] if CXX_RUNTIME else [])
    extensions = [CppExtension(
        name="vmm_torch._C", sources=[os.path.join(REPO, "torch_plugin", "csrc", "vmm_ops.cpp")],
        libraries=["dl"], **common)]
    if (torch.version.cuda is not None and _torch_at_least(2, 3)
            and os.environ.get("VMM_NO_CUDA_ALLOCATOR", "") != "1"):
        extensions.append(CppExtension(
            name=OPTIONAL_EXTENSION,
            sources=[os.path.join(REPO, "torch_plugin", "csrc", "vmm_cuda_allocator.cpp")],
            libraries=["dl", "c10_cuda", "torch_cuda", "cudart"],
            library_dirs=[os.path.join(_cuda_home(), "lib64")], **common))
    return extensions

setup(
    name="vmm-torch",
    version="0.1.0",
    description="CUDA virtual-memory caching allocator for PyTorch, with tensor sharing "
                "between processes as buffer descriptors",
    packages=["vmm_torch"],
    py_modules=["_vmm_torch_autoenable"],
    package_data={"vmm_torch": ["py.typed"]},
    python_requires=">=3.8",
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    entry_points={"console_scripts": ["vmm-stats = vmm_torch.stats:main"]},
    zip_safe=False,
)
