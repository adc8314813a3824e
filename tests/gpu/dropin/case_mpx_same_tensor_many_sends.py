"""One CUDA tensor put 1000 times on a torch.multiprocessing Queue, then 200 distinct
tensors (put, then del); the receiver holds all 1200 at once, writes through one copy, then
drops everything; the sender's memory must come back.

With PyTorch's allocator every send of the one tensor wraps its storage in another
ref-counted CUDA IPC context, and the receiver finds the storage it already has (its cache by
IPC handle and offset), releasing the extra counts at once: the 1000 copies arrive as one
storage (one data_ptr), a write through one shows in all of them and in the sender's tensor;
the distinct tensors keep their values while held. Once the receiver has dropped everything
and the sender its tensor, torch.cuda.ipc_collect() lets the sender's memory_allocated()
return to its value before the sends (polled for up to 15 s).

Why vmm may differ: 1000 sends of one block are 1000 holds and acknowledgements, and 1000
imports of one mapping in the receiver (shared, and found again as one storage by
sharing.received_storage); the block is freed only after its last hold ends and every
receiver reported unmapping.
"""
import gc

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

REPEAT = 1000
DISTINCT = 200
N = 4096


def child(q, reply, drop):
    errs = []
    same = [q.get(timeout=60) for _ in range(REPEAT)]
    distinct = [q.get(timeout=60) for _ in range(DISTINCT)]
    ptrs = {t.data_ptr() for t in same}
    storages = {t.untyped_storage().data_ptr() for t in same}
    if len(ptrs) != 1 or len(storages) != 1:
        errs.append(f"{REPEAT} receipts of one tensor came as {len(ptrs)} data_ptrs and "
                    f"{len(storages)} storages (expected one)")
    if not bool((torch.stack(same[::50]) == 3.0).all().item()):
        errs.append("the repeated tensor arrived with other values")
    same[-1][5] = -1.0
    torch.cuda.synchronize()
    if float(same[0][5].item()) != -1.0:
        errs.append("a write through the last receipt is not in the first")
    for i, t in enumerate(distinct):
        if t.numel() != 16 + i or not bool((t == float(i)).all().item()):
            errs.append(f"distinct tensor {i}: {t.numel()} elements, first "
                        f"{float(t[0].item())}")
            break
    reply.put(errs)
    drop.wait(60)
    del same, distinct, t
    gc.collect()
    torch.cuda.synchronize()
    reply.put("dropped")


def main():
    ctx = mp.get_context("spawn")
    q, reply, drop = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, reply, drop), daemon=True)
    p.start()
    keep = [torch.ones(1000, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    t = torch.full((N,), 3.0, device="cuda")
    for _ in range(REPEAT):
        q.put(t)
    for i in range(DISTINCT):
        d = torch.full((16 + i,), float(i), device="cuda")
        q.put(d)
        del d
    errors = list(reply.get(timeout=90))
    torch.cuda.synchronize()
    if float(t[5].item()) != -1.0:
        errors.append("the receiver's write is not in the sender's tensor")
    drop.set()
    if reply.get(timeout=90) != "dropped":
        errors.append("the receiver did not drop its tensors")
    del t
    error = memory_back_error(base, "receiver")
    if error:
        errors.append(error)
    p.join(30)
    del keep
    report(errors)


if __name__ == "__main__":
    main()
