"""torch.cuda.MemPool(no_split=True): a pool in which no two tensors share a segment, what
symmetric memory, NCCL window registration and per-buffer IPC need (one signal pad, one
registration or one handle per allocation).

With PyTorch's allocator (should_split() is false for every block of a no_split pool, so a
block is always a whole segment): every tensor made inside use_mem_pool(pool), 512 B to
24 MiB, begins a segment of pool.snapshot() of its own (its storage's data_ptr() is the
segment's address and no other live tensor of the pool lies in that segment), also after
half of them were freed and the sizes made again (cached segments reused whole), and for the
outputs of a CUDA graph captured into the pool; every tensor keeps what was written; once
everything and the pool are dropped, empty_cache() brings memory_reserved() back.

Why vmm may differ: its private pools carve blocks out of shared chunks, and its snapshot's
segments are runs of chunks holding many blocks; with no_split each block must get a chunk of
its own, apart from its neighbours (Pool::SetNoSplit, docs/DESIGN.md §2g).
"""
import gc

import torch
from dropin_report import report

SIZES = [512, 1000, 4096, 100_000, 1 << 20, (1 << 20) + 4, 3 << 20, 24 << 20]  # bytes


def check(pool, tensors, when, errors):
    """Each tensor begins a segment of the pool that holds no other of `tensors`."""
    segs = pool.snapshot()
    owner = {}
    for t in tensors:
        p, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        hit = [i for i, s in enumerate(segs) if s["address"] <= p < s["address"] + s["total_size"]]
        if not hit:
            errors.append(f"{when}: a tensor of {n} bytes made in the pool is in none of its "
                          f"segments")
        elif segs[hit[0]]["address"] != p:
            errors.append(f"{when}: a tensor of {n} bytes lies {p - segs[hit[0]]['address']} "
                          f"bytes into a segment of {segs[hit[0]]['total_size']} (split)")
        elif hit[0] in owner:
            errors.append(f"{when}: tensors of {owner[hit[0]]} and {n} bytes share a segment "
                          f"of the no_split pool")
        else:
            owner[hit[0]] = n


def values_ok(tensors, when, errors):
    for i, t in enumerate(tensors):
        if not bool((t == (i % 250) + 1).all().item()):
            errors.append(f"{when}: tensor {i} ({t.numel()} bytes) lost its values")


def main():
    errors = []
    torch.empty(1, device="cuda")
    try:
        pool = torch.cuda.MemPool(no_split=True)
    except TypeError:
        print("this torch's MemPool has no no_split; nothing checked")
        report(errors)
        return
    x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (x * 2 + 1).sum()  # warm-up outside a capture, as PyTorch asks
    torch.cuda.current_stream().wait_stream(side)
    warm = torch.cuda.CUDAGraph()
    with torch.cuda.graph(warm):  # a first capture sets up the generator's graph state
        x * 2
    del warm
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_reserved = torch.cuda.memory_reserved()
    with torch.cuda.use_mem_pool(pool):
        ts = [torch.full((n,), (i % 250) + 1, dtype=torch.uint8, device="cuda")
              for i, n in enumerate(SIZES * 2)]
    check(pool, ts, "first tensors", errors)
    values_ok(ts, "first tensors", errors)
    for i in range(0, len(ts), 2):
        ts[i] = None
    gc.collect()
    torch.cuda.synchronize()
    with torch.cuda.use_mem_pool(pool):
        for i in range(0, len(ts), 2):
            ts[i] = torch.full((SIZES[i % len(SIZES)],), (i % 250) + 1, dtype=torch.uint8,
                               device="cuda")
    check(pool, ts, "after half were freed and made again", errors)
    values_ok(ts, "after half were made again", errors)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        y = x * 2
        z = y + 1
        s = z.sum()
    x.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    check(pool, ts + [y, z, s], "with the outputs of a graph captured into the pool", errors)
    if float(s.item()) != 7.0 * (1 << 16) or not bool((z == 7.0).all().item()):
        errors.append(f"the graph captured into the no_split pool gave {float(s.item())}, "
                      f"expected {7.0 * (1 << 16)}")
    del g, y, z, s, ts
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() > base_reserved:
        errors.append(f"with the pool and its tensors gone and the cache emptied, "
                      f"memory_reserved() is {torch.cuda.memory_reserved()}, was "
                      f"{base_reserved}")
    report(errors)


if __name__ == "__main__":
    main()
