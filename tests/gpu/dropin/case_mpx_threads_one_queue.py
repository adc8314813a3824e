"""Several producer threads of one process, each on a CUDA stream of its own, putting CUDA
tensors into one torch.multiprocessing Queue (`q.put(t); del t`) while they allocate and
free other tensors; one consumer process checks every tensor.

With PyTorch's allocator this works: each thread synchronizes its stream before put, the
queue's feeder thread pickles every item (CUDA IPC of the tensor's segment), and a sent
block outlives the thread's reference; the consumer gets every tensor of every thread, in
each thread's order, with its size and values.

Why vmm may differ: four threads prepare sends at once (Queue.put's dry run of pickle, the
ready event recorded on each thread's own current stream) while one feeder exports them and
the same threads' frees of sent blocks are deferred until acknowledged; blocks were
allocated on four different streams.
"""
import threading

import torch
import torch.multiprocessing as mp
from dropin_report import report

THREADS = 4
PER_THREAD = 120


def size_of(tid, i):
    return 64 + (i * 37 + tid * 911) % 6000


def consumer(q, reply):
    errs = []
    last = [-1] * THREADS
    try:
        for _ in range(THREADS * PER_THREAD):
            tid, i, t = q.get(timeout=60)
            if i != last[tid] + 1:
                errs.append(f"thread {tid}: item {i} after {last[tid]}")
            last[tid] = i
            n = size_of(tid, i)
            want = float(tid * 1000 + i)
            if tuple(t.shape) != (n,) or not bool((t == want).all().item()):
                errs.append(f"thread {tid} item {i}: shape {tuple(t.shape)} (expected {n}), "
                            f"first value {float(t[0].item()) if t.numel() else None} "
                            f"(expected {want})")
            del t
    except Exception as e:  # noqa: BLE001
        errs.append(f"receiving: {type(e).__name__}: {e}")
    reply.put(errs[:20])


def producer(q, tid, failures):
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            junk = []
            for i in range(PER_THREAD):
                n = size_of(tid, i)
                t = torch.full((n,), float(tid * 1000 + i), device="cuda")
                junk.append(torch.empty(n * 2 + 128, device="cuda"))
                if len(junk) > 5:
                    junk.pop(0)
                stream.synchronize()
                q.put((tid, i, t))
                del t
            del junk
            stream.synchronize()
    except Exception as e:  # noqa: BLE001
        failures.append(f"producer thread {tid}: {type(e).__name__}: {e}")


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, reply), daemon=True)
    p.start()
    torch.empty(1, device="cuda")
    failures = []
    threads = [threading.Thread(target=producer, args=(q, tid, failures))
               for tid in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    errors = list(failures)
    errors += reply.get(timeout=90)
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
