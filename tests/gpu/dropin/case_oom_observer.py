"""Out of memory as a program sees it: the exception, the OOM observer that training
frameworks attach to dump a snapshot (Megatron-LM, torchtitan), num_ooms and the history.

With PyTorch's allocator a request larger than the GPU (1 TiB) raises
torch.cuda.OutOfMemoryError (a RuntimeError) saying "out of memory"; each failed request adds
at least 1 to memory_stats()["num_ooms"], and an observer attached with
torch._C._cuda_attach_out_of_memory_observer is called as many times, with the device index,
the bytes it tried to get (at least the request) and the GPU's total memory, and may itself call torch.cuda.memory._snapshot() (the allocator's lock is released before
observers run: PyTorch's documented pattern); with history recorded the trace holds an "oom"
entry; memory_allocated() is what it was before, a live tensor is intact, 1 GiB can still be
allocated; reset_accumulated_memory_stats() sets num_ooms back to 0.

Why vmm may differ: vmm raises c10::OutOfMemoryError itself, calls the observers from
VmmAllocator::Malloc (with or without its own locks held), counts num_ooms in its own
DeviceStats and records the "oom" entry in its own trace (alloc_history.h).
"""

import torch
from dropin_report import report


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    errors, calls = [], []

    def observer(device, alloc, device_total, device_free):
        try:
            snap = torch.cuda.memory._snapshot()
            calls.append((device, len(snap["segments"]), alloc, device_total))
        except Exception as e:  # noqa: BLE001
            calls.append(("error", f"{type(e).__name__}: {str(e)[:200]}"))

    total = torch.cuda.mem_get_info()[1]
    torch._C._cuda_attach_out_of_memory_observer(observer)
    keep = torch.full((1 << 20,), 3.0, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    base = torch.cuda.memory_allocated()
    for i in range(3):
        ooms0, calls0 = torch.cuda.memory_stats().get("num_ooms", 0), len(calls)
        try:
            torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
            errors.append(f"attempt {i}: a 1 TiB tensor did not raise")
        except torch.cuda.OutOfMemoryError as e:
            if not isinstance(e, RuntimeError) or "out of memory" not in str(e).lower():
                errors.append(f"attempt {i}: OutOfMemoryError without 'out of memory': {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"attempt {i}: {type(e).__name__} instead of torch.cuda.OutOfMemoryError:"
                          f" {str(e)[:200]}")
        d_ooms = torch.cuda.memory_stats().get("num_ooms", 0) - ooms0
        d_calls = len(calls) - calls0
        if d_ooms < 1:
            errors.append(f"attempt {i}: num_ooms grew by {d_ooms}")
        if d_calls != d_ooms:
            errors.append(f"attempt {i}: the OOM observer was called {d_calls} times, num_ooms "
                          f"grew by {d_ooms}")
    for c in calls:
        if c[0] == "error":
            errors.append(f"torch.cuda.memory._snapshot() inside the OOM observer raised {c[1]}")
        elif c[0] != dev:
            errors.append(f"the OOM observer was given device {c[0]}, expected {dev}")
        else:
            # PyTorch passes the bytes it tried to get and the GPU's total (its memory
            # fraction's share where one is set; none is here).
            if c[2] < 1 << 40:
                errors.append(f"the OOM observer was given {c[2]} bytes asked for, less than "
                              f"the 1 TiB requested")
            if c[3] != total:
                errors.append(f"the OOM observer was given a total of {c[3]} bytes, not the "
                              f"GPU's {total}")
    trace = torch.cuda.memory._snapshot()["device_traces"][dev]
    if not any(e["action"] == "oom" for e in trace):
        errors.append("no 'oom' entry in the memory history after three OOMs")
    torch.cuda.memory._record_memory_history(enabled=None)
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after the OOMs memory_allocated is {torch.cuda.memory_allocated()}, "
                      f"{base} before")
    big = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    if float(keep.sum().item()) != 3.0 * (1 << 20) or int(big.sum().item()) != 1 << 30:
        errors.append("after the OOMs a live tensor changed or a 1 GiB tensor is wrong")
    del big, keep
    torch.cuda.reset_accumulated_memory_stats()
    if torch.cuda.memory_stats().get("num_ooms", 0) != 0:
        errors.append(f"reset_accumulated_memory_stats left num_ooms "
                      f"{torch.cuda.memory_stats()['num_ooms']}")
    report(errors)


if __name__ == "__main__":
    main()
