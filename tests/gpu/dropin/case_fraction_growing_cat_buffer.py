"""A buffer grown one row at a time by reallocation (`kv = torch.cat([kv, row])`, the naive
KV cache of many generation scripts and the growing replay buffers of RL code) under a
per-process memory fraction, with small per-step results kept and a transient scratch tensor
each step.

With PyTorch's allocator every step allocates the grown buffer (2 MiB more than the last)
while the old one is still live, then frees the old one; no cached block is large enough for
the next step, so the allocator keeps taking new memory and, when the fraction is reached,
frees everything cached and retries. With the fraction at what the process held at the start
plus 1 GiB, 224 steps (a 448 MiB buffer at the end: at most 448 + 446 MiB live during the last
copy, with the row, the scratch and the kept results) all succeed; every row holds its step
number and every kept result the sum of the rows' first elements so far; a second sequence of
112 steps (the first buffer dropped) succeeds the same way; with the fraction back at 1.0 and
everything dropped memory_allocated() is back at the baseline and empty_cache() brings
memory_reserved() back to where it was.

Why vmm may differ: vmm grows into one virtual range and can give back only whole physical
chunks that hold no live block; a buffer that outgrows every free range at each step, beside
small blocks that stay, makes it trim and grow at every step near the cap (docs/DESIGN.md
§2b: reallocation workloads move about their size at each miss); memory stranded in chunks
shared with live blocks counts against the cap and may make a step fail that PyTorch's
allocator serves.
"""

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20
ROW = 2 * MIB // 4  # float32 elements of a 2 MiB row
STEPS = 224


def grow(steps, errors, name):
    """Grows a buffer `steps` rows; returns it and the kept per-step results (or None)."""
    kv = torch.empty(0, device="cuda")
    kept = []
    for i in range(steps):
        try:
            row = torch.full((ROW,), float(i), device="cuda")
            scratch = torch.empty(3 * MIB // 4, device="cuda").fill_(1.0)
            kv = torch.cat([kv, row])
            kept.append(kv[::ROW].sum().reshape(1))
            del row, scratch
        except torch.cuda.OutOfMemoryError as e:
            errors.append(f"{name}: step {i} (a buffer of {2 * (i + 1)} MiB) raised "
                          f"OutOfMemoryError: {str(e).splitlines()[0][:160]}")
            return None, None
    return kv, kept


def check(kv, kept, steps, errors, name):
    rows = kv.view(steps, ROW)
    want = torch.arange(steps, dtype=torch.float32)
    if not torch.equal(rows[:, 0].cpu(), want) or not torch.equal(rows[:, -1].cpu(), want):
        errors.append(f"{name}: the rows of the grown buffer do not hold their step numbers")
    sums = torch.cat(kept).cpu()
    if not torch.equal(sums, torch.cumsum(want, 0)):
        errors.append(f"{name}: the kept per-step results are wrong")


def main():
    errors = []
    keep = torch.full((4096,), 5.0, device="cuda")
    base, res0, _ = baseline()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((res0 + 1024 * MIB) / total)

    kv, kept = grow(STEPS, errors, "first sequence")
    if kv is not None:
        check(kv, kept, STEPS, errors, "first sequence")
    kv = kept = None
    kv, kept = grow(STEPS // 2, errors, "second sequence")
    if kv is not None:
        check(kv, kept, STEPS // 2, errors, "second sequence")
    kv = kept = None

    torch.cuda.set_per_process_memory_fraction(1.0)
    if float(keep.sum().item()) != 5.0 * 4096:
        errors.append("a tensor made at the start changed")
    settle()
    memory_back(errors, base, res0, "at the end")
    report(errors)


if __name__ == "__main__":
    main()
