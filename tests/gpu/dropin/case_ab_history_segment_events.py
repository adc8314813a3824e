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
  - the viewer's walk back (ported here as MemoryViz.js does it) reaches the first entry of
    the second snapshot, and of each snapshot a second thread takes while the main thread
    allocates, frees, empties the cache and drops MemPools, without a mapping that lies in
    no single segment or a block drawn in no segment.

Why vmm may differ: vmm maps chunks into reserved ranges, moves them and unmaps them without
PyTorch's allocator; its trace had only allocations and frees, so the segments never changed
in the viewer, and a snapshot read while another thread maps memory could show segments the
trace does not explain (alloc_history.h, vmm_set_mapping_callback).
"""
import bisect
import gc
import os
import threading

import torch
from dropin_report import report

ME = os.path.basename(__file__)
MIB = 1 << 20
ADDS = {"segment_alloc", "segment_map"}
TAKES = {"segment_free", "segment_unmap"}


class Bytes:
    """A set of byte ranges [lo, hi), kept merged and sorted."""

    def __init__(self, ranges=()):
        self.r = []
        for lo, hi in sorted(ranges):
            self.add(lo, hi)

    def overlaps(self, lo, hi):
        return any(a < hi and lo < b for a, b in self.r)

    def covers(self, lo, hi):
        return any(a <= lo and hi <= b for a, b in self.r)

    def add(self, lo, hi):
        keep = [(a, b) for a, b in self.r if b < lo or hi < a]
        for a, b in self.r:
            if not (b < lo or hi < a):
                lo, hi = min(lo, a), max(hi, b)
        self.r = sorted(keep + [(lo, hi)])

    def take(self, lo, hi):
        out = []
        for a, b in self.r:
            if b <= lo or hi <= a:
                out.append((a, b))
                continue
            if a < lo:
                out.append((a, lo))
            if hi < b:
                out.append((hi, b))
        self.r = out

    def total(self):
        return sum(b - a for a, b in self.r)


def segments_of(snap, device):
    return Bytes((s["address"], s["address"] + s["total_size"])
                 for s in snap["segments"] if s["device"] == device)


def replay(start, trace, where, errors):
    """Walks `trace` forward from the segments `start`; returns (segments, bytes added less
    bytes taken away)."""
    now, net = start, 0
    for i, e in enumerate(trace):
        lo, hi = e["addr"], e["addr"] + e["size"]
        if e["action"] in ADDS:
            if now.overlaps(lo, hi):
                errors.append(f"{where}: entry {i} ({e['action']}) adds {lo:#x}+{e['size']}, "
                              f"which a segment holds already")
                return now, net
            now.add(lo, hi)
            net += e["size"]
        elif e["action"] in TAKES:
            if not now.covers(lo, hi):
                errors.append(f"{where}: entry {i} ({e['action']}) takes away {lo:#x}+"
                              f"{e['size']}, which no segment holds whole")
                return now, net
            now.take(lo, hi)
            net -= e["size"]
        elif e["action"] == "alloc" and not now.covers(lo, hi):
            errors.append(f"{where}: entry {i} allocates {lo:#x}+{e['size']} outside every "
                          f"segment of its moment")
            return now, net
    return now, net


class Viewer:
    """The segment view of PyTorch's memory viewer (MemoryViz.js), ported: annotate_snapshot's
    stream names and free elision, then MemoryView's simulate_memory, walked back from the
    snapshot one entry at a time, so that each moment is the view of that entry. Where the
    viewer throws (a segment_map or segment_alloc in no single segment, a block drawn in no
    segment), an error names the entry."""

    def __init__(self, snap, device):
        names = {0: 0}

        def name(s):
            if s not in names:
                names[s] = len(names)
            return names[s]
        self.trace = []
        for d, trace in enumerate(snap["device_traces"]):
            mine = []
            for t in trace:
                t = dict(t, stream=name(t.get("stream")))
                if (t["action"] == "free_completed" and mine
                        and mine[-1]["action"] == "free_requested"
                        and mine[-1]["addr"] == t["addr"]):
                    mine[-1]["action"] = "free"
                    continue
                mine.append(t)
            if d == device:
                self.trace = mine
        self.segments, self.blocks = [], {}
        for seg in snap["segments"]:
            stream = name(seg.get("stream"))
            if seg["device"] != device:
                continue
            self.segments.append(dict(addr=seg["address"], size=seg["total_size"],
                                      stream=stream))
            addr = seg["address"]
            for b in seg["blocks"]:
                if b["state"] in ("active_allocated", "active_pending_free"):
                    self.blocks[addr] = b["size"]
                addr += b["size"]
        self.segments.sort(key=lambda x: x["addr"])

    def _map(self, seg):  # map_segment(merge=True): a segment_unmap walked back
        # The viewer joins the piece to a neighbour of the same stream (how it names streams
        # differs between its versions); never joined here, which asks more of the trace.
        segs = self.segments
        i = next((k for k, e in enumerate(segs) if e["addr"] > seg["addr"]), len(segs))
        segs.insert(i, seg)

    def _unmap(self, seg):  # unmap_segment(merge=True): a segment_map walked back
        segs = self.segments
        end = seg["addr"] + seg["size"]
        i = next((k for k, e in enumerate(segs)
                  if e["addr"] <= seg["addr"] and end <= e["addr"] + e["size"]), None)
        if i is None:
            return False
        e = segs[i]
        e_end = e["addr"] + e["size"]
        if e["addr"] == seg["addr"]:
            e["addr"] += seg["size"]
            e["size"] -= seg["size"]
            if e["size"] == 0:
                del segs[i]
        elif e_end == end:
            e["size"] -= seg["size"]
        else:
            e["size"] = seg["addr"] - e["addr"]
            segs.insert(i + 1, dict(addr=end, size=e_end - end, stream=seg["stream"]))
        return True

    def _blocks_placed(self):
        spans = sorted((e["addr"], e["addr"] + e["size"]) for e in self.segments)
        starts = [a for a, _ in spans]
        for addr in self.blocks:
            k = bisect.bisect_right(starts, addr) - 1
            if k < 0 or addr >= spans[k][1]:
                return addr
        return None

    def walk(self, where, errors):
        """Walks back to the view of the first entry, checking the view of every entry;
        returns how many segment entries it walked back."""
        n = len(self.trace)
        seen = 0
        lost = self._blocks_placed()  # the view of the last entry
        if lost is not None:
            errors.append(f"{where}: the viewer fails showing the last entry (a block at "
                          f"{lost:#x} lies in no segment)")
            return seen
        for i in range(n - 1, 0, -1):  # the view of entry i - 1: entries i.. walked back
            e = self.trace[i]
            seg = dict(addr=e["addr"], size=e["size"], stream=e["stream"])
            a = e["action"]
            if a == "free":
                self.blocks[e["addr"]] = e["size"]
            elif a == "free_requested":
                if e["addr"] not in self.blocks:
                    errors.append(f"{where}: the viewer fails at entry {i} of {n} (a "
                                  f"free_requested of {e['addr']:#x}, no such block)")
                    return seen
            elif a == "free_completed":
                self.blocks[e["addr"]] = e["size"]
            elif a == "alloc":
                self.blocks.pop(e["addr"], None)
            elif a == "segment_unmap":
                seen += 1
                self._map(seg)
            elif a == "segment_free":
                seen += 1
                k = next((k for k, x in enumerate(self.segments) if x["addr"] > seg["addr"]),
                         -1)
                self.segments.insert(k, seg)
            elif a in ("segment_map", "segment_alloc"):
                seen += 1
                if a == "segment_alloc":
                    k = next((k for k, x in enumerate(self.segments)
                              if x["addr"] == seg["addr"]), -1)
                    if self.segments:  # splice(-1, 1) of an empty list removes nothing
                        del self.segments[k]
                elif not self._unmap(seg):
                    errors.append(f"{where}: the viewer fails at entry {i} of {n} (a "
                                  f"segment_map of {e['addr']:#x}+{e['size']} lies in no one "
                                  f"segment)")
                    return seen
            if a in ("free", "free_completed") or a in ADDS:
                lost = self._blocks_placed()
                if lost is not None:
                    errors.append(f"{where}: the viewer fails showing entry {i - 1} of {n} "
                                  f"(a block at {lost:#x} lies in no segment)")
                    return seen
        return seen


def viewer_walk(snap, device, where, errors):
    return Viewer(snap, device).walk(where, errors)


def one_thread(device, errors):
    torch.cuda.memory._record_memory_history(enabled=None)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory._snapshot()
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
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
    end, net = replay(segments_of(before, device), trace, "one thread", errors)
    if errors:
        return
    want = segments_of(after, device)
    if end.r != want.r:
        errors.append(f"one thread: the replay ends with {end.total()} bytes of segments in "
                      f"{len(end.r)} ranges, the snapshot shows {want.total()} in "
                      f"{len(want.r)}")
    if net != reserved_after - reserved_before:
        errors.append(f"one thread: the trace adds {net} bytes net, memory_reserved() grew by "
                      f"{reserved_after - reserved_before}")
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


def main():
    errors = []
    torch.empty(1, device="cuda")
    device = torch.cuda.current_device()
    one_thread(device, errors)
    two_threads(device, errors)
    report(errors)


if __name__ == "__main__":
    main()
