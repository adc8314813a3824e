"""max_memory_allocated() and max_memory_reserved() over the default pool and a MemPool used
one after the other.

With PyTorch's allocator (torch 2.11) a device keeps one set of statistics for all its pools,
MemPools and CUDA graph pools included: 256 MiB freed in the default pool and then 256 MiB
taken inside `use_mem_pool` peak at 256 MiB above where the program started, not 512.

Why vmm may differ: vmm keeps statistics per pool (the device pool, each private pool) and
memory_stats() adds them up; a sum of the pools' peaks counts each pool at its own high, which
here are at different times.
"""
import torch
from dropin_report import report

MIB = 1 << 20
SIZE = 256 * MIB


def main():
    errors = []
    if not hasattr(torch.cuda, "MemPool"):
        report(errors)
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    a = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    del a
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        b = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    if not SIZE <= peak < SIZE + 2 * MIB:
        errors.append(f"max_memory_allocated rose by {peak / MIB:.1f} MiB with 256 MiB live at "
                      f"any time (256 MiB in the default pool, freed, then 256 MiB in a MemPool)")
    stats = torch.cuda.memory_stats()
    if stats["allocated_bytes.all.peak"] != torch.cuda.max_memory_allocated():
        errors.append("memory_stats()['allocated_bytes.all.peak'] differs from "
                      "max_memory_allocated()")
    reserved = torch.cuda.memory_reserved()
    if torch.cuda.max_memory_reserved() < reserved:
        errors.append(f"max_memory_reserved {torch.cuda.max_memory_reserved()} below "
                      f"memory_reserved {reserved}")

    # After a reset, the peak is what is held now (b), and a second MemPool tensor adds to it.
    torch.cuda.reset_peak_memory_stats()
    if torch.cuda.max_memory_allocated() != torch.cuda.memory_allocated():
        errors.append("after reset_peak_memory_stats the peak is not what is allocated")
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    now = torch.cuda.memory_allocated()
    if torch.cuda.max_memory_allocated() != now:
        errors.append(f"peak {torch.cuda.max_memory_allocated()} with {now} allocated and "
                      f"nothing freed since the reset")
    # A pool that is gone leaves the GPU's peak where it was.
    del b, c, pool
    torch.cuda.empty_cache()
    if torch.cuda.max_memory_allocated() != now:
        errors.append(f"once the MemPool and its tensors are gone the peak is "
                      f"{torch.cuda.max_memory_allocated()}, was {now}")
    report(errors)


if __name__ == "__main__":
    main()
