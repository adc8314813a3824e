"""Hundreds of thousands of tiny CUDA tensors live at once (per-parameter scalars and
statistics, a metrics logger that keeps one 0-dim tensor per step, ragged lists of short
index tensors), then every other one freed and the holes refilled, then all freed in random
order.

With PyTorch's allocator each request of at most 512 bytes takes a 512-byte block packed in
2 MiB segments of the small pool: 150,000 float32 tensors of 1 to 64 elements, 5,000 0-dim
ones and 5,000 one-byte bool ones raise allocation.all.current by exactly their number and
memory_allocated() by at least their bytes; every data_ptr is aligned to 256 bytes (what
cudaMalloc guarantees and vectorized kernels and libraries assume) and no two tensors
overlap; every tensor holds its value. Freeing the odd-numbered ones and making 75,000
tensors of 65 to 128 elements fills the holes (memory_reserved() grows by no more than half
of what the first 150,000 took; with PyTorch's allocator it does not grow at all); once
everything is freed, in a shuffled order, memory_allocated() and allocation.all.current are
back at the baseline and empty_cache() brings memory_reserved() back to where it was.

Why vmm may differ: vmm serves these from its small arena (requests up to small_size),
finds free blocks in segregated bins and live ones through a two-level index
(docs/DESIGN.md §2b); the number of live blocks, holes of one size refilled by requests of
another, and a free order unrelated to the allocation order test that bookkeeping at a scale
ordinary workloads do not reach (and a per-block cost shows as a timeout).
"""
import random

import torch
from dropin_report import baseline, memory_back, report, settle

N = 150_000
EXTRA = 5_000


def expected(indices, length_of):
    idx = torch.tensor(list(indices))
    lengths = torch.tensor([length_of(i) for i in indices])
    return torch.repeat_interleave((idx % 997).float(), lengths)


def check_values(ts, indices, length_of, errors, when):
    for start in range(0, len(indices), 10_000):
        part = indices[start:start + 10_000]
        got = torch.cat([ts[i] for i in part]).cpu()
        if not torch.equal(got, expected(part, length_of)):
            errors.append(f"{when}: tensors {part[0]}..{part[-1]} do not hold their values")
            return


def main():
    errors = []
    torch.empty(1, device="cuda")
    base, res0, base_count = baseline()

    def first_len(i):
        return 1 + i % 64

    ts = [torch.full((first_len(i),), float(i % 997), device="cuda") for i in range(N)]
    scalars = [torch.full((), float(i), device="cuda") for i in range(EXTRA)]
    flags = [torch.full((1,), i % 2 == 1, device="cuda") for i in range(EXTRA)]
    live = ts + scalars + flags
    count = torch.cuda.memory_stats()["allocation.all.current"] - base_count
    if count != len(live):
        errors.append(f"{len(live)} tiny tensors raised allocation.all.current by {count}")
    nbytes = sum(t.nbytes for t in live)
    grown = torch.cuda.memory_allocated() - base
    if grown < nbytes:
        errors.append(f"{len(live)} tiny tensors of {nbytes} bytes raised memory_allocated() by "
                      f"only {grown}")
    spans = sorted((t.data_ptr(), t.nbytes) for t in live)
    misaligned = sum(1 for p, _ in spans if p % 256)
    if misaligned:
        errors.append(f"{misaligned} of {len(spans)} tiny tensors are not 256-byte aligned")
    overlaps = sum(1 for (p0, n0), (p1, _) in zip(spans, spans[1:]) if p0 + n0 > p1)
    if overlaps:
        errors.append(f"{overlaps} pairs of live tiny tensors overlap")
    del live, spans
    check_values(ts, list(range(N)), first_len, errors, "all live")
    if not torch.equal(torch.stack(scalars).cpu(), torch.arange(EXTRA, dtype=torch.float32)):
        errors.append("the 0-dim tensors do not hold their values")
    if int(torch.cat(flags).sum().item()) != EXTRA // 2:
        errors.append("the bool tensors do not hold their values")

    reserved1 = torch.cuda.memory_reserved()
    for i in range(1, N, 2):
        ts[i] = None

    def second_len(i):
        return first_len(i) if i % 2 == 0 else 65 + i % 64

    for i in range(1, N, 2):
        ts[i] = torch.full((second_len(i),), float(i % 997), device="cuda")
    refill = torch.cuda.memory_reserved() - reserved1
    if refill > (reserved1 - res0) // 2:
        errors.append(f"refilling {N // 2} holes of freed tiny tensors took {refill} more bytes "
                      f"of reserved memory (the first {N} took {reserved1 - res0})")
    check_values(ts, list(range(N)), second_len, errors, "after the holes were refilled")

    order = list(range(N))
    random.Random(0).shuffle(order)
    for i in order:
        ts[i] = None
    del ts, scalars, flags
    settle()
    memory_back(errors, base, res0, "with every tiny tensor freed", base_count)
    report(errors)


if __name__ == "__main__":
    main()
