#!/usr/bin/env python3
"""How much physical memory a trace needs, in two models of a pool of P-byte pages.

A model, not the pool: it places blocks by a simple rule and counts a page as held exactly
while a live block uses it, as if free pages moved and went back at no cost. It asks what the
pool's stranding bound (docs/DESIGN.md §2b) would become if a page could be mapped at more
than one address.

  one address   Every page is mapped at one address. A block goes at the start of the
                smallest gap between live blocks that fits it, or after the last one. A page
                is held while a live block touches it: the free part of a page beside a live
                block serves only blocks placed there.
  page-aware    One address, as above, but a block goes where it needs the fewest pages that
                no live block holds: for each gap that fits it (and after the last block), at
                the gap's start, at its end (sharing the next block's page), or page-aligned;
                on a tie the smallest gap, then the lowest address. A placement rule a pool
                could follow without mapping a page twice.
  aliased       A page may be mapped at several addresses, each mapping a whole page (the
                driver maps only whole allocations). A block is made of pieces, in address
                order: optionally the free end of one held page, whole new pages, optionally
                the free start of another held page; or it fits in one free gap of a held
                page. The option with the fewest new pages wins; on a tie the one with the
                fewest bytes in held pages, or with --reuse-first the most. A page is held
                while any piece in it lives.

Block sizes are rounded up to 512 bytes. The figure is peak held pages times P over peak
live bytes, the trace suite's peak reserved / peak allocated.

    python3 bench/page_alias_model.py off_page_sizes                 # seed 0, 4 MiB pages
    python3 bench/page_alias_model.py churn --seed 1 --page-mib 4,16 --scale 0.5
"""
import argparse
import bisect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import traces  # noqa: E402

MIB = 1 << 20


def _round(nbytes):
    return (nbytes + 511) // 512 * 512


class _Peak:
    """Live bytes, held pages and their peaks."""

    def __init__(self, page):
        self.page = page
        self.live = self.peak_live = self.peak_pages = 0

    def note(self, delta, pages):
        self.live += delta
        self.peak_live = max(self.peak_live, self.live)
        self.peak_pages = max(self.peak_pages, pages)

    def ratio(self):
        return self.peak_pages * self.page / self.peak_live if self.peak_live else 1.0


def _first_fit(starts, ends, users, size, page):
    """The start of the smallest gap between live blocks that fits, else after the last."""
    best, prev_end = None, 0
    for start, end in zip(starts, ends):
        gap = start - prev_end
        if gap >= size and (best is None or gap < best[0]):
            best = (gap, prev_end)
        prev_end = end
    return best[1] if best else prev_end


