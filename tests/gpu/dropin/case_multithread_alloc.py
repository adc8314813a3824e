"""Allocations from many threads on their own streams, while another thread calls
empty_cache(), memory_stats() and memory_snapshot().

With PyTorch's allocator: 8 threads, each with its own stream, allocate tensors of random
sizes (1 KiB to 48 MiB), fill them, check their sums and drop them, 150 times each; the main
thread meanwhile calls empty_cache(), memory_stats(), memory_snapshot() and
mem_get_info() in a loop. No thread sees a wrong sum or an exception, and at the end
memory_allocated() is back at the baseline and the stats are consistent.

Why vmm may differ: vmm's pool lock, its per-stream free lists and empty_cache releasing
chunks (with device synchronization) while other threads allocate and free.
"""
import random
import sys
import threading

import torch


def worker(tid, errors, barrier):
    rng = random.Random(tid)
    stream = torch.cuda.Stream()
    barrier.wait()
    try:
        with torch.cuda.stream(stream):
            live = []
            for i in range(150):
                n = rng.choice([256, 1000, 65536, 1 << 18, 3 << 20, 12 << 20])
                t = torch.full((n,), float(tid + 1), device="cuda")
                live.append(t)
                if len(live) > 4:
                    live.pop(rng.randrange(len(live)))
                s = float(t.sum().item())
                if abs(s - float(tid + 1) * n) > 1e-5 * float(tid + 1) * n:
                    errors.append(f"thread {tid} iter {i}: sum {s}, expected {(tid + 1) * n}")
                    return
            del live, t
        stream.synchronize()
    except Exception as e:  # noqa: BLE001
        errors.append(f"thread {tid}: {type(e).__name__}: {e}")


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    errors = []
    barrier = threading.Barrier(9)
    threads = [threading.Thread(target=worker, args=(i, errors, barrier)) for i in range(8)]
    for th in threads:
        th.start()
    barrier.wait()
    while any(th.is_alive() for th in threads):
        torch.cuda.empty_cache()
        st = torch.cuda.memory_stats()
        if st["reserved_bytes.all.current"] < st["allocated_bytes.all.current"]:
            errors.append("reserved < allocated while threads run")
        torch.cuda.memory_snapshot()
        torch.cuda.mem_get_info()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"at the end: memory_allocated {torch.cuda.memory_allocated()} != {base}")
    torch.cuda.empty_cache()
    if errors:
        for e in errors[:20]:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
