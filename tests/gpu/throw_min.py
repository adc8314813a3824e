#!/usr/bin/env python3
"""Does a TORCH_CHECK error thrown inside any C++ op reach Python on this machine? (GPU)

Builds a one-op extension with torch.utils.cpp_extension.load_inline (no vmm at all), calls
the op in a child process (so that a crash is observed, not suffered) and prints the child's
exit status: 0 when RuntimeError reached Python, -11 for SIGSEGV.
"""
import subprocess
import sys

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor boom(const at::Tensor& t) {
  TORCH_CHECK(t.numel() < 0, "boom: ", t.numel());
  return t;
}
TORCH_LIBRARY(vmm_throw_min, m) { m.def("boom(Tensor t) -> Tensor", &boom); }
"""


def child(path):
    import torch

    torch.ops.load_library(path)
    try:
        torch.ops.vmm_throw_min.boom(torch.zeros(2))
    except RuntimeError as e:
        print(f"raised cleanly: {str(e).splitlines()[0]}")
        return 0
    return 1


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    from torch.utils.cpp_extension import load_inline

    path = load_inline("vmm_throw_min", cpp_sources=[SOURCE], is_python_module=False,
                       build_directory=None, verbose=False)
    print(f"built {path}")
    print(subprocess.run(["sh", "-c", f"ldd {path} | grep -E 'gcc|stdc'; nm -D --defined-only "
                          f"{path} | grep -E '_Unwind|__gxx|__cxa'"],
                         capture_output=True, text=True).stdout)
    rc = subprocess.run([sys.executable, __file__, "--child", path]).returncode
    print(f"child exit status {rc}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
