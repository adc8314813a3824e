#!/usr/bin/env python3
"""Does a TORCH_CHECK error thrown inside a C++ op reach Python on this machine? (GPU)

Builds a one-op extension with torch.utils.cpp_extension.load_inline (no vmm at all) in a few
toolchain variants, calls the op in a child process each time (so that a crash is observed,
not suffered) and prints, per variant, whether the extension carries its own copy of the C++
exception runtime and the child's exit status: 0 when RuntimeError reached Python, -11 for
SIGSEGV. Variants: the default compiler (`c++` on PATH), /usr/bin/g++, the default with an
explicit -lstdc++ (linked before the compiler driver's own runtime libraries), the default
linked against the very libstdc++.so.6 that torch loaded in this process (so that the extension
and torch share one C++ runtime), the error raised from frames without cleanups, and an
OutOfMemoryError thrown by the extension itself.
"""
import os
import shutil
import subprocess
import sys

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor boom(const at::Tensor& t) {
  TORCH_CHECK(t.numel() < 0, "boom: ", t.numel());
  return t;
}
TORCH_LIBRARY(NAME, m) { m.def("boom(Tensor t) -> Tensor", &boom); }
"""

# The same error raised from frames that need no unwinding work of their own: the message is
# formatted into a buffer (no destructors), and libc10 throws. If this one raises cleanly where
# SOURCE crashes, the extension's own copy of the C++ runtime fails when asked to unwind its
# frames, and vmm's hooks can avoid it this way.
SOURCE_NO_CLEANUP = r"""
#include <cstdio>
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor boom(const at::Tensor& t) {
  if (t.numel() >= 0) {
    static thread_local char message[64];
    std::snprintf(message, sizeof(message), "boom: %lld", static_cast<long long>(t.numel()));
    ::c10::detail::torchCheckFail(__func__, __FILE__, __LINE__, message);
  }
  return t;
}
TORCH_LIBRARY(NAME, m) { m.def("boom(Tensor t) -> Tensor", &boom); }
"""

# An OutOfMemoryError thrown by the extension itself (what an allocator hook must raise).
SOURCE_OOM = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor boom(const at::Tensor& t) {
  if (t.numel() >= 0) C10_THROW_ERROR(OutOfMemoryError, "boom: out of memory");
  return t;
}
TORCH_LIBRARY(NAME, m) { m.def("boom(Tensor t) -> Tensor", &boom); }
"""


def child(path, name):
    import torch

    torch.ops.load_library(path)
    try:
        getattr(torch.ops, name).boom(torch.zeros(2))
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one too
        print(f"raised cleanly: {str(e).splitlines()[0]}")
        return 0
    return 1


def variant(name, cxx=None, ldflags=(), source=SOURCE):
    from torch.utils.cpp_extension import load_inline

    saved = os.environ.get("CXX")
    if cxx:
        os.environ["CXX"] = cxx
    try:
        path = load_inline(name, cpp_sources=[source.replace("NAME", name)],
                           is_python_module=False, extra_ldflags=list(ldflags))
    finally:
        if saved is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = saved
    if path is None:  # older torch loads the library and returns nothing
        from torch.utils.cpp_extension import _get_build_directory

        path = os.path.join(_get_build_directory(name, False), name + ".so")
    own_runtime = subprocess.run(
        ["sh", "-c", f"nm -D --defined-only {path} | grep -c __cxa_throw"],
        capture_output=True, text=True).stdout.strip()
    loads_libstdcxx = "libstdc++" in subprocess.run(["ldd", path], capture_output=True,
                                                    text=True).stdout
    rc = subprocess.run([sys.executable, __file__, "--child", path, name]).returncode
    print(f"{name}: compiler {cxx or os.environ.get('CXX', 'c++')} "
          f"({shutil.which(cxx or 'c++')}), extra ldflags {list(ldflags)}, defines __cxa_throw: "
          f"{own_runtime}, loads libstdc++: {loads_libstdcxx}, child exit status {rc}",
          flush=True)
    return rc


def loaded_libstdcxx():
    """The path of the libstdc++ shared object this process (with torch imported) uses."""
    import torch  # noqa: F401  (loads torch's C++ runtime)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libstdc++.so" in path:
                return path
    return None


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3])
    results = [variant("vmm_throw_default")]
    if os.path.exists("/usr/bin/g++"):
        results.append(variant("vmm_throw_usr_gxx", cxx="/usr/bin/g++"))
    results.append(variant("vmm_throw_lstdcxx", ldflags=["-lstdc++"]))
    runtime = loaded_libstdcxx()
    print(f"libstdc++ loaded with torch: {runtime}", flush=True)
    if runtime:
        results.append(variant("vmm_throw_torch_runtime", ldflags=[runtime]))
        results.append(variant("vmm_throw_torch_runtime_oom", ldflags=[runtime],
                               source=SOURCE_OOM))
    results.append(variant("vmm_throw_no_cleanup", source=SOURCE_NO_CLEANUP))
    results.append(variant("vmm_throw_oom", source=SOURCE_OOM))
    return 0 if results[0] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
