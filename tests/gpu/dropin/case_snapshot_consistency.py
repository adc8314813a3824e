"""torch.cuda.memory_snapshot() / torch.cuda.memory._snapshot() agree with the tensors and
with memory_stats().

PyTorch computes each block's address as the segment's address plus the sizes of the blocks
before it (torch/csrc/cuda/Module.cpp), so the blocks of a segment must tile it exactly. With
PyTorch's allocator: sum(block sizes) == total_size for every segment; every live tensor's
data_ptr() is the address of an "active_allocated" block whose size >= its bytes and whose
requested_size == its bytes; sum of active_allocated block sizes == memory_allocated(); sum of
segments' total_size == memory_reserved(); a segment's allocated_size == the sum of its
active_allocated blocks; and _memory_viz.segsum() / segment_plot() accept the snapshot.

Why vmm may differ: its segments are runs of mapped chunks with retired and parked space
(sharing), built from its own block list (vmm_cuda_allocator.cpp snapshot()).
"""
import sys

import torch
from torch.cuda import _memory_viz

MIB = 1 << 20


def main():
    torch.manual_seed(0)
    keep = []
    sizes = [700, 4096, 100_000, 3 * MIB + 100, 17 * MIB, 64 * MIB, 200, 2 * MIB]
    for i, n in enumerate(sizes * 3):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        if i % 3 != 1:  # free every third: holes in segments
            keep.append(t)
    del t
    torch.cuda.synchronize()
    errors = []
    snap = torch.cuda.memory._snapshot()
    segs = snap["segments"]
    blocks = {}
    for seg in segs:
        for key in ("address", "total_size", "allocated_size", "active_size", "stream",
                    "segment_type", "device", "blocks"):
            if key not in seg:
                errors.append(f"segment lacks key {key!r}")
        addr = seg["address"]
        tiled = sum(b["size"] for b in seg["blocks"])
        if tiled != seg["total_size"]:
            errors.append(f"segment {addr:#x}: blocks add up to {tiled}, total_size "
                          f"{seg['total_size']}")
        alloc = 0
        for b in seg["blocks"]:
            if b.get("address", addr) != addr:
                errors.append(f"segment {addr:#x}: block address {b['address']:#x} != {addr:#x}")
            blocks[addr] = (b["state"], b["size"], b.get("requested_size"))
            if b["state"] == "active_allocated":
                alloc += b["size"]
            addr += b["size"]
        if alloc != seg["allocated_size"]:
            errors.append(f"segment {seg['address']:#x}: allocated_size {seg['allocated_size']} "
                          f"!= sum of its active_allocated blocks {alloc}")
    for t in keep:
        got = blocks.get(t.data_ptr())
        if got is None:
            errors.append(f"no block at the address of a live {t.numel()}-byte tensor")
            continue
        state, size, requested = got
        if state != "active_allocated" or size < t.numel():
            errors.append(f"the {t.numel()}-byte tensor's block is {state}, {size} bytes")
        if requested is not None and requested != t.numel():
            errors.append(f"the {t.numel()}-byte tensor's block has requested_size {requested}")
    all_alloc = sum(b[1] for b in blocks.values() if b[0] == "active_allocated")
    if all_alloc != torch.cuda.memory_allocated():
        errors.append(f"active_allocated blocks add up to {all_alloc}, memory_allocated() is "
                      f"{torch.cuda.memory_allocated()}")
    reserved = sum(s["total_size"] for s in segs)
    if reserved != torch.cuda.memory_reserved():
        errors.append(f"segments add up to {reserved}, memory_reserved() is "
                      f"{torch.cuda.memory_reserved()}")
    legacy = torch.cuda.memory_snapshot()
    if len(legacy) != len(segs):
        errors.append(f"memory_snapshot() has {len(legacy)} segments, _snapshot() {len(segs)}")
    try:
        text = _memory_viz.segsum(snap)
        if "segment" not in text.lower() and "total" not in text.lower():
            errors.append("segsum printed nothing recognisable")
        _memory_viz.segment_plot(snap)
    except Exception as e:  # noqa: BLE001
        errors.append(f"_memory_viz failed on the snapshot: {type(e).__name__}: {e}")
    if errors:
        for e in errors[:30]:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
