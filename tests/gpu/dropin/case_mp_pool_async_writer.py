"""Pool.apply_async with a CUDA tensor argument, while the caller keeps updating that tensor
in place (the task is pickled later, by the pool's task-handler thread).

With PyTorch's allocator the caller's tensor is never moved, so all of its in-place updates
land: after 20 add_(1) each of 300 tensors is all 20, whatever the workers saw (each worker
reads a sum between 0 and 20 * numel).

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): vmm's reducer, run in the task-handler thread, moves a tensor that shares
a physical chunk into memory of its own (copy, then swap of the storage) while the caller's
thread is still launching add_ kernels on the old address: updates launched between the copy
and the swap land in the old block and are lost.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report

N = 1024


def peek(t):
    return float(t.sum().item())


def main():
    ctx = mp.get_context("spawn")
    errors = []
    with ctx.Pool(2) as pool:
        pool.apply(peek, (torch.zeros(1, device="cuda"),))
        ts, rs = [], []
        for i in range(300):
            t = torch.zeros(N, device="cuda")
            rs.append(pool.apply_async(peek, (t,)))
            for _ in range(20):
                t.add_(1.0)
            ts.append(t)
        seen = [r.get(timeout=120) for r in rs]
        torch.cuda.synchronize()
        lost = [i for i, t in enumerate(ts) if float(t.sum().item()) != 20.0 * N]
        if lost:
            errors.append(f"{len(lost)} of 300 tensors lost in-place updates made after "
                          f"apply_async (e.g. #{lost[0]}: sum {float(ts[lost[0]].sum().item())},"
                          f" expected {20.0 * N})")
        bad = [v for v in seen if not 0.0 <= v <= 20.0 * N]
        if bad:
            errors.append(f"workers saw impossible sums {bad[:5]}")
        pool.close()
        pool.join()
    report(errors)


if __name__ == "__main__":
    main()
