"""A deleted CUDA graph's output freed while another graph is captured: a serving engine that
dropped the graph of one batch size but kept its last result, and lets go of that result
inside the capture of the next graph (or the garbage collector collects it there).

With PyTorch's allocator the freed output goes back to the old graph's private pool, whose
memory is given back only at a later empty_cache; the capture succeeds, its replay gives the
eager result, and once everything is dropped and the cache is emptied, memory_allocated() and
memory_reserved() are back where they were. (Deleting the graph object itself inside a
capture fails with PyTorch's allocator too: destroying a graph is not allowed while a stream
captures.)

Why vmm may differ: the old graph's pool is a vmm pool, closed when the graph was deleted,
whose last block goes inside the new capture; destroying the pool there (a device
synchronisation, unmaps) would invalidate the capture.
"""

import gc

import torch
from dropin_report import capture_increments, memory_back, report, settle

NUMEL = 16 << 20  # float32: 64 MiB


def main():
    errors = []
    a = torch.ones(NUMEL, device="cuda")
    b = a.clone()
    for _ in range(3):
        b = b.clone() + 1  # kernels loaded eagerly first
    del b
    settle()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    old_graph, old = capture_increments(a, 3)
    old_graph.replay()
    torch.cuda.synchronize()
    kept = [old]
    del old_graph, old  # the graph goes; its output is kept
    settle()
    if not bool((kept[0] == 4).all().item()):
        errors.append("the old graph's output changed when the graph was deleted")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            b = a.clone()
            kept.clear()  # the old graph's last block
            gc.collect()
            for _ in range(5):
                b = b.clone() + 1
    except Exception as e:  # noqa: BLE001
        report([f"a capture in which a deleted graph's output was freed failed: "
                f"{type(e).__name__}: {e}"])
        return
    g.replay()
    torch.cuda.synchronize()
    if not bool((b == 6).all().item()):
        errors.append("the new graph's replay did not compute a + 5")
    fresh = torch.full((NUMEL,), 3.0, device="cuda")  # eager work after the capture
    torch.cuda.synchronize()
    if not bool((fresh == 3).all().item()):
        errors.append("an eager tensor made after the capture was wrong")
    g.replay()
    torch.cuda.synchronize()
    if not bool((b == 6).all().item()):
        errors.append("a second replay did not compute a + 5")
    del g, b, fresh
    settle()
    memory_back(errors, base_alloc, base_res, "once both graphs are dropped")
    report(errors)


if __name__ == "__main__":
    main()
