"""The last tensor of a dropped torch.cuda.MemPool freed while a CUDA graph is captured (a
buffer kept in a pool of its own, the pool object long gone, let go of inside captured code).

With PyTorch's allocator the freed tensor goes back to the pool, whose memory is given back
only at a later empty_cache; the capture succeeds, its replay gives the eager result, and once
everything is dropped and the cache is emptied, memory_allocated() and memory_reserved() are
back where they were.

Why vmm may differ: the MemPool is a vmm pool, closed when the MemPool was dropped, whose last
block goes inside the capture; destroying the pool there (a device synchronisation, unmaps)
would invalidate the capture.
"""

import gc

import torch
from dropin_report import memory_back, report, settle

NUMEL = 8 << 20  # float32: 32 MiB



def main():
    errors = []
    a = torch.ones(NUMEL, device="cuda")
    b = a * 2 + 1  # kernels loaded eagerly first
    del b
    settle()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        kept = [torch.full((NUMEL,), 7.0, device="cuda")]
        scratch = torch.full((NUMEL,), 8.0, device="cuda")
    del scratch, pool  # the pool object goes; one tensor of it is kept
    settle()
    if not bool((kept[0] == 7).all().item()):
        errors.append("the kept tensor changed when its MemPool was dropped")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            b = a * 2
            kept.clear()  # the pool's last block
            gc.collect()
            b = b + 1
    except Exception as e:  # noqa: BLE001
        report([f"a capture in which a dropped MemPool's last tensor was freed failed: "
                f"{type(e).__name__}: {e}"])
        return
    g.replay()
    torch.cuda.synchronize()
    if not bool((b == 3).all().item()):
        errors.append("the graph's replay did not compute a * 2 + 1")
    del g, b
    settle()
    memory_back(errors, base_alloc, base_res, "once everything is dropped")
    report(errors)


if __name__ == "__main__":
    main()
