"""CUDA graphs captured by several threads at the same time, each on a stream of its own in
capture_error_mode="thread_local" (CUDAGraph.capture_begin / capture_end, as torch.compile's
graph trees and serving engines that capture per worker thread call them), each into a
private pool of its own, while another thread keeps allocating, computing and freeing eager
tensors on its own stream.

PyTorch's allocator keeps a list of the captures under way (captures_underway: a pool id and a
filter per capture, the filter matching the capture's stream by its capture id), so with it:
four threads, each having warmed up its function on its stream, wait at a barrier and then
capture at once (their captures overlap, with a temporary of a thread-specific size made and
freed inside each, and cub's scratch for cumsum; capture_begin and capture_end are called one
thread at a time, as the generator registry they touch is shared), the graphs have distinct
pools and their outputs lie in private-pool segments of the snapshot; replaying each graph
with new input values gives the eager result (in its thread right after capture, and later
from the main thread, all graphs interleaved); the eager thread's tensors hold their values
throughout; and once the graphs and their tensors are gone, memory_allocated() is back at its
baseline and empty_cache() brings memory_reserved() back.

Why vmm may differ: each capture adds a route (beginAllocateToPool) to a vmm private pool,
kept in a list that every allocation searches with the filters; overlapping captures open and
close routes in any order, each opens a "capture window" (imports held, no events queried,
nothing released) that must stay open until the last one ends, and the eager thread's misses
grow the device pool meanwhile.
"""
import threading

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20
THREADS = 4


def fn(x, k):
    tmp = torch.empty(x.numel() + (k + 1) * 65536, device="cuda")
    tmp.fill_(float(k + 1))
    y = x * tmp[: x.numel()] + k
    del tmp
    return (y.cumsum(0) / x.numel()).tanh() + y


def expected(x, k):
    y = x * float(k + 1) + k
    return (y.cumsum(0) / x.numel()).tanh() + y


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def capturer(k, barrier, lock, out, errors):
    try:
        s = torch.cuda.Stream()
        n = (k + 1) * 300_000
        with torch.cuda.stream(s):
            x = torch.randn(n, device="cuda")
            for _ in range(2):
                fn(x, k)  # warm up on the capture stream
            s.synchronize()
            g = torch.cuda.CUDAGraph()
            barrier.wait(timeout=30)
            with lock:  # capture_begin / capture_end one at a time (the RNG registry is shared)
                g.capture_begin(capture_error_mode="thread_local")
            try:
                barrier.wait(timeout=30)  # every thread is capturing now
                y = fn(x, k)
                barrier.wait(timeout=30)  # and every thread has queued its work
            finally:
                with lock:
                    g.capture_end()
            for r in range(3):
                x.copy_(torch.full((n,), 0.001 * (r + 1), device="cuda") + x * 0.5)
                g.replay()
                s.synchronize()
                if not close(y, expected(x, k)):
                    errors.append(f"thread {k}: replay {r} right after capture differs from "
                                  f"eager")
            s.synchronize()
        out[k] = (g, x, y, s)
    except Exception as e:  # noqa: BLE001
        errors.append(f"thread {k}: {type(e).__name__}: {str(e)[:300]}")
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass


def eager_worker(stop, errors):
    try:
        s = torch.cuda.Stream()
        rounds = 0
        with torch.cuda.stream(s):
            while not stop.is_set() or rounds < 5:
                ts = [torch.full((n,), float(i + rounds), device="cuda")
                      for i, n in enumerate((1000, 70_000, MIB, 3 * MIB + 5))]
                big = torch.empty(48 * MIB // 4, device="cuda")
                big.fill_(3.0)
                for i, t in enumerate(ts):
                    if float(t[-1].item()) != float(i + rounds):
                        errors.append(f"eager thread: round {rounds} tensor {i} lost its value")
                if float(big[-1].item()) != 3.0:
                    errors.append("eager thread: its 48 MiB tensor lost its value")
                del ts, big
                rounds += 1
    except Exception as e:  # noqa: BLE001
        errors.append(f"eager thread: {type(e).__name__}: {str(e)[:300]}")


def main():
    errors = []
    torch.empty(1, device="cuda")
    base, res0, _ = baseline()
    out = {}
    barrier = threading.Barrier(THREADS)
    lock = threading.Lock()
    stop = threading.Event()
    eager = threading.Thread(target=eager_worker, args=(stop, errors))
    eager.start()
    threads = [threading.Thread(target=capturer, args=(k, barrier, lock, out, errors))
               for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    eager.join(60)
    if any(t.is_alive() for t in threads) or eager.is_alive():
        errors.append("a thread did not finish (hung?)")
        report(errors)
        return
    torch.cuda.synchronize()

    pools = {}
    for k, (g, x, y, s) in out.items():
        pools[k] = g.pool()
    if len(set(pools.values())) != len(pools):
        errors.append(f"two concurrent captures share a pool: {pools}")
    snap = torch.cuda.memory._snapshot()
    owner = {}
    for seg in snap["segments"]:
        owner_id = tuple(seg.get("segment_pool_id", (0, 0)))
        owner[(seg["address"], seg["address"] + seg["total_size"])] = owner_id
    for k, (g, x, y, s) in out.items():
        p = y.data_ptr()
        ids = [o for (a, b), o in owner.items() if a <= p < b]
        if not ids or ids[0] == (0, 0):
            errors.append(f"thread {k}'s graph output is not in a private pool ({ids})")

    for r in range(4):
        for k in sorted(out, key=lambda k: (k * 7 + r) % THREADS):
            g, x, y, s = out[k]
            with torch.cuda.stream(s):
                x.normal_()
                g.replay()
        torch.cuda.synchronize()
        for k, (g, x, y, s) in out.items():
            if not close(y, expected(x, k)):
                errors.append(f"round {r}: graph {k} replayed from the main thread differs from "
                              f"eager")
    g = x = y = s = None
    out.clear()
    settle()
    memory_back(errors, base, res0, "after the graphs and their tensors were dropped")
    report(errors)


if __name__ == "__main__":
    main()
