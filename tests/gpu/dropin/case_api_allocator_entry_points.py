"""Every way a program reaches PyTorch's CUDA allocator lands in the same one: tensors, untyped
storages made directly, raw allocations, the device-generic torch.accelerator memory API and
torch.cuda's.

With PyTorch's allocator: torch.empty, torch.UntypedStorage(n, device="cuda"), a storage's
resize_, torch.cuda.caching_allocator_alloc and Tensor.new_empty each raise
torch.cuda.memory_allocated() by at least their bytes and give them back when freed; at every
step torch.accelerator.memory_allocated(), max_memory_allocated() and memory_reserved() equal
torch.cuda's, and torch.accelerator.memory_stats()["allocated_bytes.all.current"] too;
torch.accelerator.reset_peak_memory_stats() resets torch.cuda's peak; torch.accelerator
.empty_cache() brings torch.cuda.memory_reserved() down after a large tensor is freed.

Why vmm may differ: vmm becomes PyTorch's CUDA allocator through changeCurrentAllocator,
which swaps the allocator torch.cuda reaches; an entry point that asks c10's allocator
registry for the allocator of CUDA GPUs instead (torch.accelerator, storages made by type)
would reach PyTorch's own allocator beside vmm, and count nothing in vmm's statistics.
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20


def same_view(errors, where):
    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "memory_allocated"):
        return
    pairs = [("memory_allocated", torch.cuda.memory_allocated(), acc.memory_allocated()),
             ("max_memory_allocated", torch.cuda.max_memory_allocated(),
              acc.max_memory_allocated()),
             ("memory_reserved", torch.cuda.memory_reserved(), acc.memory_reserved())]
    if hasattr(acc, "memory_stats"):
        pairs.append(("memory_stats allocated_bytes.all.current",
                      torch.cuda.memory_stats().get("allocated_bytes.all.current", 0),
                      acc.memory_stats().get("allocated_bytes.all.current", 0)))
    for name, cuda_value, acc_value in pairs:
        if cuda_value != acc_value:
            errors.append(f"{where}: torch.cuda.{name} is {cuda_value}, torch.accelerator's "
                          f"{acc_value}")


def grows(errors, name, make, nbytes):
    """make() allocates nbytes (returning what keeps them); memory_allocated() must follow."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kept = make()
    during = torch.cuda.memory_allocated()
    if during - before < nbytes:
        errors.append(f"{name}: memory_allocated() grew by {during - before}, expected at least "
                      f"{nbytes}")
    same_view(errors, f"after {name}")
    return kept, before


def main():
    errors = []
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    same_view(errors, "at the start")

    t, before = grows(errors, "torch.empty", lambda: torch.empty(8 * MIB, dtype=torch.uint8,
                                                                  device="cuda"), 8 * MIB)
    del t
    if torch.cuda.memory_allocated() != before:
        errors.append("torch.empty's bytes did not come back at its free")

    s, before = grows(errors, "torch.UntypedStorage(n, device='cuda')",
                      lambda: torch.UntypedStorage(6 * MIB, device="cuda"), 6 * MIB)
    s.fill_(7)
    if torch.tensor([], dtype=torch.uint8, device="cuda").set_(s)[123].item() != 7:
        errors.append("a directly made CUDA storage reads wrong")
    s.resize_(12 * MIB)
    if torch.cuda.memory_allocated() - before < 12 * MIB:
        errors.append("a storage's resize_ to 12 MiB is not counted in memory_allocated()")
    same_view(errors, "after a storage's resize_")
    del s
    gc.collect()
    if torch.cuda.memory_allocated() != before:
        errors.append(f"a directly made storage's bytes did not come back: "
                      f"{torch.cuda.memory_allocated() - before} left")

    p, before = grows(errors, "caching_allocator_alloc",
                      lambda: torch.cuda.caching_allocator_alloc(3 * MIB), 3 * MIB)
    torch.cuda.caching_allocator_delete(p)
    if torch.cuda.memory_allocated() != before:
        errors.append("caching_allocator_delete did not give the bytes back")

    base = torch.zeros(4, device="cuda")
    n, before = grows(errors, "Tensor.new_empty",
                      lambda: base.new_empty((5 * MIB,), dtype=torch.uint8), 5 * MIB)
    del n

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "reset_peak_memory_stats"):
        big = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del big
        acc.reset_peak_memory_stats()
        if torch.cuda.max_memory_allocated() != torch.cuda.memory_allocated():
            errors.append("torch.accelerator.reset_peak_memory_stats() left torch.cuda's peak "
                          f"at {torch.cuda.max_memory_allocated()}")
        same_view(errors, "after torch.accelerator.reset_peak_memory_stats()")
    if acc is not None and hasattr(acc, "empty_cache"):
        big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        del big
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        acc.empty_cache()
        if torch.cuda.memory_reserved() > reserved - 256 * MIB:
            errors.append(f"torch.accelerator.empty_cache() left memory_reserved() at "
                          f"{torch.cuda.memory_reserved()} (was {reserved} with 256 MiB free)")
        same_view(errors, "after torch.accelerator.empty_cache()")
    report(errors)


if __name__ == "__main__":
    main()
