"""Which CUDA calls a graph capture in global mode survives, on this machine's driver.

    python3 tests/gpu/capture_safe_calls.py [HANDLE_TYPE]    (1: POSIX fd, the default; 8: fabric)

vmm keeps work that could invalidate a capture out of capture windows (allocator/
capture_window.h). This says which of the calls it makes do: for each, a capture of
`y = x * 2; <the call>; y = y + 1` in PyTorch's default (global) mode, then a replay. One line
per call: `ok` (the capture and the replay's result survive), `capture broken: ...` or `call
failed: ...`. The virtual memory calls run through libcuda by ctypes, on resources made before
the capture. Exit status 0 once every call has been tried; the verdicts are for a reader.
"""
import ctypes
import sys

import torch

cu = ctypes.CDLL("libcuda.so.1")
SIZE = 2 << 20  # the H200's allocation granularity


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what}: CUresult {result}")


prop = AllocProp(type=1, requestedHandleTypes=int(sys.argv[1]) if len(sys.argv) > 1 else 1,
                 location=Location(type=1, id=0))
access = AccessDesc(location=Location(type=1, id=0), flags=3)  # read and write


def create():
    handle = ctypes.c_ulonglong()
    check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(SIZE), ctypes.byref(prop),
                         ctypes.c_ulonglong(0)), "cuMemCreate")
    return handle


def reserve():
    ptr = ctypes.c_ulonglong()
    check(cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(SIZE), ctypes.c_size_t(0),
                                 ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)),
          "cuMemAddressReserve")
    return ptr


def map_range(ptr, handle):
    check(cu.cuMemMap(ptr, ctypes.c_size_t(SIZE), ctypes.c_size_t(0), handle,
                      ctypes.c_ulonglong(0)), "cuMemMap")


def grant(ptr):
    check(cu.cuMemSetAccess(ptr, ctypes.c_size_t(SIZE), ctypes.byref(access), ctypes.c_size_t(1)),
          "cuMemSetAccess")


def reserved_and_created():
    return create(), reserve()


def mapped():
    handle, ptr = reserved_and_created()
    map_range(ptr, handle)
    return handle, ptr


def mapped_and_granted():
    handle, ptr = mapped()
    grant(ptr)
    return handle, ptr


def recorded_event():
    event = torch.cuda.Event()
    event.record(side)
    return event


def probe(name, prepare, call):
    state = prepare()
    graph = torch.cuda.CUDAGraph()
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    verdict = "ok"
    try:
        with torch.cuda.graph(graph):
            y = x * 2
            try:
                call(state)
            except Exception as e:  # the call itself refused: say so, keep the capture going
                verdict = f"call failed: {e}"
            y = y + 1
        graph.replay()
        torch.cuda.synchronize()
        if verdict == "ok" and not bool((y == 3).all()):
            verdict = "wrong result after replay"
    except Exception as e:
        verdict = f"capture broken: {str(e).splitlines()[0][:90]}"
        torch.cuda.synchronize()
    print(f"{name:32s} {verdict}", flush=True)


torch.zeros(1, device="cuda")
side = torch.cuda.Stream()
probe("cuMemCreate", lambda: None, lambda _: create())
probe("cuMemAddressReserve", lambda: None, lambda _: reserve())
probe("cuMemMap", reserved_and_created, lambda s: map_range(s[1], s[0]))
probe("cuMemSetAccess", mapped, lambda s: grant(s[1]))
probe("cuMemUnmap", mapped_and_granted,
      lambda s: check(cu.cuMemUnmap(s[1], ctypes.c_size_t(SIZE)), "cuMemUnmap"))
probe("cuMemRelease (unmapped handle)", create, lambda h: check(cu.cuMemRelease(h), "cuMemRelease"))
probe("cuMemRelease (mapped handle)", mapped_and_granted,
      lambda s: check(cu.cuMemRelease(s[0]), "cuMemRelease"))
probe("cuMemAddressFree", reserve,
      lambda p: check(cu.cuMemAddressFree(p, ctypes.c_size_t(SIZE)), "cuMemAddressFree"))
probe("event record, another stream", lambda: None, lambda _: recorded_event())
probe("event query, another stream", recorded_event, lambda e: e.query())
probe("synchronize another stream", lambda: None, lambda _: side.synchronize())
probe("synchronize the device", lambda: None, lambda _: torch.cuda.synchronize())
