"""A program that brings its own CUDA allocator for all of its memory:
torch.cuda.memory.change_current_allocator(CUDAPluggableAllocator(...)) before CUDA is used, as
PyTorch's documentation ("Using custom memory allocators for CUDA") shows. The allocator: a
small library built with counted_allocator.py's build step (cuMemAlloc / cuMemFree through
libcuda, binding the primary context in threads that have none, with counters).

With PyTorch's allocator the swap is accepted while CUDA is not initialised (the current
allocator is not initialized() yet); from then on every CUDA tensor (factories, model.cuda(),
autograd's and the optimizer's buffers) and every caching_allocator_alloc comes from the
program's allocator and each free goes back to it: live bytes grow by a tensor's size, a drop
calls the free function, three SGD steps of a small MLP train it, a raw block is one more call,
and dropping the model and optimizer gives memory back.

Why vmm may differ: VMM_TORCH_ENABLE made vmm's allocator current when torch was imported (and
registered it with c10 for CUDA, installed its reducers and hooks); the swap must still be
accepted, and nothing vmm installed may route an allocation or a free to vmm instead.
"""

import ctypes
import gc
import tempfile

import counted_allocator
import torch
from dropin_report import report

SOURCE = r"""
#include <dlfcn.h>
#include <stddef.h>
extern "C" {
static int (*ctx_get)(void**), (*ctx_set)(void*), (*dev_get)(int*, int);
static int (*retain)(void**, int), (*cu_free)(unsigned long long);
static int (*cu_alloc)(unsigned long long*, size_t);
long long n_alloc = 0, n_free = 0, live_bytes = 0;
static void load() {
  if (cu_alloc) return;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  ((int (*)(unsigned))dlsym(lib, "cuInit"))(0);
  ctx_get = (int (*)(void**))dlsym(lib, "cuCtxGetCurrent");
  ctx_set = (int (*)(void*))dlsym(lib, "cuCtxSetCurrent");
  dev_get = (int (*)(int*, int))dlsym(lib, "cuDeviceGet");
  retain = (int (*)(void**, int))dlsym(lib, "cuDevicePrimaryCtxRetain");
  cu_free = (int (*)(unsigned long long))dlsym(lib, "cuMemFree_v2");
  cu_alloc = (int (*)(unsigned long long*, size_t))dlsym(lib, "cuMemAlloc_v2");
}
static void bind(int device) {  // threads without a current context get the primary one
  void* ctx = 0; int dev = 0;
  if (ctx_get(&ctx) == 0 && ctx) return;
  if (dev_get(&dev, device) == 0 && retain(&ctx, dev) == 0) ctx_set(ctx);
}
void* user_alloc(size_t size, int device, void* stream) {
  load(); bind(device);
  unsigned long long p = 0;
  if (size == 0 || cu_alloc(&p, size) != 0) return 0;
  __atomic_add_fetch(&n_alloc, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&live_bytes, (long long)size, __ATOMIC_SEQ_CST);
  return (void*)p;
}
void user_free(void* ptr, size_t size, int device, void* stream) {
  load(); bind(device);
  if (ptr) cu_free((unsigned long long)ptr);
  __atomic_add_fetch(&n_free, 1, __ATOMIC_SEQ_CST);
  __atomic_sub_fetch(&live_bytes, (long long)size, __ATOMIC_SEQ_CST);
}
}
"""


def main():
    counted_allocator.SOURCE = SOURCE  # the suite's build step, over this allocator's source
    path = counted_allocator._build(tempfile.mkdtemp())
    lib = ctypes.CDLL(path)

    def counter(name):
        return ctypes.c_longlong.in_dll(lib, name).value
    errors = []
    try:
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(path, "user_alloc", "user_free")
        torch.cuda.memory.change_current_allocator(pluggable)
    except Exception as e:  # noqa: BLE001
        report([f"change_current_allocator before CUDA is used raised {type(e).__name__}: {e}"])
    x = torch.arange(1 << 20, dtype=torch.int64, device="cuda")
    if counter("live_bytes") < x.numel() * 8:
        errors.append(f"an 8 MiB tensor: {counter('live_bytes')} live bytes in the allocator")
    if int((x * 2).sum().item()) != (1 << 20) * ((1 << 20) - 1):
        errors.append("a tensor of the program's allocator computed a wrong sum")
    freed = counter("n_free")
    del x
    if counter("n_free") <= freed:
        errors.append("dropping a tensor did not call the program's free function")
    nn = torch.nn
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    w0 = model[0].weight.detach().clone()
    for _ in range(3):
        loss = model(torch.randn(64, 256, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = model[0].weight.detach()
    if not bool(torch.isfinite(w).all().item()) or torch.equal(w, w0):
        errors.append("three SGD steps with the program's allocator did not train the model")
    calls = counter("n_alloc")
    p = torch.cuda.caching_allocator_alloc(1 << 20)
    if counter("n_alloc") != calls + 1:
        errors.append(f"caching_allocator_alloc: {counter('n_alloc') - calls} calls, expected 1")
    torch.cuda.caching_allocator_delete(p)

    live = counter("live_bytes")
    del model, opt, loss, w, w0
    gc.collect()
    torch.cuda.synchronize()
    if counter("live_bytes") >= live:
        errors.append(f"dropping the model and optimizer gave nothing back to the allocator "
                      f"({counter('live_bytes')} live bytes, were {live})")
    report(errors)


if __name__ == "__main__":
    main()
