"""Which pool an allocation goes to when routes nest: use_mem_pool inside use_mem_pool, and a
CUDA graph captured inside a use_mem_pool context.

With PyTorch's allocator (torch 2.11): inside `use_mem_pool(A)` a tensor comes from A; inside a
nested `use_mem_pool(B)` from B, the innermost context; after B's context, from A again; a
graph captured with `pool=P` inside A's context allocates its tensors from P.

Why vmm may differ: vmm keeps the open routes in a list and takes the first whose filter
accepts the stream; the order it searches them decides all three (a probe of both allocators
on torch 2.11 found these answers, run BN in docs/results/2026-12-03.md).
"""
import torch
from dropin_report import capture_doubling, in_pool, report

MIB = 1 << 20


def where(tensor, pools):
    return next((name for name, pool in pools.items() if in_pool(pool, tensor)), "default")


def main():
    errors = []
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda.MemPool, "snapshot"):
        report(errors)
        return
    a, b, p = torch.cuda.MemPool(), torch.cuda.MemPool(), torch.cuda.MemPool()
    pools = {"A": a, "B": b, "P": p}
    with torch.cuda.use_mem_pool(a):
        x = torch.empty(MIB, device="cuda")
        with torch.cuda.use_mem_pool(b):
            y = torch.empty(MIB, device="cuda")
        z = torch.empty(MIB, device="cuda")
    got = (where(x, pools), where(y, pools), where(z, pools))
    if got != ("A", "B", "A"):
        errors.append(f"nested contexts A, B: tensors before, inside and after B came from "
                      f"{got}, expected ('A', 'B', 'A')")
    source = torch.zeros(1024, device="cuda")
    with torch.cuda.use_mem_pool(a):
        graph, out = capture_doubling(p, source)
    if where(out, pools) != "P":
        errors.append(f"a graph captured with pool=P inside A's context allocated from "
                      f"{where(out, pools)}, expected P")
    del x, y, z, out, graph
    report(errors)


if __name__ == "__main__":
    main()
