"""Shared CUDA weights handed to Pool workers once, as initializer arguments
(`Pool(initializer=init, initargs=(w, b))`, spawn), with maxtasksperchild so that the pool
replaces its worker midway; the parent updates the weights in place between tasks.

With PyTorch's allocator initargs travel as Process arguments of each worker (pickled in the
parent when the worker starts: the first by the Pool constructor, the replacement by the
pool's worker-handler thread): every worker maps the parent's memory, so each task computes
with the weights as the parent last wrote them, and a worker's in-place write to the shared
bias shows in the parent and in the next worker. The first two tasks run in one worker,
the third in its replacement.

Why vmm may differ: each worker start is a send of the same two storages (two holds, one per
worker), the second pickled in a background thread of the pool (not a Queue feeder, not the
main thread; vmm synchronizes that thread's current stream); the first worker exits holding
its imports.
"""
import os

import torch
import torch.multiprocessing as mp
from dropin_report import report

_shared = {}


def init(w, b):
    _shared["w"] = w
    _shared["b"] = b


def task(k):
    w, b = _shared["w"], _shared["b"]
    wsum = float(w.double().sum().item())
    bsum = float(b.double().sum().item())
    b[k] += 1.0
    torch.cuda.synchronize()
    return os.getpid(), wsum, bsum


def main():
    ctx = mp.get_context("spawn")
    w = torch.zeros(256, 256, device="cuda")
    b = torch.zeros(64, device="cuda")
    errors = []
    pids = []
    with ctx.Pool(1, initializer=init, initargs=(w, b), maxtasksperchild=2) as pool:
        for k in range(3):
            w.fill_(float(k + 1))
            torch.cuda.synchronize()
            pid, wsum, bsum = pool.apply(task, (k,))
            pids.append(pid)
            if wsum != float(k + 1) * 256 * 256:
                errors.append(f"task {k}: the worker saw weights summing to {wsum}, expected "
                              f"{float(k + 1) * 256 * 256} (not the parent's in-place update)")
            if bsum != float(k):
                errors.append(f"task {k}: the worker saw bias sum {bsum}, expected {float(k)} "
                              f"(earlier workers' writes)")
            torch.cuda.synchronize()
            if float(b[k].item()) != 1.0:
                errors.append(f"task {k}: the worker's write to the shared bias is not in the "
                              f"parent's tensor")
        pool.close()
        pool.join()
    if len(pids) == 3 and not (pids[0] == pids[1] != pids[2]):
        errors.append(f"workers by task {pids}: expected the first two tasks in one worker and "
                      f"the third in its replacement")
    if float(b.sum().item()) != 3.0:
        errors.append(f"the bias sums to {float(b.sum().item())} after three tasks, expected 3")
    report(errors)


if __name__ == "__main__":
    main()
