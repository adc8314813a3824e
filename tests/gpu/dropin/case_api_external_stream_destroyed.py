"""CUDA streams that belong to other code (CuPy, TensorRT, a custom extension), used by
PyTorch through torch.cuda.ExternalStream and destroyed by their owner while PyTorch still
caches, or still uses, memory allocated on them; and a high-priority torch.cuda.Stream.

With PyTorch's allocator a block keeps its stream only as a key for reuse: nothing is queued
on that stream when the block is freed, when empty_cache() runs or when another stream
allocates (events are recorded only on streams named by record_stream, at the free). So,
4 rounds of: a raw stream made with cudaStreamCreate (torch.cuda.cudart()) and wrapped in
ExternalStream; on it tensors of 4 KiB to 48 MiB are made and computed on, and a
caching_allocator_alloc block is made on it (stream=its handle) and written; the stream is
synchronized and destroyed with cudaStreamDestroy while (a) some of those tensors are already
freed (cached for that stream), (b) one tensor is still live and is then used and freed on the
default stream, and (c) the raw block is deleted only afterwards; then the default stream, a
new raw stream (the driver may hand out the same handle again) and a
torch.cuda.Stream(priority=-1) allocate the same sizes and compute; in odd rounds
empty_cache() runs with the dead stream's blocks cached. Every value is right, and at the end
memory_allocated() is back at the baseline.

Why vmm may differ: vmm tags cached blocks with their stream and, to give one stream's
cached blocks to another, asks whether those streams capture a graph and records events on
them (allocator/stream_reclaim.cc, Reclaim), which for a destroyed stream are calls on a dead
handle; its free and empty_cache may touch a block's stream as well.
"""
import ctypes
import faulthandler

import torch
from dropin_report import report
from raw_memory import wrap

MIB = 1 << 20
SIZES = (1024, 300_000, 3 * MIB, 12 * MIB)  # float32 elements: 4 KiB to 48 MiB
RAW = 5 * MIB + 4096


def raw_stream(cudart):
    handle = ctypes.c_void_p(0)
    err = cudart.cudaStreamCreate(ctypes.addressof(handle))
    if int(err) != 0 or not handle.value:
        raise RuntimeError(f"cudaStreamCreate failed: {err}")
    return handle.value


def destroy(cudart, handle):
    err = cudart.cudaStreamDestroy(handle)
    if int(err) != 0:
        raise RuntimeError(f"cudaStreamDestroy failed: {err}")


def work(stream, tag, errors, where):
    """Allocates SIZES on `stream`, computes, checks; returns nothing live."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ts = [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(SIZES)]
        outs = [t * 2.0 + tag for t in ts]
        sums = [o.sum() for o in outs]
    stream.synchronize()
    for i, (n, s) in enumerate(zip(SIZES, sums)):
        want = (2.0 * (i + 1) + tag) * n
        if abs(float(s.item()) - want) > 1e-5 * want:
            errors.append(f"{where}: sum of {n} elements is {float(s.item())}, expected {want}")
    del ts, outs, sums


def main():
    faulthandler.enable()
    cudart = torch.cuda.cudart()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    base = torch.cuda.memory_allocated()
    prio = torch.cuda.Stream(priority=-1)
    for rnd in range(4):
        h = raw_stream(cudart)
        ext = torch.cuda.ExternalStream(h)
        ext.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ext):
            cached = [torch.full((n,), 1.0, device="cuda") for n in SIZES]
            for t in cached:
                t.mul_(3.0)
            del t
            live = torch.arange(SIZES[-1], dtype=torch.float32, device="cuda")
            raw = torch.cuda.caching_allocator_alloc(RAW, stream=h)
            raw_t = wrap(raw, RAW // 4)
            raw_t.fill_(0.5)
        ext.synchronize()
        if any(float(t[-1].item()) != 3.0 for t in cached):
            errors.append(f"round {rnd}: a tensor made on the external stream is wrong")
        del cached  # (a) cached for the external stream
        torch.cuda.synchronize()
        destroy(cudart, h)
        del ext

        # (b) a tensor of the dead stream used and freed on the default stream
        live.mul_(2.0)
        want = torch.arange(SIZES[-1], dtype=torch.float32, device="cuda") * 2.0
        if not torch.equal(live, want):
            errors.append(f"round {rnd}: the live tensor of the destroyed stream differs in "
                          f"{int((live != want).sum().item())} elements")
        del live, want
        # (c) the raw block of the dead stream, read on the default stream, then deleted
        if float(raw_t.sum().item()) != 0.5 * (RAW // 4):
            errors.append(f"round {rnd}: the raw block of the destroyed stream changed")
        del raw_t
        try:
            torch.cuda.caching_allocator_delete(raw)
        except Exception as e:  # noqa: BLE001
            errors.append(f"round {rnd}: caching_allocator_delete of a block made on a "
                          f"destroyed stream: {type(e).__name__}: {str(e)[:200]}")
        if rnd % 2 == 1:
            torch.cuda.empty_cache()

        work(torch.cuda.current_stream(), 1.0, errors, f"round {rnd}, default stream")
        h2 = raw_stream(cudart)
        work(torch.cuda.ExternalStream(h2), 2.0, errors, f"round {rnd}, a new raw stream")
        torch.cuda.synchronize()
        destroy(cudart, h2)
        work(prio, 3.0, errors, f"round {rnd}, a priority -1 stream")
        if errors:
            break
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"at the end memory_allocated is {torch.cuda.memory_allocated()}, "
                      f"{base} at the start")
    t = torch.full((SIZES[-1],), 4.0, device="cuda")
    if float(t.sum().item()) != 4.0 * SIZES[-1]:
        errors.append("a tensor made at the end is wrong")
    report(errors)


if __name__ == "__main__":
    main()
