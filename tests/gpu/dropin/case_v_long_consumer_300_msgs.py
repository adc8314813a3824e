"""A long-lived consumer process receiving 300 CUDA tensors in sequence from a torch.multiprocessing
Queue while the producer frees each right after put (`q.put(t); del t`) and at once allocates
and fills a scratch tensor of the same size (a rollout worker feeding a learner): sizes from 4
bytes to 16 MiB; the consumer keeps a sliding window of the last 8 and every 50th for good,
checking values as they come and again at the end; then it drops everything and says so.

With PyTorch's allocator a sent block outlives the producer's tensor until the consumer lets
go (the "limbo" of CUDA IPC), so no scratch tensor ever lands on it: every message arrives with
its size and values (all i, the last element -i - 1), the held ones still hold them at the
end; once the consumer dropped everything, the producer's memory_allocated() comes back to
its value before the sends (torch.cuda.ipc_collect() polled for up to 15 s), the producer
staying alive until the consumer is done (PyTorch's Note [Sharing CUDA tensors]).

Why vmm may differ: 300 sends deferred-freed by the producer while its allocations go on,
each held until its acknowledgement arrives; the consumer's imports open and close all along
(a window of 8 plus 6 kept); the held blocks' frees land long after their sends.
"""
import gc

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

COUNT = 300
WINDOW = 8
KEEP_EVERY = 50
MIB = 1 << 20


def size(i):
    """Elements (float32) of message i: 1 to 200,000, and 16 MiB every 60th."""
    if i % 60 == 59:
        return 4 * MIB
    return 1 + (i * 7919) % 200_000


def good(t, i):
    n = size(i)
    if t.dtype != torch.float32 or tuple(t.shape) != (n,) or not t.is_cuda:
        return f"message {i}: arrived as {t.dtype} {tuple(t.shape)}, sent float32 ({n},)"
    last = float(t[-1].item())
    body = bool((t[:-1] == float(i)).all().item()) if n > 1 else True
    if last != -float(i) - 1 or not body:
        return f"message {i}: wrong values (last {last})"
    return None


def consumer(q, reply, done):
    errs = []
    window, kept = [], {}
    try:
        for i in range(COUNT):
            t = q.get(timeout=60)
            e = good(t, i)
            if e:
                errs.append(e)
            window.append(t)
            if len(window) > WINDOW:
                window.pop(0)
            if i % KEEP_EVERY == 0:
                kept[i] = t
            del t
        for i, t in kept.items():
            e = good(t, i)
            if e:
                errs.append(f"at the end, {e}")
        for j, t in enumerate(window):
            e = good(t, COUNT - len(window) + j)
            if e:
                errs.append(f"at the end, {e}")
        del t
        window.clear()
        kept.clear()
        gc.collect()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        errs.append(f"the consumer failed: {type(e).__name__}: {e}")
        window.clear()
        kept.clear()
    reply.put(errs[:20])
    done.wait(60)


def main():
    ctx = mp.get_context("spawn")
    q, reply, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=consumer, args=(q, reply, done), daemon=True)
    p.start()
    keep = [torch.ones(1000 + i, device="cuda") for i in range(6)]  # live neighbours
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i in range(COUNT):
        n = size(i)
        t = torch.full((n,), float(i), device="cuda")
        t[-1] = -float(i) - 1
        q.put(t)
        del t
        scratch = torch.full((n,), -5.0, device="cuda")
        del scratch
    errors = list(reply.get(timeout=120))
    error = memory_back_error(base, "consumer")
    if error:
        errors.append(error)
    done.set()
    p.join(30)
    del keep
    report(errors)


if __name__ == "__main__":
    main()
