"""set_per_process_memory_fraction caps a torch.cuda.MemPool over a program's own allocator
too, together with the rest of what PyTorch's allocator holds on the GPU.

With PyTorch's allocator, a custom allocator's segments count in what the allocator holds
(its total_allocated_memory): with the fraction set to what the process holds now plus
1 GiB, a 512 MiB tensor in the MemPool fits, a further 768 MiB one raises
torch.cuda.OutOfMemoryError without the custom allocator being asked for it, and while the
512 MiB stays, a 768 MiB tensor of the default pool raises too; once the MemPool and its
tensor are gone and empty_cache() has handed its segment back, the 768 MiB default-pool
tensor fits; the fraction set to 1.0 again lifts the cap.

Why vmm may differ: vmm's cap (device_cap.h) is checked at each growth of vmm's pools; a
MemPool over another allocator is served from that allocator's segments beside them
(foreign_segments.h), which count against the cap only through vmm_device_hold.
"""
import gc

import torch
from counted_allocator import CountedAllocator
from dropin_report import oom, report

MIB = 1 << 20


def main():
    errors = []
    if not hasattr(torch.cuda, "MemPool"):
        report(errors)
        return
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    counted = CountedAllocator()
    pool = torch.cuda.MemPool(counted.pluggable.allocator())
    cap = torch.cuda.memory_reserved() + 1024 * MIB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        with torch.cuda.use_mem_pool(pool):
            kept = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
            kept.fill_(7)
        if counted.n_alloc < 1:
            errors.append("the MemPool's allocator was never asked for a segment")
        asked = counted.n_alloc
        with torch.cuda.use_mem_pool(pool):
            if not oom(768 * MIB):
                errors.append("a further 768 MiB in the MemPool fit under a fraction of what "
                              "the process held plus 1 GiB, with 512 MiB held")
        if counted.n_alloc != asked:
            errors.append(f"the MemPool's allocator was asked for {counted.n_alloc - asked} "
                          "segment(s) the fraction does not admit")
        if not oom(768 * MIB):
            errors.append("768 MiB in the default pool fit under the fraction while the "
                          "MemPool held 512 MiB")
        # Checked a MiB at each end (a comparison of the whole would need 512 MiB more).
        if int(kept[:MIB].min()) != 7 or int(kept[-MIB:].max()) != 7:
            errors.append("the MemPool's tensor changed")
        del kept, pool
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if counted.live_bytes != 0:
            errors.append(f"the MemPool's allocator still holds {counted.live_bytes} bytes after "
                          "the pool and its tensor were freed and empty_cache")
        if oom(768 * MIB):
            errors.append("768 MiB in the default pool did not fit once the MemPool's memory "
                          "went back")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    if oom(2048 * MIB):
        errors.append("2 GiB did not fit with the fraction at 1.0")
    report(errors)


if __name__ == "__main__":
    main()
