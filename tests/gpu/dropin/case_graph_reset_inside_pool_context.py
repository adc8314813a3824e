"""A CUDA graph captured into a MemPool, reset (or dropped) while a use_mem_pool context of the
same pool is open: the context goes on routing to the pool and ends cleanly.

With PyTorch's allocator, CUDAGraph.reset() gives back the graph's use of its pool
(releasePool) and nothing else: inside `with torch.cuda.use_mem_pool(pool)`, a tensor made
after the reset still comes from the pool (pool.snapshot() holds its address), the context
exits without error, a tensor made after it comes from elsewhere, and the graph captured
again into the same pool replays correctly.

Why vmm may differ: vmm ends a route at releasePool when a capture failed without ending its
own (so that the capture window does not stay open); ending the open context's route there
would send later tensors elsewhere and make the context's exit raise.
"""
import torch
from dropin_report import capture_doubling, in_pool, report

MIB = 1 << 20


def main():
    errors = []
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda.MemPool, "snapshot"):
        report(errors)
        return
    pool = torch.cuda.MemPool()
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    g, y = capture_doubling(pool, x)
    g.replay()
    torch.cuda.synchronize()
    if not torch.equal(y, x * 2):
        errors.append("the captured graph's output is wrong")
    del y
    try:
        with torch.cuda.use_mem_pool(pool):
            a = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
            g.reset()
            del g
            b = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
            if not in_pool(pool, a):
                errors.append("a tensor made in the context before the reset is not in the pool")
            if not in_pool(pool, b):
                errors.append("a tensor made in the context after the graph's reset is not in "
                              "the pool")
    except RuntimeError as error:
        errors.append(f"the context raised at its end after the graph's reset: {error}")
    c = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    if in_pool(pool, c):
        errors.append("a tensor made after the context is still in the pool")
    g2, y2 = capture_doubling(pool, x + 1)
    g2.replay()
    torch.cuda.synchronize()
    if not torch.equal(y2, (x + 1) * 2):
        errors.append("a graph captured again into the pool replays wrong")
    del a, b, c, g2, y2
    report(errors)


if __name__ == "__main__":
    main()
