"""Many short-lived threads, each taking a torch.cuda.Stream, allocating and computing on
it and handing a result to the main thread before it exits (a request handler or
thread-pool task per request, as web servers and some inference frameworks run model calls);
a thread-local tensor of each is dropped as the thread ends.

torch.cuda.Stream() hands out the streams of a fixed per-device pool in turn (32 of each
priority), so 192 threads reuse every stream several times, while blocks freed by earlier
threads on those streams are still cached, and some of them still pending. With PyTorch's
allocator, for 16 rounds of 12 threads: each thread fills a tensor with its number on its
stream (some after a GPU sleep), computes b = 2a + 1, makes and frees scratch tensors, keeps a
tensor in a threading.local (freed when the thread ends, its stream maybe still busy),
records an event and puts (b, event) on a queue; some threads also put a tensor made on
their default stream. The main thread's stream waits for the event, lags behind a GPU sleep,
sums b, calls b.record_stream() and drops it, and allocates a tensor of b's size. Every sum is
exact (n * (2 * tid + 1), 4096 * tid), and once the threads are joined memory_allocated() and
allocation.all.current are back at the baseline, memory_reserved() too after empty_cache().

Why vmm may differ: vmm keeps free blocks per stream tag and reclaims other streams' frees by
events (stream_reclaim.h); streams here outlive the threads that used them and pass from
thread to thread, frees come from threads that are exiting (thread-local teardown) and from
the main thread with record_stream, and vmm keeps per-thread state of its own.
"""
import gc
import queue
import threading
import time

import torch
from dropin_report import baseline, memory_back, report, settle

ROUNDS, PER_ROUND = 16, 12
SIZES = [256 << (2 * k) for k in range(8)] + [6 << 20]  # float32: 1 KiB .. 24 MiB
tls = threading.local()


def worker(tid, results, errors):
    try:
        stream = torch.cuda.Stream(priority=-1 if tid % 4 == 0 else 0)
        n = SIZES[tid % len(SIZES)]
        with torch.cuda.stream(stream):
            a = torch.full((n,), float(tid), device="cuda")
            if tid % 5 == 0:
                torch.cuda._sleep(2_000_000)
            b = a * 2 + 1
            tls.scratch = torch.full((n // 2 + 1,), float(tid), device="cuda")
            junk = [torch.empty(m, device="cuda").fill_(tid) for m in (1000, 70_000, 300_000)]
            del a, junk
            done = torch.cuda.Event()
            done.record(stream)
        if tid % 3 == 0:
            results.put((tid, "plain", torch.full((4096,), float(tid), device="cuda"), None))
        results.put((tid, "side", b, done))
    except Exception as e:  # noqa: BLE001
        errors.append(f"thread {tid}: {type(e).__name__}: {e}")
        results.put((tid, "failed", None, None))


def main():
    errors = []
    torch.cuda.init()
    torch.empty(1, device="cuda")
    base, res0, base_count = baseline()
    results = queue.Queue()
    sums, want = [], []
    cur = torch.cuda.current_stream()
    for r in range(ROUNDS):
        tids = range(r * PER_ROUND, (r + 1) * PER_ROUND)
        threads = [threading.Thread(target=worker, args=(t, results, errors)) for t in tids]
        for th in threads:
            th.start()
        pending = sum(2 if t % 3 == 0 else 1 for t in tids)
        while pending:
            try:
                tid, kind, t, event = results.get(timeout=30)
            except queue.Empty:
                errors.append(f"round {r}: no result from a thread within 30 s")
                break
            pending -= 2 if kind == "failed" and tid % 3 == 0 else 1
            if t is None:
                continue
            if event is not None:
                cur.wait_event(event)
            if tid % 2:
                torch.cuda._sleep(1_000_000)
            sums.append(t.sum(dtype=torch.float64))
            n = t.numel()
            want.append(float(n * (2 * tid + 1)) if kind == "side" else float(4096 * tid))
            if kind == "side":
                t.record_stream(cur)
            del t, event
            torch.full((n,), -1.0, device="cuda")
        for th in threads:
            th.join()
    got = torch.stack(sums).cpu().tolist() if sums else []
    bad = [(w, g) for w, g in zip(want, got) if w != g]
    if bad:
        errors.append(f"{len(bad)} of {len(got)} results are wrong, e.g. sum {bad[0][1]} "
                      f"instead of {bad[0][0]}")
    if len(got) != sum(2 if t % 3 == 0 else 1 for t in range(ROUNDS * PER_ROUND)):
        errors.append(f"{len(got)} results arrived")
    del sums
    deadline = time.monotonic() + 5  # a thread's locals may go just after join() returns
    while True:
        gc.collect()
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() == base or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    settle()
    memory_back(errors, base, res0, "with the threads gone", base_count)
    report(errors)


if __name__ == "__main__":
    main()
