"""torch.cuda.set_per_process_memory_fraction caps what the process may allocate.
# EXCLUSIVE (allocates tens of GiB: run alone)

With PyTorch's allocator and a fraction of 0.25: a tensor of 15% of the device fits; a
second one of 15% (30% in all) raises torch.cuda.OutOfMemoryError, also after empty_cache;
a single 30% tensor raises too; the first tensor is intact and the program goes on; once the
fraction is 1.0 again, the 30% tensor fits. Inside a CUDA-graph MemPool the cap holds as well
(PyTorch caps all pools of the device).

Why vmm may differ: the cap is vmm's DeviceCap, checked at each growth (device_cap.h), with
cached and parked memory counted its own way.
"""

import torch
from dropin_report import oom, report


def main():
    torch.empty(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    errors = []
    torch.cuda.set_per_process_memory_fraction(0.25)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None and abs(getter() - 0.25) > 1e-9:
        errors.append(f"get_per_process_memory_fraction() = {getter()}, set 0.25")
    a = torch.full((int(total * 0.15) // 4,), 7.0, device="cuda")
    if not oom(int(total * 0.15)):
        errors.append("30% in all fitted under a fraction of 0.25")
    torch.cuda.empty_cache()
    if not oom(int(total * 0.15)):
        errors.append("30% in all fitted under a fraction of 0.25 after empty_cache")
    del a
    if not oom(int(total * 0.30)):
        errors.append("a 30% tensor fitted under a fraction of 0.25")
    if oom(int(total * 0.20)):
        errors.append("a 20% tensor did not fit under a fraction of 0.25 with nothing else live")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        inside = oom(int(total * 0.30))
    if not inside:
        errors.append("a 30% tensor in a MemPool fitted under a fraction of 0.25")
    del pool
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    if oom(int(total * 0.30)):
        errors.append("a 30% tensor did not fit once the fraction was 1.0")
    report(errors)


if __name__ == "__main__":
    main()
