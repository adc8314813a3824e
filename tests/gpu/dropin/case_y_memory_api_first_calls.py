"""The memory API as a program's first CUDA calls, before any tensor exists: a launcher that
logs torch.cuda.memory_stats() / memory_summary() / memory_snapshot() at start-up, caps the
process with set_per_process_memory_fraction() before loading anything (a job sharing the GPU),
starts _record_memory_history() before the first allocation, and then makes its first tensors
inside a MemPool; and the deprecated aliases old training scripts still call
(memory_cached, max_memory_cached, reset_max_memory_cached, reset_max_memory_allocated).

With PyTorch's allocator: before CUDA is initialised memory_stats() is {} and
memory_allocated() / memory_reserved() are 0; after torch.cuda.init() memory_stats() has every
documented key ("{allocation,allocated_bytes,segment,reserved_bytes,active,active_bytes,
inactive_split,inactive_split_bytes,requested_bytes}.{all,large_pool,small_pool}.{current,
peak,allocated,freed}", num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc,
num_device_free, max_split_size, oversize_allocations.*, oversize_segments.*), all ints and all
0 but max_split_size; memory_snapshot() is []; memory_summary() (full and abbreviated) names
device 0; reset_peak_memory_stats(), reset_accumulated_memory_stats() and empty_cache() work;
with the fraction set to what the process holds now (nothing) plus 1.5 GiB,
get_per_process_memory_fraction() returns it; the first allocation (256 MiB, in a MemPool,
while history is recorded) lands in that pool and in the trace; 1 GiB more in the default
pool fits, a further 512 MiB in the MemPool raises torch.cuda.OutOfMemoryError, and after the
1 GiB tensor is freed it fits; the deprecated aliases warn (FutureWarning) and return what
memory_reserved() / max_memory_reserved() return, and the deprecated resets leave
max_memory_reserved() == memory_reserved() and max_memory_allocated() == memory_allocated();
memory_stats(device) agrees with memory_allocated() for every way of naming the device; once
everything is dropped memory_allocated() is 0.

Why vmm may differ: vmm's allocator is current before CUDA is initialised (VMM_TORCH_ENABLE),
answers statistics, snapshots and resets for a device whose pool does not exist yet, keeps a
fraction set before any pool (fractions_, applied when the device pool or the first private
pool is made and shares the GPU's DeviceCap), and makes a private pool before the device pool.
"""
import warnings

import torch
from dropin_report import oom, report

MIB, GIB = 1 << 20, 1 << 30
CORE = ("allocation", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
        "inactive_split", "inactive_split_bytes", "requested_bytes")
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
            "num_device_free", "max_split_size")


def documented_keys():
    keys = [f"{s}.{p}.{m}" for s in CORE for p in ("all", "large_pool", "small_pool")
            for m in ("current", "peak", "allocated", "freed")]
    keys += [f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments")
             for m in ("current", "peak", "allocated", "freed")]
    return keys + list(COUNTERS)


