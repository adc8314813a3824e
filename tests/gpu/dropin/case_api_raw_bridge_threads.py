"""Raw device memory from PyTorch's allocator through a bridge of the kind CuPy, Numba and
pytorch-pfn-extras install (malloc(size, stream) -> torch.cuda.caching_allocator_alloc,
free(ptr) -> torch.cuda.caching_allocator_delete), which hands back every pointer it got,
the null pointer of a zero-byte request included, from several threads.

With PyTorch's allocator: caching_allocator_alloc(0) returns 0, on any stream;
caching_allocator_delete(0) does nothing however often it is called, also before any zero-byte
request was made (the allocator's raw_delete returns at once on a null pointer, as free(NULL)
does), and five zero-byte requests are deleted five times; then 4 threads, each on a stream
of its own, make 150 raw blocks each of 0 bytes to 6 MiB (one in eight of 0 bytes), write
and read them through uint8 tensors over the pointers and delete them out of order (up to 6
live at once per thread): no two live blocks overlap, every block reads back what its thread
wrote, no call raises, and at the end memory_allocated() and allocation.all.current are back
where they were.

Why vmm may differ: raw_alloc / raw_delete are CUDAPluggableAllocator's, whose bookkeeping
(allocation_metadata_, a map keyed by pointer) keeps a zero-byte request's null pointer once
however many there were, and refuses to delete a pointer it does not hold ("Trying to free a
pointer not allocated here"); vmm's Malloc returns null for 0 bytes into that bookkeeping.
"""
import random
import threading

import torch
from dropin_report import report
from raw_memory import wrap

MIB = 1 << 20
THREADS, PER_THREAD, LIVE_MAX = 4, 150, 6


class Bridge:
    """What an interop allocator hook does: every pointer back to PyTorch's allocator."""

    def __init__(self, errors):
        self.errors, self.lock, self.live = errors, threading.Lock(), {}

    def malloc(self, size, stream):
        ptr = torch.cuda.caching_allocator_alloc(size, stream=stream)
        with self.lock:
            if size == 0:
                if ptr != 0:
                    self.errors.append(f"caching_allocator_alloc(0) returned {ptr:#x}, not 0")
                return ptr
            for p, n in self.live.items():
                if p < ptr + size and ptr < p + n:
                    self.errors.append(f"raw block [{ptr:#x}, +{size}) overlaps live block "
                                       f"[{p:#x}, +{n})")
            self.live[ptr] = size
        return ptr

    def free(self, ptr, where):
        with self.lock:
            self.live.pop(ptr, None)
        try:
            torch.cuda.caching_allocator_delete(ptr)
        except Exception as e:  # noqa: BLE001
            with self.lock:
                self.errors.append(f"{where}: caching_allocator_delete({ptr:#x}) raised "
                                   f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")


def worker(tid, bridge, errors):
    rng = random.Random(tid)
    stream = torch.cuda.Stream()
    held = []
    try:
        with torch.cuda.stream(stream):
            for i in range(PER_THREAD):
                size = 0 if rng.random() < 0.125 else rng.choice(
                    (rng.randint(1, 4096), rng.randint(4097, MIB), rng.randint(MIB, 6 * MIB)))
                ptr = bridge.malloc(size, stream)
                value = (tid * 37 + i) % 251
                if size:
                    wrap(ptr, size, torch.uint8).fill_(value)
                held.append((ptr, size, value))
                while len(held) > LIVE_MAX or (i == PER_THREAD - 1 and held):
                    ptr, size, value = held.pop(rng.randrange(len(held)))
                    if size:
                        t = wrap(ptr, size, torch.uint8)
                        if not bool((t == value).all().item()):
                            errors.append(f"thread {tid}: a raw block of {size} bytes does not "
                                          f"read back {value}")
                        del t
                    bridge.free(ptr, f"thread {tid}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"thread {tid}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    bridge = Bridge(errors)
    base = torch.cuda.memory_allocated()
    count = torch.cuda.memory_stats()["allocation.all.current"]
    for i in range(3):
        bridge.free(0, f"caching_allocator_delete(0) number {i + 1}, before any 0-byte request")
    side = torch.cuda.Stream()
    zeros = [bridge.malloc(0, s) for s in (torch.cuda.current_stream(), side) * 2]
    zeros.append(bridge.malloc(0, side.cuda_stream))
    for i, p in enumerate(zeros):
        bridge.free(p, f"deleting the pointer of 0-byte request {i + 1} of {len(zeros)}")
    threads = [threading.Thread(target=worker, args=(t, bridge, errors)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    if bridge.live:
        errors.append(f"{len(bridge.live)} raw blocks were not deleted")
    if torch.cuda.memory_allocated() != base:
        errors.append(f"at the end memory_allocated is {torch.cuda.memory_allocated()}, "
                      f"{base} at the start")
    if torch.cuda.memory_stats()["allocation.all.current"] != count:
        errors.append(f"at the end allocation.all.current is "
                      f"{torch.cuda.memory_stats()['allocation.all.current']}, {count} at the "
                      f"start")
    if len(errors) > 12:
        errors[12:] = [f"... and {len(errors) - 12} more"]
    report(errors)


if __name__ == "__main__":
    main()
