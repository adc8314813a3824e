"""max_memory_allocated() and max_memory_reserved() over the default pool and a MemPool over
another allocator (as NCCL's memory pool is), used one after the other.

With PyTorch's allocator (torch 2.11) a GPU keeps one set of statistics for every pool, a
MemPool over a CUDAPluggableAllocator included: 256 MiB freed in the default pool (its cache
emptied) and then 256 MiB taken inside `use_mem_pool` over such a pool peak at 256 MiB above
where the program started, allocated and reserved, not 512; the MemPool's tensor freed (its
segment kept by the pool) and then 256 MiB taken in the default pool peak at 256 MiB
allocated too; both live at once peak at their sum; the parts of the figures (large pool,
requested bytes) peak no higher than the whole; after reset_peak_memory_stats() the peaks
are what is held now.

Why vmm may differ: vmm serves such a pool from the other allocator's segments beside its own
pools (torch_plugin/csrc/foreign_segments.h), and added that pool's peaks to its own, which
counts each at its own high.
"""
import torch
from counted_allocator import CountedAllocator
from dropin_report import report

MIB = 1 << 20
SIZE = 256 * MIB
SLACK = 32 * MIB  # what a growth may map past the request; far below a second SIZE


def rise(errors, what, peak, base, low, high):
    grown = peak - base
    if not low <= grown < high:
        errors.append(f"{what} rose by {grown / MIB:.1f} MiB; {low / MIB:.0f} to "
                      f"{high / MIB:.0f} MiB expected with 256 MiB live at any time")


def parts_within_whole(errors, when):
    stats = torch.cuda.memory_stats()
    for key in ("allocated_bytes", "reserved_bytes"):
        whole = stats[f"{key}.all.peak"]
        for part in ("small_pool", "large_pool"):
            if stats[f"{key}.{part}.peak"] > whole:
                errors.append(f"{when}: {key}.{part}.peak {stats[f'{key}.{part}.peak']} above "
                              f"{key}.all.peak {whole}")
    if stats["requested_bytes.all.peak"] > stats["allocated_bytes.all.peak"]:
        errors.append(f"{when}: requested_bytes.all.peak above allocated_bytes.all.peak")
    if stats["allocated_bytes.all.peak"] != torch.cuda.max_memory_allocated():
        errors.append(f"{when}: memory_stats()['allocated_bytes.all.peak'] differs from "
                      f"max_memory_allocated()")
    for key, now in (("allocated_bytes", torch.cuda.memory_allocated()),
                     ("reserved_bytes", torch.cuda.memory_reserved())):
        if stats[f"{key}.all.peak"] < now:
            errors.append(f"{when}: {key}.all.peak {stats[f'{key}.all.peak']} below the "
                          f"current {now}")


def main():
    errors = []
    if not hasattr(torch.cuda, "MemPool"):
        report(errors)
        return
    torch.empty(1, device="cuda")
    lib = CountedAllocator()
    pool = torch.cuda.MemPool(lib.pluggable.allocator())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_allocated = torch.cuda.memory_allocated()
    base_reserved = torch.cuda.memory_reserved()

    # The default pool first, then the MemPool over the other allocator.
    a = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    del a
    torch.cuda.empty_cache()
    with torch.cuda.use_mem_pool(pool):
        b = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    if lib.n_alloc == 0:
        errors.append("the MemPool's allocator was never called")
    rise(errors, "max_memory_allocated", torch.cuda.max_memory_allocated(), base_allocated,
         SIZE, SIZE + 2 * MIB)
    rise(errors, "max_memory_reserved", torch.cuda.max_memory_reserved(), base_reserved,
         SIZE, SIZE + SLACK)
    parts_within_whole(errors, "default pool, then the MemPool")

    # The MemPool's tensor freed (its segment stays cached in the pool), then the default
    # pool's: allocated peaks at one tensor, reserved at both (PyTorch's figures alike).
    del b
    torch.cuda.reset_peak_memory_stats()
    if torch.cuda.max_memory_allocated() != torch.cuda.memory_allocated():
        errors.append("after reset_peak_memory_stats the allocated peak is not what is "
                      "allocated")
    if torch.cuda.max_memory_reserved() != torch.cuda.memory_reserved():
        errors.append("after reset_peak_memory_stats the reserved peak is not what is reserved")
    base_allocated = torch.cuda.memory_allocated()
    c = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    rise(errors, "max_memory_allocated (MemPool's tensor freed, then the default pool's)",
         torch.cuda.max_memory_allocated(), base_allocated, SIZE, SIZE + 2 * MIB)
    parts_within_whole(errors, "the MemPool, then the default pool")

    # Both at once: the peak is their sum.
    with torch.cuda.use_mem_pool(pool):
        d = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    rise(errors, "max_memory_allocated (both pools' tensors live)",
         torch.cuda.max_memory_allocated(), base_allocated, 2 * SIZE, 2 * SIZE + 4 * MIB)
    parts_within_whole(errors, "both live")

    del c, d
    calls_before = lib.n_free
    del pool
    torch.cuda.empty_cache()
    if lib.n_free == calls_before:
        errors.append("empty_cache() gave nothing back to the MemPool's allocator once the "
                      "pool was gone")
    parts_within_whole(errors, "the MemPool gone")
    report(errors)


if __name__ == "__main__":
    main()
