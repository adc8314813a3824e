"""torch.cuda.caching_allocator_alloc / caching_allocator_delete: raw device memory from the
allocator for other code (CuPy, Numba, custom kernels), wrapped without a copy: torch.as_tensor
over a __cuda_array_interface__ dict where NumPy (which torch needs to parse it) is installed,
else torch._C._construct_storage_from_data_pointer.

With PyTorch's allocator: caching_allocator_alloc(n) (current stream, a torch.cuda.Stream or a
raw stream int) returns an int pointer aligned as cudaMalloc's (256 bytes or more);
memory_allocated() grows by at least n; the wrapping tensor has that data_ptr and reads back
what was written; 40 raw blocks and live tensors never overlap; caching_allocator_alloc(0)
returns 0 and deleting 0 does nothing; deleting a pointer inside a live block raises
RuntimeError ("invalid device pointer") and leaves the block alone; once every pointer is
deleted memory_allocated() is back at the baseline.

Why vmm may differ: raw_alloc / raw_delete go through the CUDAPluggableAllocator base class's
bookkeeping (allocation_metadata_), VmmAllocator overrides raw_delete for restored graph
blocks, and a size of 0 or an unknown pointer take vmm's own paths.
"""

import torch
from dropin_report import report
from raw_memory import wrap

MIB = 1 << 20


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    base = torch.cuda.memory_allocated()
    n = 3 * MIB + 4096
    p = torch.cuda.caching_allocator_alloc(n)
    if not isinstance(p, int) or p == 0 or p % 256:
        errors.append(f"caching_allocator_alloc({n}) returned {p!r}, not a 256-byte aligned "
                      f"pointer")
    if torch.cuda.memory_allocated() - base < n:
        errors.append(f"memory_allocated grew by {torch.cuda.memory_allocated() - base} < {n}")
    t = wrap(p, n // 4)
    if t.data_ptr() != p:
        errors.append(f"the tensor over the raw pointer is a copy ({t.data_ptr():#x} != {p:#x})")
    t.fill_(2.5)
    if float(t.sum().item()) != 2.5 * (n // 4):
        errors.append(f"the raw block reads back sum {float(t.sum().item())}")
    side = torch.cuda.Stream()
    for stream in (side, side.cuda_stream):
        q = torch.cuda.caching_allocator_alloc(MIB, stream=stream)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            u = wrap(q, MIB // 4)
            u.copy_(t[: MIB // 4])
            s = float(u.sum().item())
        if s != 2.5 * (MIB // 4):
            errors.append(f"raw block on a side stream ({type(stream).__name__}): sum {s}")
        del u
        side.synchronize()
        torch.cuda.caching_allocator_delete(q)
    ptrs = [(torch.cuda.caching_allocator_alloc(512 + i * 70_001), 512 + i * 70_001)
            for i in range(40)]
    live = [torch.empty(1000 + i * 999, dtype=torch.uint8, device="cuda") for i in range(20)]
    spans = sorted(ptrs + [(x.data_ptr(), x.numel()) for x in live] + [(p, n)])
    for (a, na), (b, _) in zip(spans, spans[1:]):
        if a + na > b:
            errors.append(f"allocations overlap: [{a:#x}, +{na}) and {b:#x}")
            break
    z = torch.cuda.caching_allocator_alloc(0)
    if z != 0:
        errors.append(f"caching_allocator_alloc(0) returned {z:#x}, not 0")
    torch.cuda.caching_allocator_delete(z)
    for q, _ in ptrs:
        torch.cuda.caching_allocator_delete(q)
    del live
    try:
        torch.cuda.caching_allocator_delete(p + 512)
        errors.append("caching_allocator_delete of a pointer inside a live block did not raise")
    except RuntimeError:
        pass
    t.fill_(4.0)
    if float(t.sum().item()) != 4.0 * (n // 4):
        errors.append("the live raw block changed after a bad caching_allocator_delete")
    del t
    torch.cuda.caching_allocator_delete(p)
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after deleting every raw block: memory_allocated "
                      f"{torch.cuda.memory_allocated()} != {base}")
    report(errors)


if __name__ == "__main__":
    main()
