"""A CUDA graph captured into a MemPool over a program's own allocator, the MemPool object
dropped before the graph replays (a serving engine that keeps the graph and lets the pool
object go).

With PyTorch's allocator: the capture's allocations come from the program's allocator (it is
called); the temporaries freed during the capture stay in the pool for the graph, so after
`del pool` and empty_cache() the allocator has got nothing back and replays of the graph
compute the right values (a freed segment would be reused or unmapped under the graph); once
the graph and its output are gone too, empty_cache() hands everything back.

Why vmm may differ: the pool is one over another allocator (foreign_segments.h), whose cache
must not go back while the graph (a use of the pool) lives, though the MemPool's end empties
the pool's cache.
"""
import gc

import torch
from counted_allocator import CountedAllocator
from dropin_report import report

N = 1 << 20


def main():
    errors = []
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    lib = CountedAllocator()
    pool = torch.cuda.MemPool(lib.pluggable.allocator())
    static_in = torch.full((N,), 1.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph's users do
        for _ in range(2):
            (static_in * 2 + 1).relu_()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        a = static_in * 2
        b = a + 1  # a and the next temporaries are freed during the capture
        c = torch.sin(b) * 0 + b
        out = c.relu()
        del a, b, c
    if lib.n_alloc == 0:
        errors.append("the capture into the pool never called its allocator")
    frees = lib.n_free
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    if lib.n_free != frees:
        errors.append(f"the pool's allocator got {lib.n_free - frees} segments back while a "
                      f"graph captured into the pool still lives")
    for value in (3.0, -5.0, 0.5):
        static_in.fill_(value)
        g.replay()
        torch.cuda.synchronize()
        expected = max(value * 2 + 1, 0.0)
        got = out[N // 2].item()
        if abs(got - expected) > 1e-6 or float(out.sum().item()) != expected * N:
            errors.append(f"replay with input {value}: got {got}, expected {expected}")
    del g, out
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if lib.live_bytes != 0:
        errors.append(f"with the graph gone and empty_cache(), the allocator still has "
                      f"{lib.live_bytes} bytes out")
    lib.close()
    report(errors)


if __name__ == "__main__":
    main()
