"""A CUDA graph deleted while another one is captured: a serving engine that replaces the
graph of one batch size while it captures the next, dropping the old graph and its output
inside the new capture (or the garbage collector collecting them there).

With PyTorch's allocator the old graph's private pool is only marked as unused during the
capture (its memory goes back at a later empty_cache); the new capture succeeds, its replay
gives the eager result, and once both graphs and their outputs are dropped and the cache is
emptied, memory_allocated() and memory_reserved() are back where they were.

Why vmm may differ: the old graph's pool is a vmm pool whose last use ends inside the new
capture; giving its memory back there (a device synchronisation, unmaps) would invalidate it.
"""

import gc

import torch
from dropin_report import report

NUMEL = 16 << 20  # float32: 64 MiB


def capture(a, steps):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b = a.clone()
        for _ in range(steps):
            b = b.clone() + 1
    return g, b


def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main():
    errors = []
    a = torch.ones(NUMEL, device="cuda")
    b = a.clone()
    for _ in range(3):
        b = b.clone() + 1  # kernels loaded eagerly first
    del b
    settle()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    old = list(capture(a, 3))
    old[0].replay()
    torch.cuda.synchronize()
    if not bool((old[1] == 4).all().item()):
        errors.append("the first graph's replay did not compute a + 3")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            b = a.clone()
            old.clear()  # the old graph and its output: its pool's last use ends here
            gc.collect()
            for _ in range(5):
                b = b.clone() + 1
    except Exception as e:  # noqa: BLE001
        report([f"a capture in which another graph was deleted failed: {type(e).__name__}: {e}"])
        return
    g.replay()
    torch.cuda.synchronize()
    if not bool((b == 6).all().item()):
        errors.append("the new graph's replay did not compute a + 5")
    fresh = torch.full((NUMEL,), 3.0, device="cuda")  # eager work after the capture
    torch.cuda.synchronize()
    if not bool((fresh == 3).all().item()):
        errors.append("an eager tensor made after the capture was wrong")
    del g, b, fresh
    settle()
    if torch.cuda.memory_allocated() != base_alloc:
        errors.append(f"once both graphs are dropped memory_allocated() is "
                      f"{torch.cuda.memory_allocated()}, was {base_alloc} before them")
    if torch.cuda.memory_reserved() > base_res:
        errors.append(f"once both graphs are dropped and the cache emptied memory_reserved() is "
                      f"{torch.cuda.memory_reserved()}, was {base_res} before them")
    report(errors)


if __name__ == "__main__":
    main()
