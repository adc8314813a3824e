"""Copy-on-write CUDA tensors: torch._lazy_clone(t) shares t's memory until one side is
written (PyTorch's copy-on-write storages), as code that takes cheap defensive copies of
inputs uses it (operator test harnesses that turn every input into a lazy clone, tracing and
replay tools).

With PyTorch's allocator (its DataPtrs are "simple": their context is their data, so
lazy_clone_storage can wrap them): torch._lazy_clone of CUDA tensors of 4 KiB to 64 MiB
(float32, bfloat16, bool, a view at an offset) succeeds, both tensors are COW
(torch._C._is_cow_tensor), memory_allocated() does not change and the clone reads the
original's values; writing the clone materializes it (memory_allocated() grows by the
storage's size, the original keeps its values, the clone is no longer COW); then writing the
original needs no copy (it is the last holder); a clone of a clone keeps the original
values, a clone that outlives its original keeps the values while the freed memory is
reused, and at the end memory_allocated() is back at the baseline.

Why vmm may differ: a storage can be lazily cloned only when the allocator's DataPtr is
simple (a CUDAPluggableAllocator that gives each DataPtr a context of its own cannot be:
_lazy_clone then fails), and materializing copies through the storage's allocator
(Allocator::clone, then copy_data) into a new vmm block.
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20


def cow(t):
    return bool(torch._C._is_cow_tensor(t))


def one(make, name, errors):
    base = torch.cuda.memory_allocated()
    t = make()
    want = t.clone()
    held = torch.cuda.memory_allocated()
    nbytes = t.untyped_storage().nbytes()
    c = torch._lazy_clone(t)
    if torch.cuda.memory_allocated() != held:
        errors.append(f"{name}: _lazy_clone changed memory_allocated() by "
                      f"{torch.cuda.memory_allocated() - held}")
    if not (cow(t) and cow(c)) or not torch.equal(c, want):
        errors.append(f"{name}: after _lazy_clone [t COW, clone COW, clone equal] = "
                      f"{[cow(t), cow(c), torch.equal(c, want)]}")
    cc = torch._lazy_clone(c)  # a clone of a clone: three holders of one block
    c.bitwise_not_() if c.dtype == torch.bool else c.add_(1)
    grew = torch.cuda.memory_allocated() - held
    if grew < nbytes or cow(c):
        errors.append(f"{name}: writing the clone grew memory_allocated() by {grew} (storage "
                      f"{nbytes} bytes), clone still COW: {cow(c)}")
    if not torch.equal(t, want) or not torch.equal(cc, want):
        errors.append(f"{name}: writing the clone changed the original or the clone's clone")
    del cc
    before = torch.cuda.memory_allocated()
    t.zero_()  # the last holder of the shared block: no copy
    if torch.cuda.memory_allocated() != before:
        errors.append(f"{name}: writing the last holder copied "
                      f"({torch.cuda.memory_allocated() - before} bytes)")
    late = torch._lazy_clone(c)
    del t, c
    junk = torch.full((max(nbytes // 4, 1),), -3.0, device="cuda")  # may take t's block
    exp = want.logical_not() if want.dtype == torch.bool else want + 1
    if not torch.equal(late, exp):
        errors.append(f"{name}: a clone that outlived the tensors it was cloned from does not "
                      f"hold their last values")
    del junk, late, want, exp
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"{name}: memory_allocated() is {torch.cuda.memory_allocated()} at the "
                      f"end, {base} before")


def main():
    errors = []
    torch.empty(1, device="cuda")
    if not hasattr(torch, "_lazy_clone") or not hasattr(torch._C, "_is_cow_tensor"):
        print("this torch has no copy-on-write tensors; nothing checked")
        report(errors)
        return
    cases = {
        "float32 4 KiB": lambda: torch.arange(1024, dtype=torch.float32, device="cuda"),
        "float32 64 MiB": lambda: torch.randn(16 * MIB, device="cuda"),
        "bfloat16 3 MiB": lambda: torch.randn(3 * MIB // 2, device="cuda").bfloat16(),
        "bool 1 MiB + 1": lambda: torch.rand(MIB + 1, device="cuda") > 0.5,
        "view at an offset": lambda: torch.randn(4 * MIB, device="cuda")[MIB:3 * MIB],
    }
    for name, make in cases.items():
        try:
            one(make, name, errors)
        except RuntimeError as e:
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    report(errors)


if __name__ == "__main__":
    main()
