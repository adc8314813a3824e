"""A MemPool over a program's own allocator: torch.cuda.MemPool(CUDAPluggableAllocator(...)
.allocator()) with torch.cuda.use_mem_pool, as NCCL's memory pools (ncclMemAlloc), vLLM's
sleep mode (its cuMem allocator) and PyTorch's documentation use it.

The allocator here is a small shared library compiled at the start (counted_allocator.py:
cuMemAlloc / cuMemFree through libcuda, with counters, and a byte limit past which it returns
null). With PyTorch's
allocator: tensors made inside use_mem_pool(pool) come from that allocator's memory (every one
lies in a segment of pool.snapshot(), and the allocator was called), and small tensors share
its segments (fewer calls than tensors); tensors made outside the context do not come from it;
values, a matmul and a side stream's tensor in the pool are right; memory_allocated() counts
the pool's tensors; freed pool tensors are kept by the pool (the allocator is not called to
free them) and reused by the next allocations in it without a call; record_stream on a pool
tensor is accepted; when the allocator returns null inside the pool,
torch.cuda.OutOfMemoryError is raised and the pool stays usable; once every tensor and the
pool are gone, empty_cache() has handed back everything the allocator gave.

Why vmm may differ: vmm's allocator took a MemPool over another allocator for an error; now
such a pool is served from that allocator's segments, split and cached as PyTorch's allocator
does (torch_plugin/csrc/foreign_segments.h), and its frees, statistics and snapshot must reach
those segments.
"""
import gc

import torch
from counted_allocator import CountedAllocator
from dropin_report import report

MIB = 1 << 20


def in_segments(t, segments):
    p = t.data_ptr()
    return any(s["address"] <= p < s["address"] + s["total_size"] for s in segments)


def main():
    errors = []
    torch.empty(1, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    (w @ w).sum().item()  # cuBLAS's workspace, kept for good, is made outside the pool
    torch.cuda.synchronize()
    lib = CountedAllocator()
    pool = torch.cuda.MemPool(lib.pluggable.allocator())
    base = torch.cuda.memory_allocated()

    sizes = [256, 1000, 4096, 100_000, 3 * MIB // 4, 3 * MIB // 4, 40 * MIB // 4]
    with torch.cuda.use_mem_pool(pool):
        tensors = [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(sizes)]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = torch.full((MIB,), 7.0, device="cuda")
        side.synchronize()
    outside = torch.full((MIB,), 9.0, device="cuda")
    calls = lib.n_alloc
    if calls == 0:
        errors.append("the MemPool's allocator was never called")
    if calls >= len(sizes):
        errors.append(f"{len(sizes)} tensors took {calls} calls of the MemPool's allocator: "
                      f"small tensors should share its segments")
    segments = pool.snapshot()
    for i, t in enumerate(tensors + [on_side]):
        if not in_segments(t, segments):
            errors.append(f"pool tensor {i} lies in no segment of pool.snapshot()")
    if in_segments(outside, segments):
        errors.append("a tensor made outside use_mem_pool lies in the pool's segments")
    for i, t in enumerate(tensors):
        if float(t.sum().item()) != float(i + 1) * t.numel():
            errors.append(f"pool tensor {i} has wrong values")
    if float(on_side.sum().item()) != 7.0 * MIB:
        errors.append("the side stream's pool tensor has wrong values")
    grown = torch.cuda.memory_allocated() - base
    expected = sum(4 * n for n in sizes) + 8 * MIB
    if grown < expected:
        errors.append(f"memory_allocated() grew by {grown}, less than the {expected} bytes of "
                      f"the tensors")
    with torch.cuda.use_mem_pool(pool):
        m = torch.randn(512, 512, device="cuda")
        product = m @ m
    if not torch.allclose(product.cpu(), m.cpu() @ m.cpu(), atol=1e-2, rtol=1e-3):
        errors.append("a matmul over pool tensors is wrong")
    tensors[2].record_stream(side)

    frees_before = lib.n_free
    del tensors, m, product, t
    gc.collect()
    if lib.n_free != frees_before:
        errors.append("freeing pool tensors handed their memory back to the MemPool's allocator "
                      "(the pool caches it until empty_cache)")
    calls = lib.n_alloc
    with torch.cuda.use_mem_pool(pool):
        again = [torch.ones(n, device="cuda") for n in sizes]
    if lib.n_alloc != calls:
        errors.append(f"allocating again in the pool called its allocator "
                      f"{lib.n_alloc - calls} times instead of reusing what it "
                      f"cached")
    if sum(float(t.sum().item()) for t in again) != float(sum(sizes)):
        errors.append("reused pool memory reads wrong")
    del again
    gc.collect()

    # The allocator runs out: the pool's cache goes back to it, then OutOfMemoryError.
    lib.set_limit(lib.live_bytes + 64 * MIB)
    raised = False
    try:
        with torch.cuda.use_mem_pool(pool):
            big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            del big
    except torch.cuda.OutOfMemoryError:
        raised = True
    except Exception as e:  # noqa: BLE001
        errors.append(f"the allocator's null gave {type(e).__name__}, not OutOfMemoryError: "
                      f"{str(e)[:200]}")
        raised = True
    if not raised:
        errors.append("a 256 MiB tensor was made past the allocator's limit")
    lib.set_limit(0)
    with torch.cuda.use_mem_pool(pool):
        after = torch.full((MIB,), 3.0, device="cuda")
    if float(after.sum().item()) != 3.0 * MIB:
        errors.append("the pool after its out of memory gives wrong memory")

    del after, on_side, outside, segments
    gc.collect()
    held = lib.live_bytes
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"allocator: {lib.n_alloc} segments given, {lib.n_free} back, "
          f"{lib.live_bytes} bytes out (of {held} before the pool went)")
    if lib.live_bytes != 0 or lib.n_free != lib.n_alloc:
        errors.append(f"after the pool and its tensors are gone and empty_cache(), the "
                      f"allocator still has {lib.live_bytes} bytes out")
    lib.close()
    report(errors)


if __name__ == "__main__":
    main()
