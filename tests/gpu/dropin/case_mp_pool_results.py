"""multiprocessing Pool (spawn) with CUDA tensors as task arguments (slices of one tensor)
and CUDA tensors as results.

With PyTorch's allocator: pool.map over 32 slices of one CUDA tensor returns, from the
workers, new CUDA tensors (slice * k); the parent checks every result, does it again with
imap_unordered and starmap, then closes the pool.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): Pool pickles task arguments in its task-handler thread (not the caller,
not a Queue feeder: Connection.send), where vmm's reducer must move the shared storage and
synchronize; results come back through the result queue from worker processes that keep
running.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report


def scale(arg):
    t, k = arg
    return t * k


def scale2(t, k):
    return (t * k).to(torch.float64)


def main():
    ctx = mp.get_context("spawn")
    base = torch.arange(32 * 512, dtype=torch.float32, device="cuda")
    tasks = [(base[i * 512:(i + 1) * 512], i) for i in range(32)]
    errors = []
    with ctx.Pool(2) as pool:
        outs = pool.map(scale, tasks, chunksize=3)
        for (t, k), o in zip(tasks, outs):
            if not o.is_cuda or not torch.equal(o, t * k):
                errors.append(f"map: result {k} differs")
        del outs
        sums = sorted(float(o.double().sum().item()) for o in pool.imap_unordered(scale, tasks[:8]))
        expect = sorted(float((t * k).double().sum().item()) for t, k in tasks[:8])
        if sums != expect:
            errors.append(f"imap_unordered sums {sums} != {expect}")
        outs = pool.starmap(scale2, [(t, k) for t, k in tasks[:6]])
        for (t, k), o in zip(tasks[:6], outs):
            if o.dtype != torch.float64 or not torch.equal(o, (t * k).double()):
                errors.append(f"starmap: result {k} differs")
        del outs
        pool.close()
        pool.join()
    if not torch.equal(base, torch.arange(32 * 512, dtype=torch.float32, device="cuda")):
        errors.append("the parent's tensor changed")
    report(errors)


if __name__ == "__main__":
    main()
