"""Sending a small slice of a large buffer that lives beside another tensor (memory the
allocator reused from its cache), with most of the GPU in use.
# EXCLUSIVE (uses most of the GPU: run alone)

With PyTorch's allocator sending a view shares the allocation it lies in (CUDA IPC of the
segment): no copy, no extra memory, so the send works however full the GPU is, and the
receiver reads the slice's values.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): Queue.put moves a storage that shares a physical chunk with another live
tensor into chunks of its own before sending: the *whole* storage (here about 55% of the
GPU) is allocated again and copied, to send 4 KiB; with the GPU this full that allocation
fails (out of memory in put) where PyTorch's send needs nothing.
"""
import sys

import torch
import torch.multiprocessing as mp
from dropin_report import report


def child(q, ready, reply):
    torch.empty(1, device="cuda")
    ready.set()
    try:
        t = q.get(timeout=60)
        reply.put(("ok", float(t.sum().item())))
        del t
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {e}"))


def main():
    ctx = mp.get_context("spawn")
    q, reply, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, ready, reply), daemon=True)
    p.start()
    torch.empty(1, device="cuda")
    if not ready.wait(60):
        print("FAIL: the child did not start", file=sys.stderr)
        sys.exit(1)
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    tmp = torch.empty(int(free0 * 0.70), dtype=torch.uint8, device="cuda")
    del tmp                                   # cached
    buf = torch.empty(int(free0 * 0.55), dtype=torch.uint8, device="cuda")  # reuses it
    other = torch.empty(int(free0 * 0.05), dtype=torch.uint8, device="cuda")  # beside buf
    fill = torch.empty(int(free0 * 0.20), dtype=torch.uint8, device="cuda")  # the GPU is full
    view = buf[: 4096].view(torch.float32)
    view.fill_(3.0)
    torch.cuda.synchronize()
    errors = []
    try:
        q.put(view)
    except Exception as e:  # noqa: BLE001
        errors.append(f"Queue.put of a 4 KiB slice raised {type(e).__name__}: {str(e)[:300]}")
        q.put(torch.zeros(1024, device="cuda"))  # let the child finish
    status, val = reply.get(timeout=90)
    if not errors:
        if status != "ok":
            errors.append(f"the receiver failed: {val[:300]}")
        elif val != 3072.0:
            errors.append(f"the receiver read sum {val}, expected 3072")
    p.join(30)
    del buf, other, fill, view
    report(errors)


if __name__ == "__main__":
    main()
