"""A program's own CUDA allocator for the drop-in programs that put a torch.cuda.MemPool over
one: a small shared library compiled at first use (cuMemAlloc / cuMemFree through libcuda,
with counters and a byte limit past which it returns null), and its CUDAPluggableAllocator."""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import torch

SOURCE = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
extern "C" {
typedef int (*cu_alloc_t)(unsigned long long*, size_t);
typedef int (*cu_free_t)(unsigned long long);
static cu_alloc_t cu_alloc;
static cu_free_t cu_free;
long long n_alloc = 0, n_free = 0, live_bytes = 0, limit_bytes = 0;
static void init() {
  if (cu_alloc) return;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  cu_alloc = (cu_alloc_t)dlsym(lib, "cuMemAlloc_v2");
  cu_free = (cu_free_t)dlsym(lib, "cuMemFree_v2");
}
void* counted_alloc(size_t size, int device, void* stream) {
  init();
  if (limit_bytes > 0 && live_bytes + (long long)size > limit_bytes) return 0;
  unsigned long long p = 0;
  if (cu_alloc(&p, size) != 0) return 0;
  __atomic_add_fetch(&n_alloc, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&live_bytes, (long long)size, __ATOMIC_SEQ_CST);
  return (void*)p;
}
void counted_free(void* ptr, size_t size, int device, void* stream) {
  init();
  cu_free((unsigned long long)ptr);
  __atomic_add_fetch(&n_free, 1, __ATOMIC_SEQ_CST);
  __atomic_sub_fetch(&live_bytes, (long long)size, __ATOMIC_SEQ_CST);
}
}
"""


def _build(folder):
    src = os.path.join(folder, "counted_alloc.cpp")
    out = os.path.join(folder, "counted_alloc.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    compiler = next((c for c in ("/opt/gcc/bin/g++", shutil.which("g++") or "",
                                 shutil.which("c++") or "") if c and os.path.exists(c)), None)
    if compiler is None:
        print("no C++ compiler", file=sys.stderr)
        sys.exit(2)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", out, src, "-ldl"], check=True)
    return out



class CountedAllocator:
    """The library, its CUDAPluggableAllocator (`pluggable`) and its counters: n_alloc, n_free,
    live_bytes, and limit_bytes (settable; 0: no limit)."""

    def __init__(self):
        self.folder = tempfile.mkdtemp()
        path = _build(self.folder)
        self.pluggable = torch.cuda.memory.CUDAPluggableAllocator(path, "counted_alloc",
                                                                  "counted_free")
        self.lib = ctypes.CDLL(path)  # the same loaded library: its counters

    def __getattr__(self, name):
        if name in ("n_alloc", "n_free", "live_bytes", "limit_bytes"):
            return ctypes.c_longlong.in_dll(self.lib, name).value
        raise AttributeError(name)

    def set_limit(self, limit_bytes):
        ctypes.c_longlong.in_dll(self.lib, "limit_bytes").value = limit_bytes

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)
