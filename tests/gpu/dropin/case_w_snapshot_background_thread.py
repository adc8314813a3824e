"""Memory snapshots taken from a background thread while the main thread allocates and frees
(a memory monitor, a watchdog that dumps the allocator's state, a profiler's sampler): with
memory history recording on (Python stacks), a thread calls torch.cuda.memory._snapshot()
and torch.cuda.memory_snapshot() in a loop while the main thread allocates and frees tensors
of 512 B to 48 MiB on two streams, frees some under record_stream on a side stream that is
still busy, allocates some in a torch.cuda.MemPool, and calls empty_cache() now and then.

With PyTorch's allocator each snapshot is taken under the allocator's lock, so every one is
self-consistent whatever the main thread is doing: every segment has a positive total_size
and blocks whose sizes sum to it, laid end to end from the segment's address; each block's
state is active_allocated, active_pending_free or inactive; a segment's allocated_size is the
sum of its active_allocated blocks and its active_size that plus its active_pending_free
ones; segments do not overlap; every trace entry has an action, an address and a size.
The main thread's tensors keep their values, and at the end (no thread running) every live
tensor lies in an active_allocated block of the snapshot.

Why vmm may differ: vmm builds the snapshot from its own block list (vmm_cuda_allocator.cpp
snapshot()) and its trace from its own events; built while another thread changes the pool
it may show blocks that do not tile their segment, overlapping segments or a crash.
"""
import threading

import torch
from dropin_report import report

ITERS = 300
SIZES = [512, 4096, 100_000, 1 << 20, 3 << 20, 48 << 20, 700, 2 << 20]  # bytes
STATES = {"active_allocated", "active_pending_free", "inactive"}


def check_segments(segments, where, errors):
    spans = []
    for s in segments:
        blocks = s.get("blocks", [])
        total = s.get("total_size", 0)
        if total <= 0 or not blocks:
            errors.append(f"{where}: a segment of total_size {total} with {len(blocks)} blocks")
            return
        if sum(b["size"] for b in blocks) != total:
            errors.append(f"{where}: segment at {s['address']:#x}: block sizes sum to "
                          f"{sum(b['size'] for b in blocks)}, total_size {total}")
            return
        address = s["address"]
        for b in blocks:
            if b["address"] != address or b["size"] <= 0 or b["state"] not in STATES:
                errors.append(f"{where}: segment at {s['address']:#x}: block {b['address']:#x} "
                              f"of {b['size']} bytes, state {b['state']}, expected at "
                              f"{address:#x}")
                return
            address += b["size"]
        alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        active = alloc + sum(b["size"] for b in blocks if b["state"] == "active_pending_free")
        if s["allocated_size"] != alloc or s["active_size"] != active:
            errors.append(f"{where}: segment at {s['address']:#x}: allocated_size "
                          f"{s['allocated_size']}, active_size {s['active_size']}; its blocks "
                          f"say {alloc} and {active}")
            return
        spans.append((s["address"], s["address"] + total))
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        if b0 < a1:
            errors.append(f"{where}: segments {a0:#x}..{a1:#x} and one at {b0:#x} overlap")
            return


def watcher(stop, errors, counts):
    try:
        while not stop.is_set() or counts[0] < 5:
            snap = torch.cuda.memory._snapshot()
            check_segments(snap["segments"], f"_snapshot {counts[0]}", errors)
            for trace in snap.get("device_traces", []):
                bad = [e for e in trace if not (isinstance(e.get("action"), str)
                                                 and e["action"] and "size" in e and "addr" in e)]
                if bad:
                    errors.append(f"_snapshot {counts[0]}: trace entries without an action, "
                                  f"addr or size: {bad[:2]}")
            check_segments(torch.cuda.memory_snapshot(), f"memory_snapshot {counts[0]}",
                           errors)
            counts[0] += 1
            if len(errors) > 5:
                return
    except Exception as e:  # noqa: BLE001
        errors.append(f"the snapshot thread: {type(e).__name__}: {str(e)[:300]}")


def main():
    errors = []
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=20000, stacks="python")
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    stop = threading.Event()
    counts = [0]
    thread = threading.Thread(target=watcher, args=(stop, errors, counts))
    thread.start()
    live = []
    pooled = []
    try:
        for i in range(ITERS):
            n = SIZES[i % len(SIZES)]
            t = torch.full((n // 4,), float(i % 50), device="cuda")
            live.append((i % 50, t))
            if i % 7 == 0:
                with torch.cuda.stream(side):
                    torch.cuda._sleep(200_000)
                    u = torch.empty(n, dtype=torch.uint8, device="cuda")
                    u.fill_(1)
                u.record_stream(torch.cuda.current_stream())
                t.record_stream(side)
                del u
            if i % 11 == 0:
                with torch.cuda.use_mem_pool(pool):
                    pooled.append((i % 50, torch.full((n // 4,), float(i % 50), device="cuda")))
                if len(pooled) > 4:
                    pooled.pop(0)
            if len(live) > 12:
                v, old = live.pop((i * 5) % len(live))
                if not bool((old == v).all()):
                    errors.append(f"iteration {i}: a tensor filled with {v} changed")
                del old
            if i % 40 == 39:
                torch.cuda.empty_cache()
            del t
    except Exception as e:  # noqa: BLE001
        errors.append(f"the main thread: {type(e).__name__}: {str(e)[:300]}")
    finally:
        stop.set()
        thread.join(60)
    if thread.is_alive():
        errors.append("the snapshot thread did not finish")
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    check_segments(snap["segments"], "the final snapshot", errors)
    blocks = {b["address"]: b for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    for v, t in live + pooled:
        if not bool((t == v).all()):
            errors.append(f"at the end a tensor filled with {v} changed")
        b = blocks.get(t.data_ptr())
        if b is None or b["size"] < t.numel() * 4:
            errors.append(f"at the end a live tensor of {t.numel() * 4} bytes is not an "
                          f"active_allocated block of the snapshot")
            break
    torch.cuda.memory._record_memory_history(enabled=None)
    del live, pooled
    report(errors[:12])


if __name__ == "__main__":
    main()
