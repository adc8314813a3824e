"""The segments of a memory snapshot's trace, as PyTorch's memory viewer reads them: its segment
view starts from the snapshot's segments and walks the trace back, taking away what each
segment_alloc or segment_map entry added and putting back what each segment_free or
segment_unmap entry took (it fails on a mapping that lies in no segment), to draw the
segments of any moment; memory-debugging guides use that view to see when and where the
allocator asked the driver for memory.

With PyTorch's allocator, recording history from a moment whose segments a first snapshot
shows, then allocating tensors of 1 KiB to 200 MiB, freeing some, calling empty_cache(),
allocating in a torch.cuda.MemPool and dropping it:
  - the trace has entries that add segments and entries that take them away;
  - replayed from the first snapshot's segments, each adding entry covers bytes that no
    segment holds, each taking-away entry bytes that one holds, and every "alloc" entry lies
    in a segment at its moment; the end of the replay is the second snapshot's segments, byte
    for byte, and the bytes added less those taken away are memory_reserved()'s growth;
  - an adding entry made for an allocation of this file carries frames naming this file;
    recorded without stacks, the entries adding a side stream's allocation's memory name
    that stream;
  - the viewer's walk back (ported here as MemoryViz.js does it) reaches the first entry of
    the second snapshot, and of each snapshot a second thread takes while the main thread
    allocates, frees, empties the cache and drops MemPools, without a mapping that lies in
    no single segment or a block drawn in no segment.

Why vmm may differ: vmm maps chunks into reserved ranges, moves them and unmaps them without
PyTorch's allocator; its trace had only allocations and frees, so the segments never changed
in the viewer, and a snapshot read while another thread maps memory could show segments the
trace does not explain (alloc_history.h, vmm_set_mapping_callback).
"""
import gc
import os
import threading

import torch
from dropin_report import report
from history_replay import ADDS, TAKES, begin, check_replay, viewer_walk

ME = os.path.basename(__file__)
MIB = 1 << 20


def one_thread(device, errors):
    before, reserved_before = begin(max_entries=100_000, stacks="python")
    keep = []
    for i, n in enumerate([1024, 3 * MIB + 100, 200 * MIB, 17 * MIB, 700, 64 * MIB] * 3):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        if i % 3 != 1:
            keep.append(t)
    del t
    keep = keep[::2]
    gc.collect()
    torch.cuda.empty_cache()
    keep += [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (150 * MIB, 5 * MIB)]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        pooled = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (9 * MIB, 2000)]
    del pooled, pool
    gc.collect()
    torch.cuda.empty_cache()
    after = torch.cuda.memory._snapshot()
    reserved_after = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = after["device_traces"][device]
    adds = [e for e in trace if e["action"] in ADDS]
    takes = [e for e in trace if e["action"] in TAKES]
    if not adds or not takes:
        errors.append(f"one thread: {len(adds)} entries add segments and {len(takes)} take "
                      f"them away, while the program grew the pools and emptied the cache")
    check_replay(before, reserved_before, after, reserved_after, device, "one thread", errors)
    if errors:
        return
    if not any(ME in f.get("filename", "") for e in adds for f in e.get("frames", [])):
        errors.append("one thread: no entry that adds a segment has frames naming this file")
    viewer_walk(after, device, "one thread, the viewer", errors)


def two_threads(device, errors):
    torch.cuda.memory._record_memory_history(max_entries=5_000, stacks="python")
    stop = threading.Event()
    seen = [0, 0]  # snapshots, those whose trace had segment entries

    def watch():
        try:
            while not stop.is_set() or seen[0] < 5:
                n = viewer_walk(torch.cuda.memory._snapshot(), device,
                                f"snapshot {seen[0]}", errors)
                seen[0] += 1
                seen[1] += n > 0
                if errors:
                    return
        except Exception as e:  # noqa: BLE001
            errors.append(f"the snapshot thread: {type(e).__name__}: {str(e)[:300]}")

    thread = threading.Thread(target=watch)
    thread.start()
    live = []
    try:
        for i in range(400):
            live.append(torch.empty((i % 9 + 1) * 3 * MIB + 4096 * (i % 5), dtype=torch.uint8,
                                    device="cuda"))
            if len(live) > 6:
                live.pop(i % len(live))
            if i % 25 == 24:
                torch.cuda.empty_cache()
            if i % 40 == 39:  # a MemPool made, used and dropped while snapshots are taken
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    pooled = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
                del pooled, pool
                gc.collect()
    finally:
        stop.set()
        thread.join()
        torch.cuda.memory._record_memory_history(enabled=None)
    if seen[0] < 5 or seen[1] == 0:
        errors.append(f"two threads: {seen[0]} snapshots taken, {seen[1]} with segment entries")


def without_stacks(device, errors):
    """History without stacks (context=None): the entries that add the memory a side stream's
    allocation grew name that stream."""
    begin(max_entries=10_000, context=None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.empty(96 * MIB + 4096, dtype=torch.uint8, device="cuda")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    adds = [e for e in snap["device_traces"][device] if e["action"] in ADDS
            and e["addr"] < t.data_ptr() + t.numel() and t.data_ptr() < e["addr"] + e["size"]]
    if not adds:
        errors.append("without stacks: no entry adds the memory of the side stream's tensor")
    wrong = sorted({e.get("stream") for e in adds} - {side.cuda_stream})
    if wrong:
        errors.append(f"without stacks: entries adding the side stream's memory name streams "
                      f"{wrong}, not {side.cuda_stream}")
    del t
    side.synchronize()


def main():
    errors = []
    torch.empty(1, device="cuda")
    device = torch.cuda.current_device()
    one_thread(device, errors)
    two_threads(device, errors)
    without_stacks(device, errors)
    report(errors)


if __name__ == "__main__":
    main()
