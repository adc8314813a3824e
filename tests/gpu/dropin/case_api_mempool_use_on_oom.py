"""A MemPool made with use_on_oom=True: when an allocation outside the pool finds no memory
under the process's cap, it is served from the pool's cached memory instead of failing.

With PyTorch's allocator: a 256 MiB tensor made and freed inside use_mem_pool(pool) leaves
256 MiB cached in the pool; with the cap set a little above what the process holds, a
192 MiB tensor made outside the pool succeeds, lies in one of the pool's segments and reads
back what was written; a request larger than the pool's cache still raises
torch.cuda.OutOfMemoryError; with the cap lifted and everything freed, memory_allocated() is
back at its baseline.

Why vmm may differ: the fallback is VmmAllocator::AllocateOnOom over the pools setUseOnOOM
marked, which no other program reaches.
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20


def main():
    errors = []
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        pool = torch.cuda.MemPool(use_on_oom=True)
    except TypeError:
        print("this torch's MemPool has no use_on_oom: nothing to check")
        report(errors)
        return
    base = torch.cuda.memory_allocated()
    with torch.cuda.use_mem_pool(pool):
        cached = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    del cached
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 16 * MIB) / total)
    try:
        t = torch.empty(192 * MIB, dtype=torch.uint8, device="cuda")
        t.fill_(9)
        p = t.data_ptr()
        if not any(s["address"] <= p < s["address"] + s["total_size"] for s in pool.snapshot()):
            errors.append("the tensor made past the cap is not in the use_on_oom pool")
        if int(t[-1].item()) != 9 or int(t[0].item()) != 9:
            errors.append("the tensor served from the pool reads wrong")
        del t
    except torch.cuda.OutOfMemoryError as e:
        errors.append(f"a 192 MiB tensor past the cap raised although the use_on_oom pool "
                      f"caches 256 MiB: {str(e)[:160]}")
    try:
        big = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
        errors.append("a 1 GiB tensor past the cap succeeded")
        del big
    except torch.cuda.OutOfMemoryError:
        pass
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"memory_allocated() is {torch.cuda.memory_allocated()} after everything "
                      f"was freed, baseline {base}")
    del pool
    report(errors)


if __name__ == "__main__":
    main()
