"""Legacy CUDA IPC of tensor memory done by hand, as vLLM's and SGLang's custom all-reduce
register the buffers a CUDA graph captured (get_graph_buffer_ipc_meta: the allocation's base
from cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR), then cudaIpcGetMemHandle
of that base, the handle and the offset sent to the other ranks, which cudaIpcOpenMemHandle
it) and as code that shares torch memory through CuPy's ipcGetMemHandle does.

With PyTorch's allocator every tensor lies in memory of cudaMalloc (a segment of the caching
allocator), so, through the driver API (libcuda): cuPointerGetAttribute says the tensor's
pointer is device memory (CU_MEMORYTYPE_DEVICE) of its device, the range it reports
(RANGE_START_ADDR / RANGE_SIZE, and cuMemGetAddressRange) holds the whole tensor and
IS_LEGACY_CUDA_IPC_CAPABLE is true; cuIpcGetMemHandle of the range's base succeeds; a
spawned process opens each handle (cuIpcOpenMemHandle), reads the tensor's first and last 16
values at base + offset (cuMemcpyDtoH), writes 16 values at its start and closes the handle;
the parent's tensor then holds those 16 values and is otherwise unchanged. Tensors: 4 KiB and
3 MiB (inside larger segments), 64 MiB, and 200 MiB made after three cached 96 MiB blocks
were freed (where memory coalesced across growths could serve it).

Why vmm may differ: vmm's memory is physical chunks made with cuMemCreate and mapped with
cuMemMap into a reserved range. Memory of the virtual memory management API is not legacy IPC
capable (cuIpcGetMemHandle refuses it; vmm shares through its own descriptors of fabric or
POSIX fd handles), and the range the driver reports for a pointer is its mapping or its
reservation, which need not be what holds the tensor (a tensor may span two chunks).
"""
import ctypes

import torch
import torch.multiprocessing as mp
from dropin_report import report
from libcuda import (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_MEMORYTYPE_DEVICE,
                     CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                     CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                     CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                     CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, IpcMemHandle, driver,
                     read_and_mark)

MIB = 1 << 20
MARK = 12345.0
def attribute(cu, attr, ptr):
    """(CUresult, value) of cuPointerGetAttribute; the value read from a zeroed 8-byte buffer
    (the attributes asked here are 1, 4 or 8 bytes wide)."""
    out = ctypes.c_uint64(0)
    rc = cu["attr"](ctypes.byref(out), attr, ptr)
    return rc, out.value


def pattern(i):
    return float(i % 4093)


def child(jobs, reply):
    errs = []
    opened = {}
    try:
        torch.empty(1, device="cuda")  # the primary context, current on this thread
        torch.cuda.synchronize()
        cu = driver()
        for name, handle, offset, numel in jobs:
            if handle not in opened:
                dptr = ctypes.c_uint64(0)
                h = IpcMemHandle.from_buffer_copy(handle)
                rc = cu["open"](ctypes.byref(dptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                if rc != 0:
                    errs.append(f"{name}: cuIpcOpenMemHandle returned CUresult {rc}")
                    continue
                opened[handle] = dptr.value
            errs += [f"{name}: {e}" for e in
                     read_and_mark(cu, opened[handle] + offset, numel, pattern, MARK)]
        torch.cuda.synchronize()  # the copies above are done before the parent looks
        for dptr in opened.values():
            rc = cu["close"](dptr)
            if rc != 0:
                errs.append(f"cuIpcCloseMemHandle returned CUresult {rc}")
    except Exception as e:  # noqa: BLE001
        errs.append(f"child: {type(e).__name__}: {e}")
    reply.put(errs)


def main():
    errors = []
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    cu = driver()
    keep = {}
    pad = torch.empty(100_000, dtype=torch.uint8, device="cuda")  # later tensors at an offset
    for name, nbytes in (("4 KiB tensor", 4096), ("3 MiB tensor", 3 * MIB),
                         ("64 MiB tensor", 64 * MIB)):
        keep[name] = torch.empty(nbytes // 4, device="cuda")
    cached = [torch.empty(96 * MIB // 4, device="cuda") for _ in range(3)]
    del cached
    keep["200 MiB tensor"] = torch.empty(200 * MIB // 4, device="cuda")
    for t in keep.values():
        t.copy_((torch.arange(t.numel(), device="cuda") % 4093).float())
    torch.cuda.synchronize()

    jobs = []
    for name, t in keep.items():
        ptr, nbytes = t.data_ptr(), t.numel() * 4
        rc, kind = attribute(cu, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if rc != 0 or kind != CU_MEMORYTYPE_DEVICE:
            errors.append(f"{name}: memory type {kind} (CUresult {rc}), expected device memory")
        rc, ordinal = attribute(cu, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if rc != 0 or ordinal != device:
            errors.append(f"{name}: device ordinal {ordinal} (CUresult {rc}), expected {device}")
        rc1, start = attribute(cu, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
        rc2, size = attribute(cu, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
        if rc1 != 0 or rc2 != 0:
            errors.append(f"{name}: RANGE_START_ADDR / RANGE_SIZE: CUresult {rc1}, {rc2}")
            continue
        if not start <= ptr or ptr + nbytes > start + size:
            errors.append(f"{name}: the range the driver reports for its pointer, "
                          f"[{start:#x}, +{size}), does not hold the tensor [{ptr:#x}, +{nbytes})")
        base, length = ctypes.c_uint64(0), ctypes.c_size_t(0)
        rc = cu["range"](ctypes.byref(base), ctypes.byref(length), ptr)
        if rc != 0:
            errors.append(f"{name}: cuMemGetAddressRange returned CUresult {rc}")
        elif not base.value <= ptr or ptr + nbytes > base.value + length.value:
            errors.append(f"{name}: cuMemGetAddressRange gives [{base.value:#x}, "
                          f"+{length.value}), which does not hold the tensor")
        rc, capable = attribute(cu, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
        if rc == 0 and not capable:
            errors.append(f"{name}: IS_LEGACY_CUDA_IPC_CAPABLE is false for its memory")
        handle = IpcMemHandle()
        rc = cu["get"](ctypes.byref(handle), start)
        if rc != 0:
            errors.append(f"{name}: cuIpcGetMemHandle of its allocation's base returned "
                          f"CUresult {rc}")
            continue
        jobs.append((name, ctypes.string_at(ctypes.addressof(handle), 64), ptr - start,
                     t.numel()))

    if jobs:
        ctx = mp.get_context("spawn")
        reply = ctx.Queue()
        p = ctx.Process(target=child, args=(jobs, reply), daemon=True)
        p.start()
        try:
            errors += reply.get(timeout=120)
        except Exception as e:  # noqa: BLE001
            errors.append(f"no answer from the child: {type(e).__name__}: {e}")
        p.join(30)
        torch.cuda.synchronize()
        for name, handle, offset, numel in jobs:
            t = keep[name]
            head = t[:16].tolist()
            if head != [MARK + i for i in range(16)]:
                errors.append(f"{name}: after the child's write through the IPC handle its first "
                              f"values are {head[:4]}..., expected {MARK}...")
            want_tail = [pattern(numel - 16 + i) for i in range(16)]
            if t[-16:].tolist() != want_tail:
                errors.append(f"{name}: its last values changed")
    del pad
    report(errors)


if __name__ == "__main__":
    main()