def warned(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn(*args)
    return value, any(issubclass(w.category, FutureWarning) for w in caught)


def main():
    errors = []
    if not torch.cuda.is_initialized():
        if torch.cuda.memory_stats() != {}:
            errors.append("memory_stats() before CUDA is initialised is not {}")
        if torch.cuda.memory_allocated() != 0 or torch.cuda.memory_reserved() != 0:
            errors.append("memory_allocated() / memory_reserved() before CUDA is initialised "
                          "are not 0")
    torch.cuda.init()
    stats = torch.cuda.memory_stats()
    missing = [k for k in documented_keys() if k not in stats]
    if missing:
        errors.append(f"memory_stats() after init lacks {missing[:6]}")
    nonzero = [f"{k}={v!r}" for k, v in stats.items()
               if k != "max_split_size" and (not isinstance(v, int) or v != 0)]
    if nonzero:
        errors.append(f"memory_stats() before any allocation: {', '.join(nonzero[:6])}")
    if torch.cuda.memory_snapshot() != []:
        errors.append(f"memory_snapshot() before any allocation is "
                      f"{torch.cuda.memory_snapshot()!r:.200}")
    for abbreviated in (False, True):
        text = torch.cuda.memory_summary(abbreviated=abbreviated)
        if "PyTorch CUDA memory summary, device ID 0" not in text:
            errors.append(f"memory_summary(abbreviated={abbreviated}) before any allocation "
                          f"does not name device 0")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() != 0 or torch.cuda.memory_reserved() != 0:
        errors.append("memory_allocated() / memory_reserved() are not 0 before any allocation")

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = (torch.cuda.memory_reserved() + 1.5 * GIB) / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None and abs(getter() - fraction) > 1e-12:
        errors.append(f"get_per_process_memory_fraction() is {getter()}, set {fraction}")

    torch.cuda.memory._record_memory_history(max_entries=10_000, stacks="python")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        first = torch.full((256 * MIB // 4,), 1.5, device="cuda")
    ptr = first.data_ptr()
    if not any(s["address"] <= ptr < s["address"] + s["total_size"] for s in pool.snapshot()):
        errors.append("the process's first tensor, made in a MemPool, is not in the pool")
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    if not any(e.get("action") == "alloc" and e.get("addr") == ptr for e in trace):
        errors.append("history recorded from before the first allocation has no entry for it")
    torch.cuda.memory._record_memory_history(enabled=None)

    big = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    big.fill_(2)
    with torch.cuda.use_mem_pool(pool):
        if not oom(512 * MIB):
            errors.append("a 512 MiB MemPool tensor beyond the fraction set before any "
                          "allocation (1.75 GiB of 1.5) did not raise OutOfMemoryError")
    del big
    torch.cuda.empty_cache()
    with torch.cuda.use_mem_pool(pool):
        if oom(512 * MIB):
            errors.append("a 512 MiB MemPool tensor within the fraction raised OutOfMemoryError")
    if float(first[-1].item()) != 1.5:
        errors.append("the first tensor lost its value")
    torch.cuda.set_per_process_memory_fraction(1.0)

    for dev in (0, "cuda", "cuda:0", torch.device("cuda", 0)):
        got = torch.cuda.memory_stats(dev).get("allocated_bytes.all.current")
        if got != torch.cuda.memory_allocated():
            errors.append(f"memory_stats({dev!r}) allocated_bytes.all.current {got} != "
                          f"memory_allocated() {torch.cuda.memory_allocated()}")

    scratch = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del scratch
    value, warn = warned(torch.cuda.memory_cached)
    if value != torch.cuda.memory_reserved() or not warn:
        errors.append(f"memory_cached() = {value} (FutureWarning: {warn}), memory_reserved() = "
                      f"{torch.cuda.memory_reserved()}")
    value, warn = warned(torch.cuda.max_memory_cached)
    if value != torch.cuda.max_memory_reserved() or not warn:
        errors.append(f"max_memory_cached() = {value} (FutureWarning: {warn}), "
                      f"max_memory_reserved() = {torch.cuda.max_memory_reserved()}")
    _, warn = warned(torch.cuda.reset_max_memory_cached)
    if torch.cuda.max_memory_reserved() != torch.cuda.memory_reserved() or not warn:
        errors.append(f"after reset_max_memory_cached() (FutureWarning: {warn}) "
                      f"max_memory_reserved() {torch.cuda.max_memory_reserved()} != "
                      f"memory_reserved() {torch.cuda.memory_reserved()}")
    _, warn = warned(torch.cuda.reset_max_memory_allocated)
    if torch.cuda.max_memory_allocated() != torch.cuda.memory_allocated() or not warn:
        errors.append(f"after reset_max_memory_allocated() (FutureWarning: {warn}) "
                      f"max_memory_allocated() {torch.cuda.max_memory_allocated()} != "
                      f"memory_allocated() {torch.cuda.memory_allocated()}")
    del first, pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() != 0:
        errors.append(f"with every tensor gone memory_allocated() is "
                      f"{torch.cuda.memory_allocated()}")
    report(errors)


if __name__ == "__main__":
    main()
