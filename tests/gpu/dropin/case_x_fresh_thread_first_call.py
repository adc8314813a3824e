"""The allocator's entry points called first by a thread that has never used CUDA: a request
handler of a thread pool, a finalizer or cleanup thread, a library's callback thread. Such a
thread has no CUDA context current, and PyTorch sets the device only where it differs from
the thread's current one (device 0 already), so each call below reaches the allocator from a
thread the driver has seen nothing of.

With PyTorch's allocator (CUDA runtime calls, which make the primary context current as they
need it) each of these, run as the first CUDA call of a new thread, works:
 - caching_allocator_alloc of 300 MiB with the cache empty (new device memory), then
   caching_allocator_delete;
 - torch.empty of 300 MiB, filled and read back;
 - dropping the last reference to a tensor that a side stream still reads behind a GPU sleep
   (recorded there with record_stream): the read still sees its values although the main
   thread then allocates and writes 128 MiB on the default stream;
 - empty_cache() with 256 MiB cached: memory_reserved() falls by at least 200 MiB;
 - memory_stats(), memory_snapshot(), mem_get_info(), memory_summary(): no error, and
   memory_allocated() as the main thread sees it;
 - with caching off (caching_allocator_enable(False)), dropping a 64 MiB tensor made then;
 - gc.collect() collecting reference cycles that hold CUDA tensors;
 - a tensor made inside use_mem_pool of a MemPool the main thread made: it lies in the pool;
 - eight thread-pool workers at once dropping 50 tensors each that the main thread made;
and at the end memory_allocated() is back at its baseline.

Why vmm may differ: vmm drives the device through the driver API (cuMemCreate / cuMemMap /
cuMemSetAccess and cuMemGetInfo at a growth, an event recorded at a recorded free, device
synchronisations for empty_cache and with caching off), several of which need a current
context; it must make one current on every path a contextless thread can take, not only on
those where PyTorch's own calls happened to do it first.
"""
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from dropin_report import baseline, in_pool, memory_back, report, settle

MIB = 1 << 20
SLEEP = 200_000_000  # cycles: about 0.1 s


