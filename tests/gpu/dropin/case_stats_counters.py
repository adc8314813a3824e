"""The cumulative side of torch.cuda.memory_stats(): each statistic's "allocated" (historical
total increase) and "freed" (historical total decrease), as memory_stats() documents them,
reset_accumulated_memory_stats(), and memory_allocated() around a record_stream free.

With PyTorch's allocator: after reset_accumulated_memory_stats() every
"<stat>.<pool>.allocated" and ".freed" of the core statistics, num_ooms and
num_alloc_retries are 0 while "current" keeps its value; from then on, for every core
statistic, current - current_at_reset == allocated - freed; allocating 12 tensors (no kernels)
adds exactly 12 to allocation.all.allocated, and allocated_bytes.all.allocated grows by what
memory_allocated() grew; freeing them adds 12 to allocation.all.freed and the same bytes to
allocated_bytes.all.freed; peak >= current, active_bytes >= allocated_bytes, reserved >=
allocated and max_memory_reserved() >= memory_reserved() throughout. A tensor dropped while
a stream it was recorded on (record_stream) still runs no longer counts in memory_allocated()
(PyTorch keeps the block as active memory until that stream is done).

Why vmm may differ: vmm maps its own pool bookkeeping onto PyTorch's DeviceStats
(vmm_device_torch_stats): its accumulated fields, its reset and its handling of a free that
waits for another stream's event are its own.
"""

import torch
from dropin_report import core_stats, report

MIB = 1 << 20


def check(where, at_reset, errors):
    st = core_stats()
    for name, s in st.items():
        moved = s.get("current", 0) - at_reset.get(name, {}).get("current", 0)
        if moved != s.get("allocated", 0) - s.get("freed", 0):
            errors.append(f"{where}: {name}: current moved by {moved} but allocated - freed is "
                          f"{s.get('allocated', 0) - s.get('freed', 0)}")
        if s.get("peak", 0) < s.get("current", 0):
            errors.append(f"{where}: {name}: peak {s.get('peak')} < current {s['current']}")
    if st.get("active_bytes.all", {}).get("current", 0) < st["allocated_bytes.all"]["current"]:
        errors.append(f"{where}: active_bytes < allocated_bytes")
    if not (torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
            >= torch.cuda.memory_allocated()):
        errors.append(f"{where}: not max_reserved >= reserved >= allocated")
    return st


def main():
    keep = torch.ones(1000, device="cuda")
    torch.cuda.synchronize()
    errors = []
    torch.cuda.reset_accumulated_memory_stats()
    at_reset, stats = core_stats(), torch.cuda.memory_stats()
    dirty = [f"{k}.{m}={v[m]}" for k, v in at_reset.items() for m in ("allocated", "freed")
             if v.get(m, 0)] + [f"{k}={stats[k]}" for k in ("num_ooms", "num_alloc_retries")
                                if stats.get(k, 0)]
    if dirty:
        errors.append(f"after reset_accumulated_memory_stats: {', '.join(dirty[:8])}")
    base = torch.cuda.memory_allocated()
    ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in
          (1, 511, 4096, 100_000, MIB, 3 * MIB + 7, 20 * MIB, 64 * MIB, 7, 900, 5000, MIB + 1)]
    grew = torch.cuda.memory_allocated() - base
    st = check("after 12 allocations", at_reset, errors)
    got = (st["allocation.all"].get("allocated"), st["allocated_bytes.all"].get("allocated"))
    if got != (12, grew):
        errors.append(f"after 12 allocations (+{grew} bytes) allocation.all.allocated, "
                      f"allocated_bytes.all.allocated = {got}")
    del ts
    st = check("after freeing them", at_reset, errors)
    got = (st["allocation.all"].get("freed"), st["allocated_bytes.all"].get("freed"))
    if got != (12, grew):
        errors.append(f"after 12 frees (of {grew} bytes) allocation.all.freed, "
                      f"allocated_bytes.all.freed = {got}")
    if torch.cuda.memory_allocated() != base:
        errors.append(f"memory_allocated {torch.cuda.memory_allocated()} != {base} after frees")
    side = torch.cuda.Stream()
    t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        t.add_(1)
    t.record_stream(side)
    del t
    pending = torch.cuda.memory_allocated()
    check("while a freed block waits for its stream", at_reset, errors)
    torch.cuda.synchronize()
    if pending != base:
        errors.append(f"a tensor dropped while its recorded stream ran still counts: "
                      f"memory_allocated {pending} != {base}")
    check("at the end", at_reset, errors)
    del keep
    report(errors)


if __name__ == "__main__":
    main()
