"""DLPack round trips of CUDA tensors (how CuPy, JAX, Triton and NumPy-style libraries share
memory with PyTorch), in one process.

With PyTorch's allocator: torch.from_dlpack(t) and from_dlpack(to_dlpack(t)) alias t (same
data_ptr, writes visible both ways), also for a slice with a storage offset; the alias keeps
the memory alive after t is dropped (memory_allocated() unchanged until the alias goes);
record_stream on the alias is accepted; after the alias goes, memory_allocated() is back at
the baseline; __dlpack__(stream=...) on a side stream gives a tensor whose values are right.

Why vmm may differ: the DLPack tensor's deleter is not the allocator's, and vmm's
record_stream hook is given pointers inside blocks it owns (vmm_cuda_allocator.cpp,
record_stream_fn_).
"""

import torch
from torch.utils import dlpack
from dropin_report import report


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    base = torch.cuda.memory_allocated()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    a = torch.from_dlpack(t)
    b = dlpack.from_dlpack(dlpack.to_dlpack(t[1000:]))
    if a.data_ptr() != t.data_ptr() or b.data_ptr() != t.data_ptr() + 4000:
        errors.append("DLPack aliases have other addresses")
    a[0] = -1.0
    t[1000] = -2.0
    if float(t[0].item()) != -1.0 or float(b[0].item()) != -2.0:
        errors.append("writes are not visible through the DLPack aliases")
    side = torch.cuda.Stream()
    b.record_stream(side)
    a.record_stream(side)
    with torch.cuda.stream(side):
        b.mul_(2)
    held = torch.cuda.memory_allocated()
    del t
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != held:
        errors.append("dropping t while DLPack aliases live changed memory_allocated")
    fresh = [torch.full((1 << 20,), 5.0, device="cuda") for _ in range(4)]
    if float(a[1001].item()) != 2002.0 or float(b[0].item()) != -4.0:
        errors.append(f"the aliases' memory changed after t was dropped: {float(a[1001].item())}")
    del a, b, fresh
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after the aliases went: memory_allocated {torch.cuda.memory_allocated()}"
                      f" != {base}")
    x = torch.full((4096,), 7.0, device="cuda")
    with torch.cuda.stream(side):
        cap = x.__dlpack__(stream=side.cuda_stream)
        y = dlpack.from_dlpack(cap)
        if float(y.sum().item()) != 7.0 * 4096:
            errors.append("__dlpack__(stream=...) gave wrong values")
    report(errors)


if __name__ == "__main__":
    main()
