"""CUDA tensors made inside torch.cuda.MemPool contexts handed to another process: a MemPool of
the allocator's own (a KV cache or a weight buffer kept in a pool of its own) and a MemPool over
a program's own allocator (a CUDAPluggableAllocator over cuMemAlloc, as counted_allocator.py
builds it: the kind of pool docs/DESIGN.md §2g recommends for buffers that must be legacy-IPC
capable, and what NCCL's and vLLM's pools are), sent through a torch.multiprocessing Queue to a
spawned worker (weights handed to an inference or evaluation process); and, for the pool over
the program's allocator, the same buffers shared by hand with cuIpcGetMemHandle of the
allocation's base (vLLM's and SGLang's custom all-reduce registering buffers).

With PyTorch's allocator every tensor of a MemPool is a block of a cudaMalloc / cuMemAlloc
segment that the allocator knows (its pool's segment, from its own cudaMalloc or from the
program's allocator): Queue.put sends it as any CUDA tensor (storage._share_cuda_ ->
shareIpcHandle: cudaIpcGetMemHandle of the segment's base, the block's offset in it) and the
receiver opens the handle (getIpcDevPtr: cudaIpcOpenMemHandle). So, for tensors of 16 KiB to
8 MiB in the default MemPool and of 3, 3 (the same segment, 3 MiB in) and 12 MiB in the pool over cuMemAlloc, kept alive
together by the worker (each lies in
its pool's snapshot): the worker receives each with its values, writes 16 marker values at its
start, and the parent sees them there, its other values unchanged. Through the driver API the
pool-over-cuMemAlloc tensors (4 KiB and 40 MiB) report a range (RANGE_START_ADDR /
RANGE_SIZE) that holds them, cuIpcGetMemHandle of the range's base succeeds, and the worker
that opens it reads their first and last values and writes 16 values that the parent sees.

Why vmm may differ: a MemPool is a vmm private pool, whose blocks are sent as vmm descriptors
(in place, from a pool made to export); a MemPool over another allocator is served from that
allocator's segments (foreign_segments.h), which are not vmm memory: vmm's reducer hands such
a tensor to PyTorch's (SEND_NOT_VMM), whose _share_cuda_ asks the current allocator, vmm's, for
an IPC handle (VmmAllocator::shareIpcHandle exports vmm blocks only), and a receiver with vmm
current opens handles as vmm descriptors (getIpcDevPtr): the send fails in the queue's feeder
thread or in the receiver, where PyTorch's allocator shares the segment.
"""
import ctypes
import queue as queue_mod

import torch
import torch.multiprocessing as mp
from counted_allocator import CountedAllocator
from dropin_report import in_pool, report
from libcuda import (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                     CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, IpcMemHandle, driver,
                     read_and_mark)

KIB, MIB = 1 << 10, 1 << 20
MARK = 4321.0


def pattern(i, k):
    return float((i * 7 + k) % 1021)


def filled(numel, k):
    return ((torch.arange(numel, device="cuda") * 7 + k) % 1021).float()


