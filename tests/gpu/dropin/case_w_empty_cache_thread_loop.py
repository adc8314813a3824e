"""torch.cuda.empty_cache() called in a loop from another thread (a memory-watchdog thread,
a serving framework's housekeeping timer, a callback of a monitoring library) while the
main thread allocates and frees in a loop, always with GPU work still queued on what it
frees: a tensor freed on the host right after kernels that read it were queued behind a GPU
sleep, a tensor freed under record_stream while a side stream still reads it, a tensor freed
right after a non_blocking copy of it to pinned host memory was queued; the main thread then
allocates the same sizes again (1 MiB to 192 MiB) and overwrites them.

With PyTorch's allocator empty_cache() takes the allocator's lock, waits for the events of
blocks freed under record_stream, and releases free segments with cudaFree, which waits for
the GPU's queued work; so every queued kernel and copy reads what was written before the
free: each result equals 2 * v + 1, each side-stream result v + 3, each host copy v, for
every iteration, however the two threads interleave; nothing raises, and the other thread's
memory_stats() and mem_get_info() calls return.

Why vmm may differ: vmm's empty_cache releases free chunks with cuMemUnmap / cuMemRelease,
which do not wait for queued work, and takes its pool's lock against allocations from the
main thread; a release of a chunk whose last reader is still queued, or a chunk handed out
and released at once, shows as wrong results, an illegal address, or a crash.
"""
import threading

import torch
from dropin_report import report

ITERS = 160
MIB = 1 << 20
SIZES = [MIB, 3 * MIB, 20 * MIB, 64 * MIB, 7 * MIB + 512, 192 * MIB, 2 * MIB, 40 * MIB]
SLEEP = 1_000_000  # cycles: about half a millisecond of queued work before each read


def emptier(stop, errors, calls):
    try:
        while not stop.is_set() or calls[0] < 20:
            torch.cuda.empty_cache()
            calls[0] += 1
            if calls[0] % 10 == 0:
                torch.cuda.memory_stats()
                torch.cuda.mem_get_info()
    except Exception as e:  # noqa: BLE001
        errors.append(f"the empty_cache thread: {type(e).__name__}: {str(e)[:300]}")


def main():
    torch.cuda.init()
    errors = []
    side = torch.cuda.Stream()
    stop = threading.Event()
    calls = [0]
    thread = threading.Thread(target=emptier, args=(stop, errors, calls))
    thread.start()
    pending = []  # (iteration, kind, tensor, expected value)
    try:
        for i in range(ITERS):
            n = SIZES[i % len(SIZES)] // 4
            v = float(i % 1000)
            a = torch.full((n,), v, device="cuda")
            torch.cuda._sleep(SLEEP)
            b = a * 2 + 1  # queued behind the sleep
            del a  # freed on the host while the kernel that reads it is queued
            c = torch.empty(n, device="cuda")  # likely a's block: stream-ordered reuse
            c.fill_(-1.0)
            pending.append((i, "result", b, 2 * v + 1))
            del c

            d = torch.full((n // 4,), v, device="cuda")
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP)
                e = d + 3
            d.record_stream(side)
            del d  # freed while the side stream still has to read it
            torch.cuda.current_stream().wait_stream(side)
            e.record_stream(torch.cuda.current_stream())
            pending.append((i, "side-stream result", e, v + 3))
            del e

            if i % 4 == 0:
                f = torch.full((n // 16,), v, device="cuda")
                host = torch.empty(n // 16, pin_memory=True)
                torch.cuda._sleep(SLEEP)
                host.copy_(f, non_blocking=True)
                del f  # freed while the copy to the host is queued
                g = torch.empty(n // 16, device="cuda")
                g.fill_(-7.0)
                del g
                pending.append((i, "host copy", host, v))

            if len(pending) > 24:
                check(pending.pop(0), errors)
            if len(errors) > 10:
                break
    except Exception as e:  # noqa: BLE001
        errors.append(f"the main thread: {type(e).__name__}: {str(e)[:300]}")
    finally:
        stop.set()
        thread.join(60)
    torch.cuda.synchronize()
    while pending:
        check(pending.pop(0), errors)
    if thread.is_alive():
        errors.append("the empty_cache thread did not stop")
    report(errors[:12])


def check(item, errors):
    i, kind, t, want = item
    if t.is_cuda:
        ok = bool((t == want).all())
    else:
        torch.cuda.synchronize()  # the non_blocking copy to the host is done
        ok = bool((t == want).all())
    if not ok:
        errors.append(f"iteration {i}: the {kind} is not {want} everywhere (e.g. "
                      f"{float(t.flatten()[(t != want).flatten().nonzero()[0]].item())})")


if __name__ == "__main__":
    main()
