#!/usr/bin/env python3
"""One producer shares CUDA tensors with four consumers through torch.multiprocessing queues.

    python3 bench/fanout.py --handle-type fabric --sizes 64M,1G,8G --consumers 4

The producer enables vmm and its reducers, fills each tensor with a pattern and puts it on
every consumer's queue; each consumer checks every element against the pattern and reports
when it had the tensor (latency from the put to its first read). The consumers start, set
CUDA up and take one small untimed tensor before the clock runs; each size is sent --reps
times. Prints one JSON line per size (median and max over every consumer and repetition), and
exits nonzero if any consumer saw wrong data.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

CHUNK = 1 << 28  # elements per step when filling or checking (bounds temporary memory)


def pattern(start, n, device):
    """Bytes (start + i) % 251 for i in [0, n)."""
    return ((torch.arange(n, device=device, dtype=torch.int64) + start) % 251).to(torch.uint8)


def fill(t):
    for start in range(0, t.numel(), CHUNK):
        n = min(CHUNK, t.numel() - start)
        t[start:start + n].copy_(pattern(start, n, t.device))


def matches(t):
    for start in range(0, t.numel(), CHUNK):
        n = min(CHUNK, t.numel() - start)
        if not torch.equal(t[start:start + n], pattern(start, n, t.device)):
            return False
    return True


def consumer(handle_type, jobs, results):
    import vmm_torch
    vmm_torch.enable(handle_type=handle_type)
    vmm_torch.install_reducers()
    torch.cuda.init()
    results.put("ready")
    while True:
        item = jobs.get()
        if item is None:
            return
        t0, tensor = item
        first = int(tensor[0].item())
        t1 = time.perf_counter_ns()
        ok = matches(tensor) and first == 0
        results.put({"latency_ns": t1 - t0, "ok": ok})
        del tensor, item


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--handle-type", default="fabric")
    p.add_argument("--sizes", default="64M,1G,8G")
    p.add_argument("--consumers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    import vmm_torch

    try:
        sizes = [vmm_torch.parse_size(s) for s in a.sizes.split(",")]
    except ValueError as e:
        p.error(str(e))
    vmm_torch.enable(handle_type=a.handle_type)
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(a.consumers)]
    results = ctx.Queue()
    procs = [ctx.Process(target=consumer, args=(a.handle_type, q, results)) for q in queues]
    for proc in procs:
        proc.start()
    for _ in procs:
        assert results.get(timeout=300) == "ready"

    def send(n):
        """Shares a fresh n-byte tensor with every consumer: their answers."""
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        fill(t)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for q in queues:
            q.put((t0, t))
        answers = [results.get(timeout=600) for _ in queues]
        del t
        torch.cuda.synchronize()
        return answers

    failed = not all(r["ok"] for r in send(2 << 20))  # warm-up, untimed
    for n in sizes:
        rs = [r for _ in range(a.reps) for r in send(n)]
        lat = [r["latency_ns"] / 1e6 for r in rs]
        ok = all(r["ok"] for r in rs)
        failed |= not ok
        print(json.dumps({"bench": "fanout", "handle_type": a.handle_type, "bytes": n,
                          "consumers": a.consumers, "reps": a.reps, "all_verified": ok,
                          "median_ms": statistics.median(lat), "max_ms": max(lat)}), flush=True)
    for q in queues:
        q.put(None)
    for proc in procs:
        proc.join(60)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
