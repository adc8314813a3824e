"""What NVIDIA's management library (NVML: nvidia-smi, DCGM, cluster GPU monitors, and
torch.cuda.list_gpu_processes() / device_memory_used()) reports for this process as it takes
and gives back memory: operators and schedulers read it to see which job holds a GPU.
# EXCLUSIVE (reads the GPU's used memory through NVML, which other processes would disturb)

With PyTorch's allocator (cudaMalloc'd segments, attributed to the process that made them):
a 2 GiB tensor, written, raises the GPU's used memory by at least 1.9 GiB as NVML reports it
(nvmlDeviceGetMemoryInfo, and device_memory_used() where pynvml is installed) and as
mem_get_info() reports it; where NVML lists this process (a container's PID namespace may
hide it: then that part is not checked) its usedGpuMemory, and its line in
list_gpu_processes(), grow by as much; after del and empty_cache() all of them fall back by
at least 1.9 GiB. list_gpu_processes() is a string that starts with "GPU:" (or says pynvml
is missing).

Why vmm may differ: vmm's memory is physical chunks (cuMemCreate) mapped into a virtual range
it reserved at start; NVML must count them for this process, and empty_cache() must unmap
and release them.
"""
import ctypes
import os
import re
import time

import torch
from dropin_report import report

GIB = 1 << 30


class ProcInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]


class MemInfo(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def nvml_handle():
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, None
    if nvml.nvmlInit_v2() != 0:
        return None, None
    h = ctypes.c_void_p()
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))
    if not uuid or nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode(), ctypes.byref(h)):
        if nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)):
            return None, None
    return nvml, h


def reading(nvml, h):
    """(device used bytes, this process's used bytes or None, list_gpu_processes MB or None)."""
    torch.cuda.synchronize()
    time.sleep(0.5)  # NVML's per-process figures are sampled
    mem = MemInfo()
    dev = nvml.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) == 0 and mem.used or None
    mine = None
    count, procs = ctypes.c_uint(256), (ProcInfo * 256)()
    fn = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None)
    if fn is not None and fn(h, ctypes.byref(count), procs) == 0:
        for p in procs[:count.value]:
            if p.pid == os.getpid() and p.used < (1 << 63):
                mine = p.used
    try:
        text = torch.cuda.list_gpu_processes()
    except Exception as e:  # noqa: BLE001  (pynvml present but refused by NVML here)
        text = f"GPU: list_gpu_processes() raised {type(e).__name__}"
    m = re.search(rf"process\s+{os.getpid()}\s+uses\s+([0-9.]+) MB", text)
    return dev, mine, (float(m.group(1)) * (1 << 20) if m else None), text


def main():
    errors = []
    torch.empty(1, device="cuda")
    torch.cuda.empty_cache()
    nvml, h = nvml_handle()
    if nvml is None:
        print("NVML cannot be opened here; nothing checked")
        report(errors)
        return
    before = reading(nvml, h)
    if not (before[3].startswith("GPU:") or "pynvml" in before[3]):
        errors.append(f"list_gpu_processes() returned {before[3][:120]!r}")
    free0 = torch.cuda.mem_get_info()[0]
    t = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    held = reading(nvml, h)
    free1 = torch.cuda.mem_get_info()[0]
    del t
    torch.cuda.empty_cache()
    after = reading(nvml, h)
    free2 = torch.cuda.mem_get_info()[0]
    names = ("NVML's device used memory", "NVML's usedGpuMemory of this process",
             "this process's line in list_gpu_processes()")
    for i, name in enumerate(names):
        if before[i] is None or held[i] is None or after[i] is None:
            print(f"{name}: not available here; not checked")
            continue
        if held[i] - before[i] < 1.9 * GIB:
            errors.append(f"{name} rose by {held[i] - before[i]} bytes for a 2 GiB tensor")
        if held[i] - after[i] < 1.9 * GIB:
            errors.append(f"{name} fell by {held[i] - after[i]} bytes after del and "
                          f"empty_cache()")
    if free0 - free1 < 1.9 * GIB or free2 - free1 < 1.9 * GIB:
        errors.append(f"mem_get_info()'s free memory: {free0} before, {free1} with the 2 GiB "
                      f"tensor, {free2} after del and empty_cache()")
    try:
        used = torch.cuda.device_memory_used()
        if before[0] is not None and abs(used - after[0]) > 0.5 * GIB:
            errors.append(f"device_memory_used() is {used}, NVML said {after[0]}")
    except Exception as e:  # noqa: BLE001  (no pynvml, or NVML refuses: nothing to compare)
        print(f"device_memory_used() is not available here ({type(e).__name__}); not checked")
    nvml.nvmlShutdown()
    report(errors)


if __name__ == "__main__":
    main()
