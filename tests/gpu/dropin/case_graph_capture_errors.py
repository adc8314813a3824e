"""A CUDA graph capture that ends in an exception (a Python error in the captured code, an
out-of-memory request inside the capture) leaves the allocator usable.

PyTorch's own test_graph_capture_oom does the second: `with torch.cuda.graph(g):
torch.zeros(2**40, device="cuda")` raises a RuntimeError mentioning out of memory, and the
program goes on. With PyTorch's allocator afterwards: eager allocations work and are not in
a graph pool; memory_allocated() is back at the baseline once the failed graphs are gone;
a new capture and its replays give the eager result; repeated 5 times.

Why vmm may differ: a capture adds a route to a vmm private pool (beginAllocateToPool) that
endAllocateToPool / releasePool must remove and close on every path, and an OOM under a route
takes another branch of VmmAllocator::Malloc (no AllocateOnOom).
"""
import gc

import torch
from dropin_report import report


def main():
    torch.manual_seed(0)
    x = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            (x @ w).relu()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per (handle, stream), allocated by a stream's first matmul
    # (inside a graph's pool during a capture): cleared before each comparison.
    torch._C._cuda_clearCublasWorkspaces()
    base = torch.cuda.memory_allocated()
    errors = []
    for rnd in range(5):
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                y = (x @ w).relu()
                raise ValueError("user error inside capture")
        except ValueError:
            pass
        g2 = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g2):
                torch.zeros(2 ** 40, device="cuda")
            errors.append(f"round {rnd}: 8 TiB inside a capture did not raise")
        except RuntimeError as e:
            if "out of memory" not in str(e).lower():
                errors.append(f"round {rnd}: capture OOM raised {type(e).__name__}: {str(e)[:200]}")
        del g, g2
        y = None
        gc.collect()
        eager = torch.full((1 << 20,), 3.0, device="cuda")
        if float(eager.sum().item()) != 3.0 * (1 << 20):
            errors.append(f"round {rnd}: eager tensor after the failed captures is wrong")
        del eager
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        now = torch.cuda.memory_allocated()
        if now != base:
            errors.append(f"round {rnd}: memory_allocated {now} != {base} after failed captures")
        g3 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g3):
            out = (x @ w).relu() * 2
        g3.replay()
        ref = (x @ w).relu() * 2
        torch.cuda.synchronize()
        if not torch.allclose(out, ref, atol=1e-3):
            errors.append(f"round {rnd}: replay after the failed captures differs from eager")
        del g3, out, ref
        gc.collect()
    report(errors)


if __name__ == "__main__":
    main()
