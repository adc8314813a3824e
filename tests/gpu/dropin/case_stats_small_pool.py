"""memory_stats()'s small_pool / large_pool split (what memory_summary() prints as "from
small pool" / "from large pool").

PyTorch counts allocations of at most 1 MiB in the small pool and larger ones in the large
pool: allocating a 4 KiB tensor raises allocated_bytes.small_pool.current, a 4 MiB tensor
raises allocated_bytes.large_pool.current, and small + large == all.

Why vmm may differ: vmm's split is by arena (its small arena serves requests up to the
pool's small_size), counted apart from the pool's totals; a count missed on one side shows
as small + large != all.
"""

import torch
from dropin_report import report


def s(key):
    return torch.cuda.memory_stats().get(key, 0)


def main():
    torch.empty(1, device="cuda")
    errors = []
    b_small = s("allocated_bytes.small_pool.current")
    b_large = s("allocated_bytes.large_pool.current")
    small = torch.empty(4096, dtype=torch.uint8, device="cuda")
    d_small = s("allocated_bytes.small_pool.current") - b_small
    if d_small < 4096:
        errors.append(f"a 4 KiB tensor raised allocated_bytes.small_pool.current by {d_small}")
    big = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    d_large = s("allocated_bytes.large_pool.current") - b_large
    if d_large < (4 << 20) or d_large >= (4 << 20) + 4096 + (2 << 20):
        errors.append(f"a 4 MiB tensor raised allocated_bytes.large_pool.current by {d_large}")
    for kind in ("allocated_bytes", "allocation", "segment", "reserved_bytes"):
        total = s(f"{kind}.all.current")
        parts = s(f"{kind}.small_pool.current") + s(f"{kind}.large_pool.current")
        if total != parts:
            errors.append(f"{kind}: all.current {total} != small {s(f'{kind}.small_pool.current')}"
                          f" + large {s(f'{kind}.large_pool.current')}")
    if s("segment.small_pool.current") < 1:
        errors.append("no small-pool segment while a 4 KiB tensor lives")
    del small, big
    report(errors)


if __name__ == "__main__":
    main()
