"""torch.profiler with profile_memory=True: the CUDA memory events that the allocator reports
to the profiler (what `prof.key_averages().table(sort_by="self_cuda_memory_usage")`,
the "[memory]" rows of a Chrome/Perfetto trace, TensorBoard's memory view and
`export_memory_timeline` are built from), and the "[OutOfMemory]" event of a request that
fails.

With PyTorch's allocator (its own test_profiler.test_memory_profiler and test_oom_tracing):
every allocation and free reports its bytes to the profiler
(c10::reportMemoryUsageToProfiler in the caching allocator's malloc and free), so inside a
profile with profile_memory=True the record_function range that makes an 8 MiB uint8 tensor
and a 4 MiB float32 tensor has device_memory_usage >= 12 MiB in key_averages(), the range
that drops them <= -12 MiB, and "aten::empty" > 0; the exported trace has "[memory]" events
with "Device Type" 1 (CUDA), "Device Id", "Addr" (the 8 MiB tensor's data_ptr among them) and
"Bytes" (one >= 8 MiB, one <= -8 MiB); a request of 4 TiB raises torch.cuda.OutOfMemoryError
("Tried to allocate") and leaves an "[OutOfMemory]" event with "Device Type", "Device Id"
and "Bytes" in the trace. Afterwards memory_allocated() is back at the baseline.

Why vmm may differ: the profiler hears of device memory only from the allocator's own calls
(c10::reportMemoryUsageToProfiler, c10::reportOutOfMemoryToProfiler); CUDAPluggableAllocator
makes neither, and VmmAllocator's Malloc/Free/OutOfMemory make none of their own, so the
profile would show no CUDA memory at all.
"""
import gc
import json
import os
import tempfile

import torch
from dropin_report import report

MIB = 1 << 20


def usage(evt):
    """An event's device memory usage (inclusive of its children), whatever this torch calls
    it (device_memory_usage since 2.4, cuda_memory_usage before)."""
    for name in ("device_memory_usage", "cuda_memory_usage"):
        if hasattr(evt, name):
            return int(getattr(evt, name))
    return None


def as_int(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value, 0)
        except ValueError:
            return None
    return None


def trace_events(prof, errors, what):
    fd, path = tempfile.mkstemp(suffix=".json", prefix="dropin_profile_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{what}: export_chrome_trace / json.load failed: {type(e).__name__}: {e}")
        return []
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        errors.append(f"{what}: the exported trace has no traceEvents list")
        return []
    return [e for e in events if isinstance(e, dict)]


def main():
    from torch.profiler import profile, record_function

    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    base = torch.cuda.memory_allocated()
    nbytes = 8 * MIB
    ptr = [0]

    with profile(profile_memory=True, record_shapes=True) as prof:
        with record_function("dropin_user_scope_alloc"):
            x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            y = torch.ones(MIB, device="cuda")  # 4 MiB
            ptr[0] = x.data_ptr()
        with record_function("dropin_user_scope_dealloc"):
            del x, y
        gc.collect()
        torch.cuda.synchronize()

    want = nbytes + 4 * MIB
    metrics = {}  # a key may come twice (a range's CPU event and its GPU annotation)
    try:
        for evt in prof.key_averages():
            value = usage(evt)
            if value is not None:
                metrics.setdefault(evt.key, []).append(value)
    except Exception as e:  # noqa: BLE001
        errors.append(f"key_averages() failed: {type(e).__name__}: {e}")
    alloc = max(metrics.get("dropin_user_scope_alloc", [None]) or [None], key=lambda v: v or 0)
    dealloc = min(metrics.get("dropin_user_scope_dealloc", [None]) or [None], key=lambda v: v or 0)
    empty = max(metrics.get("aten::empty", [None]) or [None], key=lambda v: v or 0)
    if alloc is None or alloc < want:
        errors.append(f"device memory usage of the range that allocated {want} bytes of CUDA "
                      f"tensors is {alloc} (the profiler saw no CUDA allocation)")
    if dealloc is None or dealloc > -want:
        errors.append(f"device memory usage of the range that freed {want} bytes of CUDA "
                      f"tensors is {dealloc} (the profiler saw no CUDA free)")
    if empty is None or empty <= 0:
        errors.append(f"device memory usage of aten::empty is {empty}, expected > 0")
    try:
        prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=5)
    except Exception as e:  # noqa: BLE001
        errors.append(f"key_averages().table() failed: {type(e).__name__}: {e}")

    cuda_mem = []
    for evt in trace_events(prof, errors, "profile of the allocations"):
        if evt.get("name") != "[memory]":
            continue
        args = evt.get("args")
        if not isinstance(args, dict):
            errors.append("a [memory] event of the trace has no args")
            break
        missing = [k for k in ("Addr", "Device Type", "Device Id", "Bytes") if k not in args]
        if missing:
            errors.append(f"a [memory] event of the trace lacks {missing}: {args}")
            break
        if as_int(args.get("Device Type")) == 1:  # c10::DeviceType::CUDA
            cuda_mem.append(args)
    if not cuda_mem:
        errors.append("the exported trace has no [memory] event of a CUDA device")
    else:
        sizes = [as_int(a.get("Bytes")) or 0 for a in cuda_mem]
        if max(sizes) < nbytes:
            errors.append(f"no CUDA [memory] event of >= {nbytes} bytes (largest {max(sizes)})")
        if min(sizes) > -nbytes:
            errors.append(f"no CUDA [memory] event of <= -{nbytes} bytes (a free; smallest "
                          f"{min(sizes)})")
        addrs = {as_int(a.get("Addr")) for a in cuda_mem}
        if ptr[0] not in addrs:
            errors.append(f"no CUDA [memory] event has the 8 MiB tensor's address "
                          f"{ptr[0]:#x} as its Addr")

    raised = None
    with profile(profile_memory=True, record_shapes=True) as oom_prof:
        try:
            torch.empty(1024, 1024, 1024, 1024, dtype=torch.float32, device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            raised = e
        except RuntimeError as e:
            raised = e
            errors.append(f"a 4 TiB request raised {type(e).__name__}, not "
                          f"torch.cuda.OutOfMemoryError")
    if raised is None:
        errors.append("a 4 TiB request did not raise")
    elif "ried to allocate" not in str(raised):
        errors.append(f"the out-of-memory message lacks 'Tried to allocate': {str(raised)[:200]}")
    ooms = [e for e in trace_events(oom_prof, errors, "profile of the failed request")
            if e.get("name") == "[OutOfMemory]"]
    if not ooms:
        errors.append("the trace of a profile in which a 4 TiB CUDA request failed has no "
                      "[OutOfMemory] event")
    else:
        args = ooms[0].get("args") if isinstance(ooms[0].get("args"), dict) else {}
        missing = [k for k in ("Device Type", "Device Id", "Bytes") if k not in args]
        if missing:
            errors.append(f"the [OutOfMemory] event lacks {missing}: {args}")

    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after profiling memory_allocated() is {torch.cuda.memory_allocated()}, "
                      f"{base} before")
    report(errors)


if __name__ == "__main__":
    main()
