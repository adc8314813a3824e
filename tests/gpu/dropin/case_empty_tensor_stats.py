"""Tensors without elements use no device memory.

PyTorch's allocator returns a null pointer for a request of 0 bytes without counting it:
creating 10,000 zero-element CUDA tensors (torch.empty(0), torch.zeros(0, 8), empty slices of
a clone) leaves memory_allocated(), allocation.all.current and memory_reserved() unchanged.

Why vmm may differ: Pool::Allocate rounds max(size, 1) up to a 512-byte block, so each empty
tensor may take (and count) a block.
"""

import torch
from dropin_report import report


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    alloc0 = torch.cuda.memory_allocated()
    count0 = torch.cuda.memory_stats()["allocation.all.current"]
    keep = []
    for i in range(10_000):
        if i % 3 == 0:
            keep.append(torch.empty(0, device="cuda"))
        elif i % 3 == 1:
            keep.append(torch.zeros(0, 8, device="cuda"))
        else:
            keep.append(torch.empty((4, 0), dtype=torch.int64, device="cuda"))
    alloc1 = torch.cuda.memory_allocated()
    count1 = torch.cuda.memory_stats()["allocation.all.current"]
    errors = []
    if alloc1 != alloc0:
        errors.append(f"10000 empty tensors changed memory_allocated by {alloc1 - alloc0} bytes")
    if count1 != count0:
        errors.append(f"10000 empty tensors changed allocation.all.current by {count1 - count0}")
    # They still work as tensors.
    cat = torch.cat([keep[0], torch.ones(3, device="cuda")])
    if cat.tolist() != [1.0, 1.0, 1.0]:
        errors.append(f"cat with an empty tensor gave {cat.tolist()}")
    del keep, cat
    if torch.cuda.memory_allocated() != alloc0:
        errors.append(f"after del: memory_allocated {torch.cuda.memory_allocated()} != {alloc0}")
    report(errors)


if __name__ == "__main__":
    main()
