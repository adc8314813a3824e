"""torch.cuda.MemPool with torch.cuda.use_mem_pool: which allocations the pool gets, its
use_count() and snapshot(), and tensors that outlive the MemPool object (a KV cache or a
weight buffer kept in a pool of its own, the pool object dropped by a refactor).

With PyTorch's allocator (as its own tests test_mempool_with_allocator and
test_mempool_ctx_multithread check): a new MemPool has use_count() 1, 2 inside use_mem_pool
and 1 again after; tensors made in the context lie in the segments of pool.snapshot(), while
a tensor made before the context and one made by another thread during it do not (the
context routes the current thread only); after `del pool` the pool's tensors keep their
values while new tensors are allocated and filled; once they are dropped memory_allocated()
is back at the baseline, and empty_cache() brings memory_reserved() back to where it was.

Why vmm may differ: a MemPool is a vmm private pool with a use count of its own
(beginAllocateToPool routes by a filter on the thread), its snapshot is built by vmm, and the
pool is closed at its last release while blocks may still be live.
"""
import gc
import threading

import torch
from dropin_report import report

MIB = 1 << 20


def inside(t, segments):
    p = t.data_ptr()
    return any(s["address"] <= p < s["address"] + s["total_size"] for s in segments)


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    errors = []
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    pool = torch.cuda.MemPool()
    if pool.use_count() != 1:
        errors.append(f"a new MemPool has use_count() {pool.use_count()}, expected 1")
    before = torch.full((MIB,), 1.0, device="cuda")
    other = []
    with torch.cuda.use_mem_pool(pool):
        if pool.use_count() != 2:
            errors.append(f"inside use_mem_pool use_count() is {pool.use_count()}, expected 2")
        a = torch.full((MIB,), 2.0, device="cuda")
        b = torch.full((5 * MIB,), 3.0, device="cuda")
        small = torch.full((100,), 4.0, device="cuda")
        th = threading.Thread(target=lambda: other.append(torch.full((MIB,), 5.0, device="cuda")))
        th.start()
        th.join()
    if pool.use_count() != 1:
        errors.append(f"after use_mem_pool use_count() is {pool.use_count()}, expected 1")
    segs = pool.snapshot()
    for name, t in (("a", a), ("b", b), ("small", small)):
        if not inside(t, segs):
            errors.append(f"tensor {name}, made in use_mem_pool, is not in pool.snapshot()")
    if inside(before, segs):
        errors.append("a tensor made before use_mem_pool is in pool.snapshot()")
    if not other or inside(other[0], segs):
        errors.append("another thread's tensor made during use_mem_pool failed or is in the pool")
    del pool
    gc.collect()
    fresh = [torch.full((n,), -1.0, device="cuda") for n in (MIB, 5 * MIB, 100) * 4]
    torch.cuda.synchronize()
    for name, t, v in (("a", a, 2.0), ("b", b, 3.0), ("small", small, 4.0)):
        if not bool((t == v).all().item()):
            errors.append(f"tensor {name} changed after its MemPool was deleted")
    a.add_(1.0)
    if float(a.sum().item()) != 3.0 * MIB:
        errors.append("a pool tensor cannot be written after its MemPool was deleted")
    del a, b, small, fresh, before, other, t
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after every tensor went: memory_allocated {torch.cuda.memory_allocated()}"
                      f" != {base}")
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() > base_reserved:
        errors.append(f"after empty_cache: memory_reserved {torch.cuda.memory_reserved()} > "
                      f"{base_reserved} before the MemPool")
    report(errors)


if __name__ == "__main__":
    main()
