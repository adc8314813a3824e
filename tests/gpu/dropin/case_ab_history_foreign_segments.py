"""The segments of a torch.cuda.MemPool over a program's own allocator (a CUDAPluggableAllocator:
NCCL's memory pools, vLLM's cuMem allocator) in the memory history, as PyTorch's memory viewer
reads them.

With PyTorch's allocator, recording history from a moment whose segments a first snapshot
shows, then making tensors of 1 KiB to 30 MiB inside such a pool, freeing some, making more,
taking a snapshot, then dropping the tensors and the pool and calling empty_cache():
  - each segment the pool's allocator gave is a segment_alloc entry, with frames naming this
    file, before the first alloc entry in it; each segment handed back is a segment_free, of
    the stream its segment_alloc named;
  - replayed from the first snapshot's segments (history_replay.py), each adding entry covers
    bytes no segment holds, each taking-away entry bytes one holds, and every alloc entry
    lies in a segment at its moment;
    the end of the replay is the last snapshot's segments, byte for byte, and the bytes added
    less those taken away are memory_reserved()'s growth;
  - the viewer's walk back (ported there too) passes over the snapshot taken while the pool's
    tensors live and over the last one;
  - the allocator got back every segment it gave.

Why vmm may differ: vmm serves such a pool from that allocator's segments itself
(torch_plugin/csrc/foreign_segments.h), and recorded no segment entries for them, so the
viewer met allocations in segments the trace never made.
"""
import gc
import os

import torch
from counted_allocator import CountedAllocator
from dropin_report import report
from history_replay import ADDS, begin, check_replay, viewer_walk

ME = os.path.basename(__file__)
MIB = 1 << 20


def covering(entries, addr):
    return [e for e in entries if e["addr"] <= addr < e["addr"] + e["size"]]


def main():
    errors = []
    torch.empty(1, device="cuda")
    device = torch.cuda.current_device()
    lib = CountedAllocator()
    before, reserved_before = begin(max_entries=100_000, stacks="python")

    pool = torch.cuda.MemPool(lib.pluggable.allocator())
    sizes = [1024, 300_000, 3 * MIB, 30 * MIB, 700, 5 * MIB, 12 * MIB]
    with torch.cuda.use_mem_pool(pool):
        pooled = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes * 2]
        del pooled[1::3]
        pooled += [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (9 * MIB, 2000)]
    outside = torch.empty(7 * MIB, dtype=torch.uint8, device="cuda")
    given = lib.n_alloc
    if given == 0:
        errors.append("the MemPool's allocator was never called")
    mid = torch.cuda.memory._snapshot()
    trace = mid["device_traces"][device]
    allocs = [e for e in trace if e["action"] == "segment_alloc"]
    for i, t in enumerate(pooled):
        made = covering(allocs, t.data_ptr())
        if len(made) != 1:
            errors.append(f"pool tensor {i} lies in {len(made)} segment_alloc entries' ranges, "
                          f"not 1")
        elif not any(ME in f.get("filename", "") for f in made[0].get("frames", [])):
            errors.append(f"the segment_alloc entry of pool tensor {i}'s segment has no frame "
                          f"naming this file")
    viewer_walk(mid, device, "the snapshot with the pool's tensors live", errors)

    del pooled, mid, t
    gc.collect()
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = torch.cuda.memory._snapshot()
    reserved_after = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = after["device_traces"][device]
    frees = [e for e in trace if e["action"] == "segment_free"]
    allocs = [e for e in trace if e["action"] == "segment_alloc"]
    back = 0  # segment_free entries handing back a segment a segment_alloc entry made
    for e in frees:
        made = [a for a in allocs if a["addr"] == e["addr"] and a["size"] == e["size"]]
        if not made:
            continue
        back += 1
        if e.get("stream") != made[-1].get("stream"):
            errors.append(f"the segment_free of {e['addr']:#x} names stream {e.get('stream')}, "
                          f"its segment_alloc {made[-1].get('stream')}")
    if back < given:
        errors.append(f"the allocator gave {given} segments; {back} segment_free entries "
                      f"hand back a segment a segment_alloc entry made")
    check_replay(before, reserved_before, after, reserved_after, device, "the replay", errors)
    if not any(e["action"] in ADDS for e in trace):
        errors.append("the trace has no entry that adds a segment")
    viewer_walk(after, device, "the last snapshot", errors)
    if lib.live_bytes != 0 or lib.n_free != lib.n_alloc:
        errors.append(f"after the pool went and empty_cache(), the allocator has "
                      f"{lib.live_bytes} bytes out ({lib.n_alloc} given, {lib.n_free} back)")
    del outside
    lib.close()
    report(errors)


if __name__ == "__main__":
    main()