def in_fresh_thread(fn, errors, name):
    """Runs fn() in a new thread; its result, or None with the error recorded."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")

    th = threading.Thread(target=run, name=name)
    th.start()
    th.join(30)
    if th.is_alive():
        errors.append(f"{name}: the thread did not finish within 30 s")
    return out.get("value")


class Cycle:
    def __init__(self, t):
        self.t = t
        self.me = self


def main():
    errors = []
    torch.empty(1, device="cuda")
    base, res0, count0 = baseline()

    # A raw block that needs new device memory.
    def raw():
        p = torch.cuda.caching_allocator_alloc(300 * MIB)
        grown = torch.cuda.memory_allocated()
        torch.cuda.caching_allocator_delete(p)
        return p, grown

    got = in_fresh_thread(raw, errors, "caching_allocator_alloc of 300 MiB")
    if got is not None:
        p, grown = got
        if not p:
            errors.append("caching_allocator_alloc of 300 MiB in a new thread returned 0")
        if grown - base < 300 * MIB:
            errors.append(f"with a raw 300 MiB block live memory_allocated() grew by "
                          f"{grown - base} bytes")

    # A tensor that needs new device memory.
    def tensor():
        t = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
        t.fill_(9)
        return int(t[0].item()) + int(t[-1].item()) + int(t[150 * MIB].item())

    settle()
    if in_fresh_thread(tensor, errors, "torch.empty of 300 MiB") not in (27, None):
        errors.append("a 300 MiB tensor made in a new thread does not hold what was written")

    # The last reference to a recorded tensor dropped by a new thread.
    x = torch.full((16 * MIB // 4,), 5.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        y = x * 2
    x.record_stream(side)
    holder = [x]
    del x
    in_fresh_thread(holder.clear, errors, "dropping a tensor a side stream still reads")
    junk = [torch.full((16 * MIB // 4,), 7.0, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    if float(y.min().item()) != 10.0 or float(y.max().item()) != 10.0:
        errors.append("a side stream's read of a tensor dropped (after record_stream) by a new "
                      "thread saw other data: its memory was reused too soon")
    del junk, y

    # empty_cache with memory cached.
    settle()
    t = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    del t
    torch.cuda.synchronize()
    r0 = torch.cuda.memory_reserved()
    in_fresh_thread(torch.cuda.empty_cache, errors, "empty_cache with 256 MiB cached")
    r1 = torch.cuda.memory_reserved()
    if r0 - r1 < 200 * MIB:
        errors.append(f"empty_cache() in a new thread with 256 MiB cached lowered "
                      f"memory_reserved() by {r0 - r1} bytes")

    # Statistics.
    def stats():
        st = torch.cuda.memory_stats()
        torch.cuda.memory_snapshot()
        free, total = torch.cuda.mem_get_info()
        summary = torch.cuda.memory_summary()
        return (torch.cuda.memory_allocated(), st["allocated_bytes.all.current"], free, total,
                len(summary))

    keep = torch.full((1 << 20,), 2.0, device="cuda")
    got = in_fresh_thread(stats, errors, "memory statistics")
    if got is not None:
        allocated, stat_allocated, free, total, _ = got
        if allocated != torch.cuda.memory_allocated() or stat_allocated != allocated:
            errors.append(f"a new thread read memory_allocated() {allocated} "
                          f"(memory_stats {stat_allocated}), the main thread "
                          f"{torch.cuda.memory_allocated()}")
        if not 0 < free <= total:
            errors.append(f"mem_get_info() in a new thread gave {free}, {total}")

    # Caching off.
    enable = getattr(torch.cuda.memory, "caching_allocator_enable", None)
    if enable is not None:
        enable(False)
        try:
            holder = [torch.full((64 * MIB // 4,), 3.0, device="cuda")]
            in_fresh_thread(holder.clear, errors, "dropping a 64 MiB tensor with caching off")
        finally:
            enable(True)

    # Garbage collection of cycles holding CUDA tensors.
    gc.disable()
    try:
        for i in range(10):
            Cycle(torch.full((1 << (12 + i),), float(i), device="cuda"))
        collected = in_fresh_thread(gc.collect, errors, "gc.collect of cycles with CUDA tensors")
    finally:
        gc.enable()
    if collected is not None and collected < 10:
        errors.append(f"gc.collect() in a new thread collected {collected} objects, fewer "
                      f"than the 10 cycles")

    # use_mem_pool in a new thread.
    pool = torch.cuda.MemPool()

    def in_mempool():
        with torch.cuda.use_mem_pool(pool):
            return torch.full((1024,), 4.0, device="cuda")

    pt = in_fresh_thread(in_mempool, errors, "a tensor made inside use_mem_pool")
    if pt is not None:
        if not in_pool(pool, pt):
            errors.append("a tensor made inside use_mem_pool by a new thread is not in the pool")
        if float(pt.sum().item()) != 4.0 * 1024:
            errors.append("a tensor made inside use_mem_pool by a new thread is wrong")
    pt = pool = None

    # Pool workers dropping tensors the main thread made.
    lists = [[torch.full((1 << (10 + (i + k) % 10),), float(k), device="cuda")
              for i in range(50)] for k in range(8)]
    with ThreadPoolExecutor(max_workers=8) as ex:
        futures = [ex.submit(lst.clear) for lst in lists]
        for f in futures:
            try:
                f.result(timeout=30)
            except Exception as e:  # noqa: BLE001
                errors.append(f"a pool worker dropping tensors: {type(e).__name__}: {e}")
    del lists

    if float(keep.sum().item()) != 2.0 * keep.numel():
        errors.append("a tensor the main thread kept changed")
    del keep
    settle()
    memory_back(errors, base, res0, "at the end", count0)
    report(errors)


if __name__ == "__main__":
    main()