def child(q, reply):
    """Takes ("tensor", name, k, t) and ("ipc", name, k, handle, offset, numel) messages until
    ("end",); answers {name: [errors]} (an empty list: all right)."""
    results = {}
    opened = {}
    kept = []  # received tensors stay alive together (two of them share one segment)
    cu = None
    try:
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        while True:
            try:
                msg = q.get(timeout=20)
            except queue_mod.Empty:
                results["<queue>"] = ["no message (or no end marker) within 20 s"]
                break
            except Exception as e:  # noqa: BLE001  (an error a send delivered in its place)
                results.setdefault("<queue>", []).append(f"get raised {type(e).__name__}: "
                                                         f"{str(e)[:300]}")
                continue
            if msg[0] == "end":
                break
            if msg[0] == "tensor":
                _, name, k, t = msg
                errs = results.setdefault(name, [])
                try:
                    n = t.numel()
                    head, tail = t[:16].tolist(), t[-16:].tolist()
                    if head != [pattern(i, k) for i in range(16)] or \
                            tail != [pattern(n - 16 + i, k) for i in range(16)]:
                        errs.append(f"received values {head[:3]}... / {tail[-3:]}, expected "
                                    f"{[pattern(i, k) for i in range(3)]}...")
                    t[:16] = MARK + torch.arange(16, device="cuda", dtype=t.dtype)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    errs.append(f"using the received tensor: {type(e).__name__}: {e}")
                kept.append(t)
                continue
            _, name, k, handle, offset, numel = msg
            errs = results.setdefault(name, [])
            if cu is None:
                cu = driver()
            if handle not in opened:
                dptr = ctypes.c_uint64(0)
                rc = cu["open"](ctypes.byref(dptr), IpcMemHandle.from_buffer_copy(handle),
                                CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                if rc != 0:
                    errs.append(f"cuIpcOpenMemHandle returned CUresult {rc}")
                    continue
                opened[handle] = dptr.value
            errs += read_and_mark(cu, opened[handle] + offset, numel,
                                  lambda i, k=k: pattern(i, k), MARK)
        torch.cuda.synchronize()
        kept.clear()
        for dptr in opened.values():
            cu["close"](dptr)
    except Exception as e:  # noqa: BLE001
        results.setdefault("<child>", []).append(f"{type(e).__name__}: {e}")
    reply.put(results)


def main():
    errors = []
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    lib = CountedAllocator()
    own_pool = torch.cuda.MemPool()
    custom_pool = torch.cuda.MemPool(lib.pluggable.allocator())
    sent = {}  # name -> (pool, tensor, k)
    with torch.cuda.use_mem_pool(own_pool):
        for k, (name, nbytes) in enumerate((("MemPool 16 KiB", 16 * KIB),
                                            ("MemPool 8 MiB", 8 * MIB))):
            sent[name] = (own_pool, filled(nbytes // 4, k), k)
    by_hand = {}
    with torch.cuda.use_mem_pool(custom_pool):
        # Sizes whose segments are not those of the tensors shared by hand below.
        # The two 3 MiB tensors share one 20 MiB segment (the second 3 MiB into it).
        for k, (name, nbytes) in enumerate((("custom-pool 3 MiB", 3 * MIB),
                                            ("custom-pool 3 MiB, second", 3 * MIB),
                                            ("custom-pool 12 MiB", 12 * MIB)), start=10):
            sent[name] = (custom_pool, filled(nbytes // 4, k), k)
        for k, (name, nbytes) in enumerate((("custom-pool 4 KiB (by hand)", 4 * KIB),
                                            ("custom-pool 40 MiB (by hand)", 40 * MIB)),
                                           start=20):
            by_hand[name] = (filled(nbytes // 4, k), k)
    torch.cuda.synchronize()
    if lib.n_alloc == 0:
        errors.append("the allocator of the MemPool over cuMemAlloc was never called")
    for name, (pool, t, _) in sent.items():
        if not in_pool(pool, t):
            errors.append(f"{name}: the tensor is not in its pool's snapshot")

    cu = driver()
    jobs = []
    for name, (t, k) in by_hand.items():
        ptr, nbytes = t.data_ptr(), t.numel() * 4
        start, size = ctypes.c_uint64(0), ctypes.c_uint64(0)
        rc1 = cu["attr"](ctypes.byref(start), CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
        rc2 = cu["attr"](ctypes.byref(size), CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
        if rc1 != 0 or rc2 != 0:
            errors.append(f"{name}: RANGE_START_ADDR / RANGE_SIZE: CUresult {rc1}, {rc2}")
            continue
        if not start.value <= ptr or ptr + nbytes > start.value + size.value:
            errors.append(f"{name}: the range the driver reports, [{start.value:#x}, "
                          f"+{size.value}), does not hold the tensor [{ptr:#x}, +{nbytes})")
            continue
        handle = IpcMemHandle()
        rc = cu["get"](ctypes.byref(handle), start.value)
        if rc != 0:
            errors.append(f"{name}: cuIpcGetMemHandle of its allocation's base: CUresult {rc}")
            continue
        jobs.append(("ipc", name, k, ctypes.string_at(ctypes.addressof(handle), 64),
                     ptr - start.value, t.numel()))

    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    put_ok = set()
    for name, (_, t, k) in sent.items():
        try:
            q.put(("tensor", name, k, t))
            put_ok.add(name)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{name}: Queue.put raised {type(e).__name__}: {str(e)[:300]}")
    for job in jobs:
        q.put(job)
    q.put(("end",))
    try:
        results = reply.get(timeout=35)
    except Exception as e:  # noqa: BLE001
        results = {"<child>": [f"no answer from the worker: {type(e).__name__}: {e}"]}
    p.join(10)
    if p.is_alive():
        p.kill()
    for name, errs in results.items():
        errors += [f"{name}: {e}" for e in errs]
    torch.cuda.synchronize()
    marked = [MARK + i for i in range(16)]
    checks = [(name, t, k) for name, (_, t, k) in sent.items() if name in put_ok]
    checks += [(job[1], by_hand[job[1]][0], job[2]) for job in jobs]
    for name, t, k in checks:
        if name not in results:
            errors.append(f"{name}: never reached the worker")
            continue
        if results[name]:
            continue
        if t[:16].tolist() != marked:
            errors.append(f"{name}: the worker's write is not in the parent's tensor (first "
                          f"values {t[:3].tolist()})")
        n = t.numel()
        if t[-16:].tolist() != [pattern(n - 16 + i, k) for i in range(16)]:
            errors.append(f"{name}: the parent's tensor lost its last values")
    t = None
    del sent, by_hand, checks, t
    del own_pool, custom_pool
    torch.cuda.synchronize()
    lib.close()
    report(errors)


if __name__ == "__main__":
    main()
