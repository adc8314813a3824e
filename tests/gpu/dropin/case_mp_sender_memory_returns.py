"""A producer's device memory comes back once its consumer has used and dropped what it was
sent (`queue.put(t); del t`, many sizes): no leak in the sender.

With PyTorch's allocator, once the consumer has dropped the tensors, torch.cuda.ipc_collect()
in the producer frees the sent blocks: memory_allocated() returns to its value before the
sends (polled for up to 15 s), and memory_reserved() can be emptied to where it was.

Why vmm may differ: a send is held in the producer until the receiver acknowledges, then its
block's deferred free runs on a background thread; exported chunks are parked, spare or
unmarked once receivers report, bookkept apart from free blocks.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20


def consumer(q, reply, count):
    total = 0.0
    for _ in range(count):
        t = q.get(timeout=90)
        total += float(t.double().sum().item())
        del t
    torch.cuda.synchronize()
    reply.put(total)


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    sizes = [100 + i for i in range(60)] + [3 * MIB] * 4 + [40 * MIB] * 2 + [1]
    p = ctx.Process(target=consumer, args=(q, reply, len(sizes)), daemon=True)
    p.start()
    keep = [torch.ones(1000, device="cuda") for _ in range(10)]  # live neighbours
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    expect = 0.0
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(i % 5 + 1), device="cuda")
        expect += float(i % 5 + 1) * n
        q.put(t)
        del t
    total = reply.get(timeout=90)
    errors = []
    if total != expect:
        errors.append(f"the consumer summed {total}, expected {expect}")
    error = memory_back_error(base, "consumer")
    if error:
        errors.append(error)
    p.join(30)
    del keep
    report(errors)


if __name__ == "__main__":
    main()
