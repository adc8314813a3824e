"""CUDA graphs captured in each capture_error_mode ("global", the default; "thread_local",
what torch.compile's graph trees use; "relaxed", what code that must run lazy library
set-up inside a capture asks for), with the memory statistics read from inside the captured
region (a memory logger or a profiler hook that runs on every forward, also while it is being
captured), replays with new inputs after empty_cache() and after eager churn, and
CUDAGraph.reset() while the graph's output is still held (a serving engine re-capturing
after a model reload, keeping the last result).

With PyTorch's allocator the capture's allocations come from the graph's private pool (the
64 MiB temporaries included, which need new segments while capturing); memory_allocated(),
memory_reserved(), memory_stats() and memory_snapshot() are host-side reads of the
allocator's state, legal in any capture mode, and inside the capture memory_allocated() is
at least its value before the capture (the capture's live tensors count); every replay gives
what eager code gives (within 1e-4: the capture stream's cuBLAS workspace is not the eager
stream's) whatever
empty_cache() or eager tensors of the same sizes filled with other values did in between
(empty_cache() leaves a live graph's pool alone); after reset() the output held keeps the
last replay's values while eager tensors of its size come and go, and once the outputs are
dropped too (every name bound to one, loop variables included; the inputs x and w and both
streams' cuBLAS workspaces, live at the baseline, stay live) memory_allocated() and
allocation.all.current are back at their baseline and, after empty_cache(),
memory_reserved() is no higher than at the baseline (the reset graphs' pools, holding
nothing, are released). Assumed (not read in PyTorch's source
for 2.11): that memory_snapshot() during a capture makes no CUDA call that a capture forbids
(PyTorch's allocator builds it from its own block lists).

Why vmm may differ: vmm's statistics and snapshot read its pools, which may take locks or
call the driver (cuMemGetInfo, event queries) that a global capture forbids; growing a
private pool maps new chunks during the capture; and reset() releases the private pool
while one of its blocks (the output) is still live.
"""
import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20
BIG = 16 * MIB  # float32 elements: 64 MiB


def step(x, w):
    h = torch.tanh(x @ w)
    scratch = torch.empty(BIG, device="cuda")
    scratch.fill_(0.5)
    s, _ = torch.sort(h.flatten())
    out = h * scratch[: h.numel()].view_as(h) + s.view_as(h).cumsum(dim=1) * 1e-3
    return out


def warm_up(x, w, cap):
    """step() on the capture stream (a side stream, as PyTorch asks for warm-ups): its
    kernels, and the cuBLAS workspace of (handle, cap), made outside any capture."""
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        for _ in range(2):
            step(x, w)
    torch.cuda.current_stream().wait_stream(cap)
    torch.cuda.synchronize()


def capture(mode, x, w, cap, seen, errors):
    warm_up(x, w, cap)
    before = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=cap, capture_error_mode=mode):
        out = step(x, w)
        # What a memory logger reads while the forward is being captured.
        allocated = torch.cuda.memory_allocated()
        reserved = torch.cuda.memory_reserved()
        stats = torch.cuda.memory_stats()
        segments = torch.cuda.memory_snapshot()
    seen[mode] = (allocated, reserved, stats.get("allocated_bytes.all.current"), len(segments))
    if allocated < before:
        errors.append(f"{mode}: memory_allocated() inside the capture {allocated} < {before} "
                      f"before it")
    if stats.get("allocated_bytes.all.current") != allocated or reserved < allocated:
        errors.append(f"{mode}: inside the capture memory_stats() / memory_reserved() disagree "
                      f"with memory_allocated() ({stats.get('allocated_bytes.all.current')}, "
                      f"{reserved}, {allocated})")
    return g, out


def main():
    errors = []
    torch.manual_seed(0)
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda") / 32
    cap = torch.cuda.Stream()
    step(x, w)  # kernels and the cuBLAS workspaces of both streams before the baseline
    warm_up(x, w, cap)
    base, res0, count0 = baseline()

    graphs, seen = {}, {}
    for mode in ("global", "thread_local", "relaxed"):
        try:
            graphs[mode] = capture(mode, x, w, cap, seen, errors)
        except Exception as e:  # noqa: BLE001
            errors.append(f"capture_error_mode={mode!r}: {type(e).__name__}: {str(e)[:300]}")
    for rnd in range(4):
        x.copy_(torch.randn(512, 512, device="cuda"))
        if rnd % 2:
            settle()  # empty_cache() between replays
        else:
            junk = [torch.full((BIG,), -3.0, device="cuda") for _ in range(2)]
            junk.append(torch.full((512, 512), -4.0, device="cuda"))
        want = step(x, w)
        for mode, (g, out) in graphs.items():
            g.replay()
            torch.cuda.synchronize()
            if not torch.allclose(out, want, rtol=1e-4, atol=1e-4):
                diff = float((out - want).abs().max().item())
                errors.append(f"round {rnd}: the {mode} graph's replay differs from eager "
                              f"(max difference {diff})")
        junk = None
        del want

    # reset() with the output held: the output keeps the last replay's values.
    last = {mode: out.clone() for mode, (_, out) in graphs.items()}
    outs = {}
    for mode, (g, out) in graphs.items():
        g.reset()
        outs[mode] = out
    graphs = g = out = None  # the loop variables held the last graph and its output too
    settle()
    churn = [torch.full((512, 512), 7.0, device="cuda") for _ in range(64)]
    churn += [torch.full((BIG,), 8.0, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    for mode, out in outs.items():
        if not torch.equal(out, last[mode]):
            errors.append(f"the {mode} graph's output changed after reset() while eager "
                          f"tensors came and went")
    # x and w (and the two streams' cuBLAS workspaces) were live at the baseline and stay live
    # here; `out`, the loop variable above, held the last graph's output.
    del churn, outs, last, out
    settle()  # memory_back() reads the statistics as they are: the cache is emptied here
    memory_back(errors, base, res0, "with the graphs reset and their outputs dropped", count0)
    del x, w, cap
    report(errors)


if __name__ == "__main__":
    main()
