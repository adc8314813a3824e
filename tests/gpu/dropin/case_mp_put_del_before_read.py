"""`queue.put(t); del t` (through a Queue and through a SimpleQueue), after which the sender
keeps allocating and writing, calls ipc_collect() and empty_cache(), all before the receiver
has read anything (a producer running ahead of a slow consumer).

With PyTorch's allocator a sent block outlives the sender's tensor (CUDA IPC reference
counting: a block whose sender dropped it waits in the "limbo" until its receiver released
it), so tensors of exactly the sent sizes filled with other values, ipc_collect() and
empty_cache() in the sender change nothing the receiver sees: reading only then, it gets
every tensor with its shape and values.

Why vmm may differ: a send holds its block until the receiver acknowledges (the free is
deferred, DeferFreeIfHeld); a free that races the feeder thread's export, empty_cache()
releasing held or parked chunks, or the block handed to the sender's next tensors of the
same size would show the receiver other bytes.
"""
import time

import torch
import torch.multiprocessing as mp
from dropin_report import report

SIZES = [256, 4096, 300_000, 1 << 20, 5 << 20, 24 << 20]  # float32 elements


def child(q, sq, go, reply):
    errs = []
    if not go.wait(60):
        reply.put(["the sender never set go"])
        return
    try:
        for src, base in (("Queue", 1.0), ("SimpleQueue", 100.0)):
            for i, n in enumerate(SIZES):
                t = q.get(timeout=60) if src == "Queue" else sq.get()
                want = base + i
                wrong = t[t != want]
                if tuple(t.shape) != (n,) or wrong.numel():
                    seen = float(wrong[0].item()) if wrong.numel() else None
                    errs.append(f"{src} tensor {i}: shape {tuple(t.shape)}, {wrong.numel()} of "
                                f"{n} elements are not {want} (e.g. {seen})")
                del t, wrong
            if src == "Queue" and q.get(timeout=60) != "end":
                errs.append("the Queue's end marker is missing")
    except Exception as e:  # noqa: BLE001
        errs.append(f"receiving: {type(e).__name__}: {e}")
    reply.put(errs)


def main():
    ctx = mp.get_context("spawn")
    q, sq, reply, go = ctx.Queue(), ctx.SimpleQueue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, sq, go, reply), daemon=True)
    p.start()
    for i, n in enumerate(SIZES):
        t = torch.full((n,), 1.0 + i, device="cuda")
        q.put(t)
        del t
    q.put("end")
    for i, n in enumerate(SIZES):
        t = torch.full((n,), 100.0 + i, device="cuda")
        sq.put(t)  # pickled here, in the caller
        del t
    deadline = time.monotonic() + 30
    while q._buffer and time.monotonic() < deadline:  # the feeder thread pickled every put
        time.sleep(0.01)
    errors = []
    if q._buffer:
        errors.append("the Queue's feeder thread did not send within 30 s")
    junk = [torch.full((n,), -1.0, device="cuda") for n in SIZES * 3]
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    junk += [torch.full((n,), -2.0, device="cuda") for n in SIZES]
    torch.cuda.synchronize()
    go.set()
    errors += reply.get(timeout=90)
    p.join(30)
    del junk
    report(errors)


if __name__ == "__main__":
    main()
