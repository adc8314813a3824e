"""What the history programs share: a replay of a snapshot's trace forward from a first
snapshot's segments, and PyTorch's memory viewer's segment view (MemoryViz.js) walked back,
ported, so that a program can say at which entry the viewer would throw; and the start and
the check of such a replay (begin, check_replay).

Used by case_ab_history_segment_events.py and case_ab_history_foreign_segments.py.
"""
import bisect

import torch
from dropin_report import settle

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


def begin(**record):
    """Stops recording, settles, takes a first snapshot and starts recording (`record`: the
    arguments of _record_memory_history). Returns the snapshot and memory_reserved()."""
    torch.cuda.memory._record_memory_history(enabled=None)
    settle()
    before = torch.cuda.memory._snapshot()
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(**record)
    return before, reserved_before


def check_replay(before, reserved_before, after, reserved_after, device, where, errors):
    """Replays `after`'s trace from `before`'s segments: the end must be `after`'s segments,
    byte for byte, and the bytes added less those taken away memory_reserved()'s growth.
    Appends to `errors` what differs (the end is not compared once the replay failed)."""
    found = len(errors)
    end, net = replay(segments_of(before, device), after["device_traces"][device], where,
                      errors)
    if len(errors) > found:
        return
    want = segments_of(after, device)
    if end.r != want.r:
        errors.append(f"{where}: the replay ends with {end.total()} bytes of segments in "
                      f"{len(end.r)} ranges, the snapshot shows {want.total()} in "
                      f"{len(want.r)}")
    if net != reserved_after - reserved_before:
        errors.append(f"{where}: the trace adds {net} bytes net, memory_reserved() grew by "
                      f"{reserved_after - reserved_before}")
