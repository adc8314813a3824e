#!/usr/bin/env python3
"""Peak reserved / peak allocated of a trace's small blocks, with and without size classes.

A model, not the pool: it asks how much of the small arena's fragmentation (docs/DESIGN.md
§2b, the `small_tensor_churn` trace) placing blocks by size class would take away.

  one heap    Every small block in one address-ordered heap: best fit (the smallest free
              block that holds it, ties to the lowest address), split at its start, freed
              blocks joined with free neighbours; where none fits, the heap grows at its top
              by whole chunks (the pool's small arena, one range grown 2 MiB at a time).
  K classes   The same heap rule, one heap per size class: the block sizes between --lo and
              --hi split into K classes of equal width in log scale (those below --lo in
              the first, above --hi in the last). A class's free space serves only its
              class.

Only requests of at most --hi bytes count (the small arena's); sizes are rounded up to 512
bytes. The figure is the peak of the chunks the heaps hold together over the peak live bytes.
A chunk wholly free in one class could move to another (reclaim_policy.h); --move counts
those as given back at each growth (on small_tensor_churn it changes nothing: with some
sixteen blocks a chunk, no chunk is wholly free).

    python3 bench/small_class_model.py small_tensor_churn --classes 1,8,16
    python3 bench/small_class_model.py small_tensor_churn --seed 1 --classes 16 --move
"""
import argparse
import bisect
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import traces  # noqa: E402

KIB = 1 << 10
MIB = 1 << 20


def _round(nbytes):
    return (nbytes + 511) // 512 * 512


class Heap:
    """An address-ordered best-fit heap that grows at its top by whole chunks."""

    def __init__(self, chunk):
        self.chunk = chunk
        self.top = 0  # bytes reserved: the heap is [0, top)
        self._by_addr = {}  # free block: addr -> size
        self._by_end = {}  # free block: end -> addr
        self._sorted = []  # free blocks as (size, addr)

    def _insert(self, addr, size):
        end = addr + size
        if end in self._by_addr:  # join the free block after it
            after = self._by_addr[end]
            self._remove(end, after)
            size += after
        if addr in self._by_end:  # and the one before
            before = self._by_end[addr]
            before_size = self._by_addr[before]
            self._remove(before, before_size)
            addr, size = before, size + before_size
        self._by_addr[addr] = size
        self._by_end[addr + size] = addr
        bisect.insort(self._sorted, (size, addr))

    def _remove(self, addr, size):
        del self._sorted[bisect.bisect_left(self._sorted, (size, addr))]
        del self._by_addr[addr]
        del self._by_end[addr + size]

    def allocate(self, size):
        """The address of a new block of `size` bytes (grows the heap where none fits)."""
        i = bisect.bisect_left(self._sorted, (size, -1))
        if i == len(self._sorted):
            tail = self._by_addr.get(self._by_end.get(self.top, -1), 0)
            grow = -(-(size - tail) // self.chunk) * self.chunk
            self._insert(self.top, grow)
            self.top += grow
            i = bisect.bisect_left(self._sorted, (size, -1))
        free_size, addr = self._sorted[i]
        self._remove(addr, free_size)
        if free_size > size:
            self._insert(addr + size, free_size - size)
        return addr

    def free(self, addr, size):
        self._insert(addr, size)

    def whole_free_chunks(self):
        n = 0
        for addr, size in self._by_addr.items():
            lo = -(-addr // self.chunk) * self.chunk
            hi = (addr + size) // self.chunk * self.chunk
            n += max(0, hi - lo) // self.chunk
        return n


def class_of(size, classes, lo, hi):
    """Size class of `size` among `classes` of equal width in log scale over [lo, hi]."""
    if classes == 1 or size <= lo:
        return 0
    return min(classes - 1, int(math.log(size / lo) / math.log(hi / lo) * classes))


def ratio(events, classes, lo=64 * KIB, hi=256 * KIB, chunk=2 * MIB, move=False):
    """Peak held chunks' bytes over peak live bytes of the trace's blocks of at most `hi`."""
    heaps = {}
    live = {}
    live_bytes = peak_live = peak_held = 0
    for op, ident, nbytes in events:
        if op == "a":
            size = _round(nbytes)
            if size > hi:
                continue
            heap = heaps.setdefault(class_of(size, classes, lo, hi), Heap(chunk))
            top = heap.top
            live[ident] = (heap, heap.allocate(size), size)
            live_bytes += size
            peak_live = max(peak_live, live_bytes)
            if heap.top != top:
                held = sum(h.top for h in heaps.values())
                if move:
                    held -= chunk * sum(h.whole_free_chunks() for h in heaps.values())
                peak_held = max(peak_held, held)
        elif ident in live:
            heap, addr, size = live.pop(ident)
            heap.free(addr, size)
            live_bytes -= size
    return peak_held / peak_live if peak_live else 1.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", choices=sorted(traces.WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--classes", default="1,16", help="class counts, comma-separated")
    ap.add_argument("--lo", type=int, default=64 * KIB, help="bytes: the first class's top")
    ap.add_argument("--hi", type=int, default=256 * KIB, help="bytes: the largest small block")
    ap.add_argument("--move", action="store_true", help="wholly free chunks given back")
    args = ap.parse_args(argv)
    events = traces.events(args.trace, seed=args.seed, scale=args.scale)
    for k in (int(x) for x in args.classes.split(",")):
        r = ratio(events, k, args.lo, args.hi, move=args.move)
        print(f"{args.trace} seed {args.seed} scale {args.scale}: "
              f"{'one heap' if k == 1 else f'{k} classes'} {r:.4f}", flush=True)


if __name__ == "__main__":
    main()
