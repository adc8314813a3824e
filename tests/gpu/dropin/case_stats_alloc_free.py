"""torch.cuda memory statistics around allocations and frees of many sizes.
# EXCLUSIVE (reads mem_get_info(), which other processes would disturb)

Checks, for tensors from 1 byte to 96 MiB: memory_allocated() rises by at least the tensor's
bytes (and by at most the size rounded up to 2 MiB), allocation.all.current rises by exactly
one per tensor, requested_bytes.all.current by exactly the requested bytes, reserved >=
allocated, the peaks follow, everything returns to the baseline after del, reset_peak brings
the peak to the current value, and empty_cache() gives reserved memory back (mem_get_info's
free memory grows).

Why vmm may differ: its statistics come from its own pool bookkeeping mapped onto PyTorch's
DeviceStats (vmm_c.cc), with its own rounding and its own notion of a segment.
"""

import torch
from dropin_report import report

MIB = 1 << 20
errors = []


def check(cond, msg):
    if not cond:
        errors.append(msg)


def stat(key):
    return torch.cuda.memory_stats().get(key, 0)


def main():
    torch.cuda.init()
    torch.empty(1, device="cuda")  # context and the allocator set up
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated()
    base_count = stat("allocation.all.current")
    base_req = stat("requested_bytes.all.current")
    sizes = [1, 511, 512, 513, 4096, 100_000, MIB - 1, MIB, MIB + 1, 3 * MIB + 7,
             20 * MIB, 96 * MIB + 123]
    live = []
    for n in sizes:
        before = torch.cuda.memory_allocated()
        before_count = stat("allocation.all.current")
        before_req = stat("requested_bytes.all.current")
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        live.append(t)
        grew = torch.cuda.memory_allocated() - before
        check(n <= grew <= ((n + 2 * MIB - 1) // (2 * MIB)) * 2 * MIB + 2 * MIB,
              f"{n} bytes: memory_allocated grew by {grew}")
        check(stat("allocation.all.current") - before_count == 1,
              f"{n} bytes: allocation.all.current grew by "
              f"{stat('allocation.all.current') - before_count}, expected 1")
        check(stat("requested_bytes.all.current") - before_req == n,
              f"{n} bytes: requested_bytes.all.current grew by "
              f"{stat('requested_bytes.all.current') - before_req}, expected {n}")
        check(torch.cuda.memory_reserved() >= torch.cuda.memory_allocated(),
              f"{n} bytes: reserved {torch.cuda.memory_reserved()} < allocated "
              f"{torch.cuda.memory_allocated()}")
        check(torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated(),
              "max_memory_allocated below memory_allocated")
    total = sum(sizes)
    check(torch.cuda.memory_allocated() - base_alloc >= total,
          f"allocated grew by {torch.cuda.memory_allocated() - base_alloc} < {total}")
    peak = torch.cuda.max_memory_allocated()
    del t
    live.clear()
    torch.cuda.synchronize()
    check(torch.cuda.memory_allocated() == base_alloc,
          f"after del: memory_allocated {torch.cuda.memory_allocated()} != baseline {base_alloc}")
    check(stat("allocation.all.current") == base_count,
          f"after del: allocation.all.current {stat('allocation.all.current')} != {base_count}")
    check(stat("requested_bytes.all.current") == base_req,
          f"after del: requested_bytes.all.current {stat('requested_bytes.all.current')} != "
          f"{base_req}")
    check(torch.cuda.max_memory_allocated() == peak, "peak changed by frees")
    torch.cuda.reset_peak_memory_stats()
    check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(),
          f"after reset_peak_memory_stats: max {torch.cuda.max_memory_allocated()} != current "
          f"{torch.cuda.memory_allocated()}")
    check(torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved(),
          f"after reset_peak_memory_stats: max reserved {torch.cuda.max_memory_reserved()} != "
          f"{torch.cuda.memory_reserved()}")

    # A big tensor's memory is cached after del and given back by empty_cache.
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    big.fill_(3)
    torch.cuda.synchronize()
    free_with, _ = torch.cuda.mem_get_info()
    del big
    reserved_cached = torch.cuda.memory_reserved()
    check(reserved_cached - torch.cuda.memory_allocated() >= (2 << 30),
          f"a freed 2 GiB tensor is not cached: reserved {reserved_cached}, allocated "
          f"{torch.cuda.memory_allocated()}")
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    check(reserved_cached - torch.cuda.memory_reserved() >= (2 << 30),
          f"empty_cache gave back {reserved_cached - torch.cuda.memory_reserved()} bytes, "
          f"expected >= 2 GiB")
    check(free_after - free_with >= (2 << 30) - 64 * MIB,
          f"mem_get_info free grew by {free_after - free_with} after empty_cache, expected ~2 GiB")
    s = torch.cuda.memory_summary()
    check("allocated" in s.lower(), "memory_summary() has no 'allocated' row")
    torch.cuda.reset_accumulated_memory_stats()
    check(stat("allocated_bytes.all.freed") == 0, "reset_accumulated_memory_stats left freed")
    report(errors)


if __name__ == "__main__":
    main()
