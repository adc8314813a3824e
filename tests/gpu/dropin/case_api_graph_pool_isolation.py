"""The memory of CUDA graphs stays theirs: blocks freed during a capture (temporaries, a side
stream's tensors, cub's sort and scan scratch) keep serving every replay, whatever the eager
program allocates, writes or empties meanwhile.

Two graphs are captured on a stream of the program's own (torch.cuda.graph(stream=...)) into
one pool from torch.cuda.graph_pool_handle(): the first computes with a 16 MiB temporary it
frees during the capture, forks a side stream that allocates and frees another, and sorts and
scans (torch.sort, torch.cumsum: scratch memory taken and given back inside the capture); the
second reads the first's outputs. With PyTorch's allocator (its documented rules: memory of a
private pool goes to no allocation outside the pool while a graph uses it; graphs sharing a
pool replay in capture order): the outputs lie in segments of memory_snapshot() whose
segment_pool_id is the handle, and eager tensors do not; after 24 eager tensors of 4 KiB to 16 MiB
are allocated and filled with 7, and empty_cache() is called, five pairs of replays with new
inputs give the eager results and leave every eager tensor 7; after g1.reset() and del of
both graphs an output still holds its values while new eager tensors are filled; once the
outputs go memory_allocated() is back at the baseline, and empty_cache() brings
memory_reserved() back to what it was before the captures.

Why vmm may differ: a capture routes allocations to a vmm private pool (beginAllocateToPool),
which must keep blocks freed during the capture from every other allocation and mapped
through empty_cache() (Pool::SetKeepMemory) while a graph lives, name its segments with the
graph's MempoolId in the snapshot, and give its memory back only when the graphs and their
outputs are gone.
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20
N = 4 * MIB  # float32 elements: 16 MiB
K = 1 << 18  # elements sorted and scanned


def in_segments(t, segments):
    p = t.data_ptr()
    return any(s["address"] <= p < s["address"] + s["total_size"] for s in segments)


def pool_segments(handle):
    return [s for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", (0, 0))) == tuple(handle)]


def capture_g1(x, w, side):
    tmp = x * 2.0
    a = tmp + 1.0
    del tmp
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tmp2 = x * 3.0
        b = tmp2 - 1.0
        del tmp2
    torch.cuda.current_stream().wait_stream(side)
    c = torch.sort(a[:K] * w).values
    d = torch.cumsum(b[:K], 0)
    return a, b, c, d


def eager_g1(x, w):
    a = x * 2.0 + 1.0
    b = x * 3.0 - 1.0
    return a, b, torch.sort(a[:K] * w).values, torch.cumsum(b[:K], 0)


def check_layout(handle, outputs, eager, errors):
    segs = pool_segments(handle)
    if not segs:
        errors.append(f"memory_snapshot() has no segment with segment_pool_id {handle}")
        return
    for name, t in outputs.items():
        if not in_segments(t, segs):
            errors.append(f"graph output {name} is not in a segment of the graphs' pool")
    inside = sum(in_segments(t, segs) for t in eager)
    if inside:
        errors.append(f"{inside} of {len(eager)} eager tensors lie in segments of the graphs' "
                      f"pool")


def check_replay(v, x, w, outputs, eager, errors):
    wa, wb, wc, wd = eager_g1(x, w)
    wants = {"a": wa, "b": wb, "c": wc, "d": wd, "e": wa[:K] * wb[:K] + wc + wd}
    for name, got in outputs.items():
        if not torch.equal(got, wants[name]):
            bad = int((got != wants[name]).sum().item())
            errors.append(f"input {v}: after replays {bad} elements of {name} differ from the "
                          f"eager result")
    dirty = sum(not bool((t == 7.0).all().item()) for t in eager)
    if dirty:
        errors.append(f"input {v}: replays changed {dirty} of {len(eager)} eager tensors")


def main():
    torch.manual_seed(0)
    errors = []
    cap, side = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(N, device="cuda")
    w = torch.randn(K, device="cuda")
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):  # warm-up outside capture, as PyTorch's docs ask
        for _ in range(2):
            a, b, c, d = capture_g1(x, w, side)
            e = a[:K] * b[:K] + c + d
    torch.cuda.current_stream().wait_stream(cap)
    torch.cuda.synchronize()
    del a, b, c, d, e
    torch.cuda.empty_cache()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    handle = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=handle, stream=cap):
        a, b, c, d = capture_g1(x, w, side)
    with torch.cuda.graph(g2, pool=handle, stream=cap):
        e = a[:K] * b[:K] + c + d
    if tuple(g1.pool()) != tuple(handle):
        errors.append(f"g1.pool() is {g1.pool()}, captured with pool={handle}")

    eager = [torch.full((n,), 7.0, device="cuda")
             for n in (1024, 300_000, MIB, N) * 6]
    torch.cuda.empty_cache()
    check_layout(handle, {"a": a, "b": b, "e": e}, eager, errors)
    for v in (1.0, -2.0, 0.5, 3.0, -0.25):
        x.fill_(v)
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        check_replay(v, x, w, {"a": a, "b": b, "c": c, "d": d, "e": e}, eager, errors)
        if errors:
            break

    kept_want = (x * 2.0 + 1.0).cpu()
    g1.reset()
    del g1, g2, b, c, d, e
    gc.collect()
    torch.cuda.empty_cache()
    junk = [torch.full((N,), -5.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    if not torch.equal(a.cpu(), kept_want):
        errors.append("an output that outlived its graphs changed when new tensors were made")
    del a, junk, eager
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after the graphs and their outputs went memory_allocated is "
                      f"{torch.cuda.memory_allocated()}, {base} before the captures")
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() > base_reserved:
        errors.append(f"after empty_cache memory_reserved is {torch.cuda.memory_reserved()}, "
                      f"{base_reserved} before the captures")
    if pool_segments(handle):
        errors.append("segments of the graphs' pool remain after the graphs, their outputs and "
                      "empty_cache()")
    report(errors)


if __name__ == "__main__":
    main()
