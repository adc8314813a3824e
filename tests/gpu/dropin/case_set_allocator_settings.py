"""torch.cuda.memory._set_allocator_settings at run time (libraries such as vLLM call it to
switch expandable segments on and off around their own allocations), and
torch.cuda.get_allocator_backend().

With PyTorch's allocator: after CUDA is in use, _set_allocator_settings(
"expandable_segments:True") and later ("expandable_segments:False") are accepted, and
tensors allocated under either setting are right and freed back to the baseline;
get_allocator_backend() returns a string.

Why vmm may differ: the settings go to PyTorch's allocator configuration while vmm's
allocator is current; vmm may refuse them or be confused by them.
"""

import torch
from dropin_report import report

MIB = 1 << 20


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    errors = []
    backend = torch.cuda.get_allocator_backend()
    if not isinstance(backend, str):
        errors.append(f"get_allocator_backend() returned {backend!r}")
    keep = []
    for setting in ("expandable_segments:True", "expandable_segments:False",
                    "expandable_segments:True", "garbage_collection_threshold:0.9"):
        try:
            torch.cuda.memory._set_allocator_settings(setting)
        except Exception as e:  # noqa: BLE001
            errors.append(f"_set_allocator_settings({setting!r}): {type(e).__name__}: {e}")
            continue
        ts = [torch.full((n,), 2.0, device="cuda") for n in (100, 300_000, 5 * MIB, 33 * MIB)]
        sums = [float(t.sum().item()) for t in ts]
        want = [200.0, 600_000.0, 10.0 * MIB, 66.0 * MIB]
        if any(abs(s - w) > 1e-5 * w for s, w in zip(sums, want)):
            errors.append(f"{setting}: sums {sums}")
        keep.append(ts[1])
        del ts
    del keep
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"memory_allocated {torch.cuda.memory_allocated()} != {base} at the end")
    report(errors)


if __name__ == "__main__":
    main()
