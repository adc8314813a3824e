"""CUDA graphs captured on a stream that belongs to other code: torch.cuda.ExternalStream over
a stream made with the driver (cuStreamCreate, non-blocking), as a serving stack that runs
PyTorch on a TensorRT, CuPy or Triton-server stream captures its decode step there.

With PyTorch's allocator a capture's allocations go to the graph's private pool whatever
stream object is current (the pool's filter matches the capture by its id): blocks freed
during the capture (4 and 32 MiB temporaries) serve its later allocations; a second graph
captured on the same stream into the first's pool (pool=g1.pool()) reads the first's output;
a third captured there in capture_error_mode="thread_local" has a pool of its own; replays
give the eager values for every input while the default stream allocates, writes and empties
the cache between them; eager work on the external stream after the captures is right; once
the graphs and their outputs are dropped memory_allocated() is back at the baseline, and
after the owner destroys the stream the program allocates on.

Why vmm may differ: an allocation on a stream that is not one of PyTorch's own (an
ExternalStream has an even stream id) is marked foreign (torch_plugin/csrc/pool_stream.h):
vmm makes no driver call on it after the allocation and keeps its freed blocks for that
marked stream until a device synchronisation, here inside a private pool that the capture's
route (the filter, called with the unmarked stream) chose.
"""
import ctypes
import gc

import torch
from dropin_report import report

N = 1 << 20


def driver_stream():
    cu = ctypes.CDLL("libcuda.so.1")
    create = cu.cuStreamCreate
    create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    create.restype = ctypes.c_int
    destroy = getattr(cu, "cuStreamDestroy_v2", None) or cu.cuStreamDestroy
    destroy.argtypes = [ctypes.c_void_p]
    destroy.restype = ctypes.c_int
    h = ctypes.c_void_p(0)
    rc = create(ctypes.byref(h), 1)  # CU_STREAM_NON_BLOCKING
    if rc == 0 and h.value:
        return h.value, lambda: destroy(h.value)
    print(f"cuStreamCreate: CUresult {rc}; the stream is made with cudaStreamCreate instead")
    cudart = torch.cuda.cudart()
    err = cudart.cudaStreamCreate(ctypes.addressof(h))
    if int(err) != 0 or not h.value:
        raise RuntimeError(f"cudaStreamCreate failed: {err}")
    return h.value, lambda: int(cudart.cudaStreamDestroy(h.value))


def f1(x):
    tmp = x * 2
    wide = tmp.repeat(8)  # 32 MiB, made after the 4 MiB temporary
    del tmp
    return wide.view(8, -1).sum(0) + 1  # 16 x + 1


def f2(a, x):
    t = a * 3
    return t - x, t.sum()  # 47 x + 3, N (48 x + 3)


def main():
    errors = []
    torch.empty(1, device="cuda")
    handle, destroy = driver_stream()
    ext = torch.cuda.ExternalStream(handle)
    x = torch.zeros(N, device="cuda")
    ext.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ext):  # warm-up on the capturing stream, as PyTorch asks
        for _ in range(2):
            f2(f1(x), x)
    torch.cuda.current_stream().wait_stream(ext)
    warm = torch.cuda.CUDAGraph()
    with torch.cuda.graph(warm, stream=ext):  # the first capture sets up RNG graph state
        f1(x)
    del warm
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    g1, g2, g3 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=ext):
        a = f1(x)
    with torch.cuda.graph(g2, pool=g1.pool(), stream=ext):
        c, s = f2(a, x)
    with torch.cuda.graph(g3, stream=ext, capture_error_mode="thread_local"):
        d = f1(x) * 2
    for rnd, v in enumerate((1.0, -2.0, 0.5, 3.0)):
        x.fill_(v)
        g1.replay()
        g2.replay()
        g3.replay()
        junk = [torch.full((N,), -7.0, device="cuda") for _ in range(8)]
        junk.append(torch.full((8 * N,), -9.0, device="cuda"))
        del junk
        if rnd % 2:
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        for name, out, want in (("a", a, 16 * v + 1), ("c", c, 47 * v + 3),
                                ("d", d, 32 * v + 2)):
            bad = int((out != want).sum().item())
            if bad:
                errors.append(f"input {v}: {bad} elements of {name} are not {want} after the "
                              f"replays of graphs captured on the external stream")
        if abs(float(s.item()) - N * (48 * v + 3)) > 1e-5 * abs(N * (48 * v + 3)):
            errors.append(f"input {v}: the sum is {float(s.item())}, expected {N * (48 * v + 3)}")
    ext.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ext):
        e = f1(x)
        e2, es = f2(e, x)
    ext.synchronize()
    if not bool((e2 == 47 * 3.0 + 3).all().item()):
        errors.append("eager work on the external stream after the captures is wrong")
    del g1, g2, g3, a, c, s, d, e, e2, es, out
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"with the graphs and their outputs gone memory_allocated() is "
                      f"{torch.cuda.memory_allocated()}, was {base}")
    del ext
    rc = destroy()
    if rc != 0:
        errors.append(f"cuStreamDestroy of the external stream: CUresult {rc}")
    t = torch.full((3 * N,), 5.0, device="cuda")
    torch.cuda.empty_cache()
    if float(t.sum(dtype=torch.float64).item()) != 15.0 * N:
        errors.append("a tensor made after the external stream was destroyed is wrong")
    report(errors)


if __name__ == "__main__":
    main()
