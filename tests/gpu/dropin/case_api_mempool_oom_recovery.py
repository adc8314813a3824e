"""Out of memory inside torch.cuda.use_mem_pool: a serving engine grows a cache of blocks in a
MemPool of its own until the per-process cap says no, and goes on with what it has (freeing
and re-making blocks in the pool, allocating outside it).

With PyTorch's allocator and the process capped by set_per_process_memory_fraction at what it
holds plus 1 GiB + 128 MiB: inside use_mem_pool(pool), 256 MiB blocks are made until
torch.cuda.OutOfMemoryError (4 fit, the 5th raises); the exception leaves the context, after
which pool.use_count() is 1 again and every block keeps its values; small eager tensors
(16 MiB in all) are made outside the pool, lie in no segment of pool.snapshot(), and are
right; two pool blocks are freed and use_mem_pool(pool) makes two again, from the pool's own
freed memory (no growth, though the cap is reached); empty_cache() with the pool alive leaves
the live blocks intact; a 512 MiB request in the pool raises OutOfMemoryError again with the
same aftermath; then with the cap lifted, del pool, its blocks and the eager tensors,
memory_allocated() is back at the baseline and empty_cache() brings memory_reserved() back to
what it was.

Why vmm may differ: a MemPool is a vmm private pool reached through a route
(beginAllocateToPool); an allocation there that fails takes VmmAllocator::Malloc's path with
a route (no use-on-OOM pools, OutOfMemory with the pool's id), the cap is vmm's DeviceCap over
all of the GPU's pools, and the route and the pool's use count must be released when the
exception leaves use_mem_pool.
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20
BLOCK = 64 * MIB  # float32 elements: 256 MiB


def inside(t, segments):
    p = t.data_ptr()
    return any(s["address"] <= p < s["address"] + s["total_size"] for s in segments)


def fill_pool(pool, blocks, limit, errors, where):
    """Makes 256 MiB blocks in `pool` until OutOfMemoryError (at most `limit`)."""
    raised = None
    try:
        with torch.cuda.use_mem_pool(pool):
            while len(blocks) < limit:
                t = torch.empty(BLOCK, device="cuda")
                t.fill_(float(len(blocks) + 1))
                blocks.append(t)
    except torch.cuda.OutOfMemoryError:
        raised = True
    except Exception as e:  # noqa: BLE001
        errors.append(f"{where}: {type(e).__name__} instead of OutOfMemoryError: {str(e)[:200]}")
    if pool.use_count() != 1:
        errors.append(f"{where}: after the exception left use_mem_pool, use_count() is "
                      f"{pool.use_count()}, expected 1")
    return raised


def check_blocks(blocks, where, errors):
    for i, t in enumerate(blocks):
        v = float(t[0].item()), float(t[-1].item()), float(t[BLOCK // 2].item())
        if v != (float(i + 1),) * 3:
            errors.append(f"{where}: pool block {i} reads {v}, expected {float(i + 1)}")


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    errors = []
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction((base_reserved + 1152 * MIB) / total)
    pool = torch.cuda.MemPool()
    blocks = []
    if not fill_pool(pool, blocks, 12, errors, "filling the pool"):
        errors.append(f"{len(blocks)} blocks of 256 MiB fitted under a cap of 1152 MiB")
    if len(blocks) != 4:
        errors.append(f"{len(blocks)} blocks of 256 MiB fitted under a cap of 1152 MiB, "
                      f"expected 4")
    check_blocks(blocks, "after the OOM", errors)

    eager = [torch.full((n,), 2.0, device="cuda") for n in (1000, 250_000, MIB, 2 * MIB)]
    segs = pool.snapshot()
    if any(inside(t, segs) for t in eager):
        errors.append("an eager tensor made after the OOM lies in the pool's segments")
    if not all(inside(t, segs) for t in blocks):
        errors.append("a block made in use_mem_pool is not in pool.snapshot()")
    if sum(float(t.sum().item()) for t in eager) != 2.0 * (1000 + 250_000 + 3 * MIB):
        errors.append("eager tensors made after the OOM are wrong")

    reserved = torch.cuda.memory_reserved()
    del blocks[3], blocks[1]
    with torch.cuda.use_mem_pool(pool):
        try:
            for i in (1, 3):
                t = torch.empty(BLOCK, device="cuda")
                t.fill_(float(i + 1))
                blocks.insert(i, t)
            del t
        except Exception as e:  # noqa: BLE001
            errors.append(f"re-making two freed blocks in the pool at the cap: "
                          f"{type(e).__name__}: {str(e)[:200]}")
    if len(blocks) == 4 and torch.cuda.memory_reserved() > reserved:
        errors.append(f"re-making two freed pool blocks grew memory_reserved from {reserved} to "
                      f"{torch.cuda.memory_reserved()}")
    torch.cuda.empty_cache()
    check_blocks(blocks, "after re-making two blocks and empty_cache()", errors)

    big = []
    try:
        with torch.cuda.use_mem_pool(pool):
            big.append(torch.empty(2 * BLOCK, device="cuda"))
        errors.append("a 512 MiB request in the pool at the cap did not raise")
    except torch.cuda.OutOfMemoryError:
        pass
    except Exception as e:  # noqa: BLE001
        errors.append(f"a 512 MiB request in the pool: {type(e).__name__}: {str(e)[:200]}")
    if pool.use_count() != 1:
        errors.append(f"after the second OOM use_count() is {pool.use_count()}, expected 1")
    check_blocks(blocks, "after the second OOM", errors)

    torch.cuda.set_per_process_memory_fraction(1.0)
    del pool
    gc.collect()
    check_blocks(blocks, "after del pool", errors)
    del blocks, eager, big
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"at the end memory_allocated is {torch.cuda.memory_allocated()}, {base} "
                      f"at the start")
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() > base_reserved:
        errors.append(f"after empty_cache memory_reserved is {torch.cuda.memory_reserved()}, "
                      f"{base_reserved} at the start")
    report(errors)


if __name__ == "__main__":
    main()