def _fewest_new_pages(starts, ends, users, size, page):
    """Where the block needs the fewest pages no live block holds: a gap's start, its end,
    or page-aligned; on a tie the smallest gap, then the lowest address."""
    def new_pages(at):
        return sum(1 for p in range(at // page, (at + size - 1) // page + 1) if p not in users)
    best = None  # (new pages, gap, address)
    for lo, hi in zip([0] + ends, starts + [None]):
        if hi is not None and hi - lo < size:
            continue
        spots = {lo, -(-lo // page) * page}
        if hi is not None:
            spots |= {hi - size, hi // page * page - size}
        gap = hi - lo if hi is not None else float("inf")
        for at in spots:
            if at >= lo and (hi is None or at + size <= hi):
                key = (new_pages(at), gap, at)
                best = key if best is None or key < best else best
    return best[2]


def _one_address_replay(events, page, place):
    """Peak held / peak live bytes with every page at one address, each block where
    `place(starts, ends, users, size, page)` puts it."""
    starts, ends = [], []  # live blocks by address
    where = {}             # ID -> (address, bytes)
    users = {}             # page index -> live blocks touching it
    peak = _Peak(page)
    for op, ident, nbytes in events:
        if op == "a":
            size = _round(nbytes)
            at = place(starts, ends, users, size, page)
            i = bisect.bisect(starts, at)
            starts.insert(i, at)
            ends.insert(i, at + size)
            where[ident] = (at, size)
            for p in range(at // page, (at + size - 1) // page + 1):
                users[p] = users.get(p, 0) + 1
            peak.note(size, len(users))
        else:
            at, size = where.pop(ident)
            i = bisect.bisect_left(starts, at)
            del starts[i], ends[i]
            for p in range(at // page, (at + size - 1) // page + 1):
                users[p] -= 1
                if users[p] == 0:
                    del users[p]
            peak.note(-size, len(users))
    return peak.ratio()


def one_address(events, page):
    """Peak held / peak live bytes with every page at one address."""
    return _one_address_replay(events, page, _first_fit)


def page_aware(events, page):
    """Peak held / peak live bytes with every page at one address, placed page-aware."""
    return _one_address_replay(events, page, _fewest_new_pages)


def _plan(used, size, page, reuse_first):
    """The pieces (page, lo, hi) of a new block of `size` bytes; new pages are named None."""
    if size <= page:  # in one free gap of a held page, the smallest that fits
        best = None
        for p, spans in used.items():
            prev = 0
            for lo, hi in spans + [(page, page)]:
                if lo - prev >= size and (best is None or lo - prev < best[0]):
                    best = (lo - prev, p, prev)
                prev = hi
        if best:
            return [(best[1], best[2], best[2] + size)]
    ends = sorted((page - s[-1][1], p) for p, s in used.items() if s[-1][1] < page)  # free ends
    starts = sorted((s[0][0], p) for p, s in used.items() if s[0][0] > 0)          # free starts
    options = []  # (new pages, bytes of pieces, head (page, bytes), tail (page, bytes))
    rest = size % page
    for extra in (0, page):  # head + tail = rest, or rest + a page
        want = rest + extra
        if want == 0 or want > size:
            continue
        j, pair = len(starts) - 1, None
        for e, pe in ends:  # the smallest free end + free start of two pages >= want
            while j >= 0 and e + starts[j][0] >= want:
                j -= 1
            if j + 1 < len(starts):
                s, ps = starts[j + 1]
                if ps != pe and (pair is None or e + s < pair[0]):
                    pair = (e + s, e, pe, s, ps)
        if pair:
            _, e, pe, s, ps = pair
            head = min(e, want)
            tail = want - head
            if tail > s:
                tail, head = s, want - s
            options.append(((size - want) // page, want, (pe, head), (ps, tail)))
    if ends:  # the largest free end, then new pages
        e, pe = ends[-1]
        head = min(e, size)
        options.append((-(-(size - head) // page), head, (pe, head), None))
    if starts:  # new pages, then the largest free start
        s, ps = starts[-1]
        tail = min(s, size)
        options.append((-(-(size - tail) // page), tail, None, (ps, tail)))
    options.append((-(-size // page), 0, None, None))
    options.sort(key=lambda o: (o[0], -o[1] if reuse_first else o[1]))
    _, _, head, tail = options[0]
    pieces = []
    middle = size - (head[1] if head else 0) - (tail[1] if tail else 0)
    if head and head[1]:
        pieces.append((head[0], page - head[1], page))
    if tail:  # the first new page's used part ends it, so its free start serves others
        first = middle - (middle // page) * page
        if first:
            pieces.append((None, page - first, page))
        pieces += [(None, 0, page)] * (middle // page)
        if tail[1]:
            pieces.append((tail[0], 0, tail[1]))
    else:
        pieces += [(None, 0, page)] * (middle // page)
        if middle % page:
            pieces.append((None, 0, middle % page))
    return pieces


def aliased(events, page, reuse_first=False):
    """Peak held / peak live bytes when a page may be mapped at several addresses."""
    used = {}    # page -> sorted [(lo, hi)] of live pieces
    where = {}   # ID -> (bytes, pieces)
    names = iter(range(1 << 62))
    peak = _Peak(page)
    for op, ident, nbytes in events:
        if op == "a":
            size = _round(nbytes)
            pieces = [(next(names) if p is None else p, lo, hi)
                      for p, lo, hi in _plan(used, size, page, reuse_first)]
            for p, lo, hi in pieces:
                bisect.insort(used.setdefault(p, []), (lo, hi))
            where[ident] = (size, pieces)
            peak.note(size, len(used))
        else:
            size, pieces = where.pop(ident)
            for p, lo, hi in pieces:
                used[p].remove((lo, hi))
                if not used[p]:
                    del used[p]
            peak.note(-size, len(used))
    return peak.ratio()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", choices=sorted(traces.WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--page-mib", default="4", help="page sizes in MiB, comma-separated")
    ap.add_argument("--page-aware", action="store_true",
                    help="also the one-address model with page-aware placement (slower)")
    ap.add_argument("--reuse-first", action="store_true",
                    help="aliased: on a tie, the option with the most bytes in held pages")
    args = ap.parse_args(argv)
    events = traces.events(args.trace, seed=args.seed, scale=args.scale)
    for mib in (int(x) for x in args.page_mib.split(",")):
        aware = (f"page-aware {page_aware(events, mib * MIB):.4f}, "
                 if args.page_aware else "")
        print(f"{args.trace} seed {args.seed} scale {args.scale} page {mib} MiB: "
              f"one address {one_address(events, mib * MIB):.4f}, {aware}"
              f"aliased {aliased(events, mib * MIB, args.reuse_first):.4f}", flush=True)


if __name__ == "__main__":
    main()
