"""Reading vmm statistics dumps (vmm_torch.dump_stats) from the command line.

    python -m vmm_torch.stats summarize DUMP.json            # text tables
    python -m vmm_torch.stats render DUMP.json -o OUT.html   # segments and blocks as SVG
    python -m vmm_torch.stats torch-viz DUMP.json -o OUT.html [--pickle SNAPSHOT.pickle]

``render`` writes a self-contained page (no scripts, nothing fetched). ``torch-viz`` hands
the snapshot to PyTorch's own ``torch.cuda._memory_viz`` (``segment_plot`` where this torch
has it; the segment flamegraph input and ``stats`` on older versions) and can save the
snapshot as a pickle for https://pytorch.org/memory_viz.

Only the dump file is read: the commands work without a GPU and without vmm's libraries.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import pickle
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

Document = Dict[str, Any]

# --- Formatting helpers ----------------------------------------------------------------------


def format_bytes(n: Optional[float]) -> str:
    """1536 -> "1.5 KiB"."""
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: List[Sequence[Any]], header: Optional[Sequence[Any]] = None) -> List[str]:
    """Left-aligned first column, right-aligned others."""
    rows = [header] + rows if header else rows
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [str(row[0]).ljust(widths[0])]
        cells += [str(c).rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def load_dump(path: str) -> Document:
    with open(path) as f:
        document = json.load(f)
    if not isinstance(document, dict) or "snapshot" not in document:
        raise ValueError(f"{path} is not a vmm_torch.dump_stats() file (no \"snapshot\")")
    return document


def _stat(stats: Dict[str, Any], key: str) -> Any:
    return stats.get(key, 0) or 0


# --- summarize -------------------------------------------------------------------------------

_BYTE_ROWS = (
    ("allocated", "allocated_bytes.all"),
    ("reserved", "reserved_bytes.all"),
    ("active", "active_bytes.all"),
    ("requested", "requested_bytes.all"),
    ("cached free", "inactive_split_bytes.all"),
    ("exported", "vmm.exported_bytes"),
)

_COUNT_ROWS = (
    ("allocations", "allocation.all"),
    ("active blocks", "active.all"),
    ("chunks (segments)", "segment.all"),
    ("cached free blocks", "inactive_split.all"),
)

_DRIVER_CALLS = ("create", "map", "set_access", "unmap", "release", "export", "event")

_COUNTERS = (
    ("growths", "num_device_alloc"),
    ("releases", "num_device_free"),
    ("retries", "num_alloc_retries"),
    ("OOMs", "num_ooms"),
    ("syncs", "num_sync_all_streams"),
    ("exports", "vmm.num_exports"),
)


def summarize_stats(stats: Dict[str, Any]) -> List[str]:
    """Text lines describing one pool's flat stats dict."""
    lines = _table(
        [(label, format_bytes(_stat(stats, f"{key}.current")),
          format_bytes(_stat(stats, f"{key}.peak"))) for label, key in _BYTE_ROWS]
        + [(label, _stat(stats, f"{key}.current"), _stat(stats, f"{key}.peak"))
           for label, key in _COUNT_ROWS],
        header=("", "current", "peak"))
    calls = ", ".join(f"{name} {_stat(stats, f'vmm.driver_calls.{name}')}"
                      for name in _DRIVER_CALLS)
    lines.append(f"  driver calls: {calls}")
    lines.append("  " + ", ".join(f"{label} {_stat(stats, key)}" for label, key in _COUNTERS))
    lines.append(f"  fragmentation {100 * float(_stat(stats, 'vmm.fragmentation')):.1f}%, "
                 f"largest free block {format_bytes(_stat(stats, 'vmm.largest_free_block'))}")
    return lines


def _block_state(block: Dict[str, Any]) -> str:
    return block.get("vmm_state") or block.get("state", "?")


def _state_totals(blocks: List[Dict[str, Any]]) -> Dict[str, Tuple[int, int]]:
    totals = {}
    for block in blocks:
        state = _block_state(block)
        count, size = totals.get(state, (0, 0))
        totals[state] = (count + 1, size + block.get("size", 0))
    return totals


def summarize_segments(snapshot: Dict[str, Any]) -> List[str]:
    """Text lines listing the snapshot's segments and the states of their blocks."""
    segments = snapshot.get("segments", [])
    lines = [f"Segments ({len(segments)})"]
    if not segments:
        return lines + ["  (none)"]
    rows = []
    for seg in segments:
        totals = _state_totals(seg.get("blocks", []))
        states = ", ".join(f"{state} {count} x {format_bytes(size)}"
                           for state, (count, size) in sorted(totals.items()))
        rows.append((seg.get("device", "?"), hex(seg.get("address") or 0),
                     format_bytes(seg.get("total_size", 0)), len(seg.get("blocks", [])), states))
    return lines + _table(rows, header=("device", "address", "size", "blocks", "block states"))


def summarize(document: Document) -> str:
    """The text report of a dump."""
    when = datetime.datetime.fromtimestamp(document.get("time", 0)).isoformat(" ", "seconds")
    lines = [f"vmm statistics: backend {document.get('backend', '?')}, "
             f"torch {document.get('torch_version', '?')}, dumped {when}", ""]
    for device, stats in sorted(document.get("stats", {}).items()):
        lines.append(f"Device pool {device}")
        lines += summarize_stats(stats) + [""]
    for pool_id, pool in sorted(document.get("pools", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"Pool {pool_id} (device {pool.get('device')}, "
                     f"handle type {pool.get('handle_type')})")
        lines += summarize_stats(pool.get("stats", {})) + [""]
    lines += summarize_segments(document.get("snapshot", {}))
    return "\n".join(lines) + "\n"


# --- render ----------------------------------------------------------------------------------

_COLORS = {
    "active_allocated": "#4c78a8",
    "active_pending_free": "#f58518",
    "inactive": "#cfd8dc",
    "retired": "#e45756",
}
_SVG_WIDTH = 960
_BAR_HEIGHT = 28

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.legend span { display: inline-block; margin-right: 1.5em; }
.swatch { display: inline-block; width: 1em; height: 1em; vertical-align: middle;
          margin-right: 0.3em; border: 1px solid #888; }
.segment { margin: 0.8em 0; }
.caption { font-size: 0.9em; color: #444; }
"""


def _stats_table(stats: Dict[str, Any]) -> str:
    rows = ["<tr><th></th><th>current</th><th>peak</th></tr>"]
    for label, key in _BYTE_ROWS:
        rows.append(f"<tr><td>{label}</td><td>{format_bytes(_stat(stats, key + '.current'))}"
                    f"</td><td>{format_bytes(_stat(stats, key + '.peak'))}</td></tr>")
    for label, key in _COUNT_ROWS:
        rows.append(f"<tr><td>{label}</td><td>{_stat(stats, key + '.current')}</td>"
                    f"<td>{_stat(stats, key + '.peak')}</td></tr>")
    extra = "; ".join(f"{label} {_stat(stats, key)}" for label, key in _COUNTERS)
    calls = ", ".join(f"{n} {_stat(stats, 'vmm.driver_calls.' + n)}" for n in _DRIVER_CALLS)
    frag = 100 * float(_stat(stats, "vmm.fragmentation"))
    largest = format_bytes(_stat(stats, "vmm.largest_free_block"))
    return ("<table>" + "".join(rows) + "</table>"
            f"<p class=caption>driver calls: {calls}<br>{extra}<br>"
            f"fragmentation {frag:.1f}%, largest free block {largest}</p>")


def _block_rect(block: Dict[str, Any], x: float, width: float) -> str:
    state = _block_state(block)
    color = _COLORS.get(state, "#999999")
    title = (f"{state} at {hex(block.get('address') or 0)}: {format_bytes(block.get('size', 0))}"
             f" (requested {format_bytes(block.get('requested_size', 0))})")
    return (f'<rect x="{x:.2f}" y="0" width="{max(width, 0.5):.2f}" height="{_BAR_HEIGHT}" '
            f'fill="{color}" stroke="#ffffff" stroke-width="0.5">'
            f"<title>{html.escape(title)}</title></rect>")


def _segment_svg(segment: Dict[str, Any]) -> str:
    total = max(segment.get("total_size", 0), 1)
    offset = 0
    rects = []
    for block in segment.get("blocks", []):
        size = block.get("size", 0)
        rects.append(_block_rect(block, _SVG_WIDTH * offset / total, _SVG_WIDTH * size / total))
        offset += size
    caption = (f"device {segment.get('device', '?')}, {hex(segment.get('address') or 0)}, "
               f"{format_bytes(segment.get('total_size', 0))}, "
               f"{len(segment.get('blocks', []))} blocks, "
               f"allocated {format_bytes(segment.get('allocated_size', 0))}")
    return (f'<div class=segment><div class=caption>{html.escape(caption)}</div>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_SVG_WIDTH}" '
            f'height="{_BAR_HEIGHT}" role="img">{"".join(rects)}</svg></div>')


def _legend() -> str:
    items = "".join(f'<span><span class=swatch style="background:{color}"></span>'
                    f"{html.escape(state)}</span>" for state, color in _COLORS.items())
    return f"<p class=legend>{items}</p>"


def render(document: Document) -> str:
    """A self-contained HTML page of a dump: stats tables and one bar per segment."""
    parts = [f"<!DOCTYPE html><html><head><meta charset=utf-8><title>vmm memory</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>vmm memory</h1><p>backend {html.escape(str(document.get('backend')))}, "
             f"torch {html.escape(str(document.get('torch_version')))}</p>"]
    for device, stats in sorted(document.get("stats", {}).items()):
        parts.append(f"<h2>Device pool {html.escape(device)}</h2>{_stats_table(stats)}")
    for pool_id, pool in sorted(document.get("pools", {}).items(), key=lambda kv: int(kv[0])):
        title = (f"Pool {pool_id} (device {pool.get('device')}, "
                 f"handle type {pool.get('handle_type')})")
        parts.append(f"<h2>{html.escape(title)}</h2>{_stats_table(pool.get('stats', {}))}")
    segments = document.get("snapshot", {}).get("segments", [])
    parts.append(f"<h2>Segments ({len(segments)})</h2>{_legend()}")
    parts += [_segment_svg(seg) for seg in segments]
    parts.append("</body></html>\n")
    return "".join(parts)


# --- torch-viz -------------------------------------------------------------------------------


def torch_snapshot(document: Document) -> Dict[str, Any]:
    """The dump's snapshot as torch.cuda.memory._snapshot() gives it (vmm's extras removed)."""
    snapshot = {k: v for k, v in document["snapshot"].items() if k != "vmm_pools"}
    snapshot.setdefault("segments", [])
    snapshot.setdefault("device_traces", [[]])
    return snapshot


def _folded_page(title: str, stats_text: str, folded: Any, note: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"</head><body><h1>{html.escape(title)}</h1><p>{html.escape(note)}</p>"
            f"<h2>torch.cuda._memory_viz.stats</h2><pre>{html.escape(stats_text)}</pre>"
            f"<h2>torch.cuda._memory_viz.segments (flamegraph input)</h2>"
            f"<pre>{html.escape(folded)}</pre></body></html>\n")


def torch_viz_html(snapshot: Dict[str, Any], viz: Any = None) -> Tuple[str, str]:
    """(html, text summary) rendered by this torch's torch.cuda._memory_viz.

    Raises RuntimeError when the module offers neither segment_plot nor segments."""
    if viz is None:
        from torch.cuda import _memory_viz as viz
    if hasattr(viz, "segment_plot"):
        summary = viz.segsum(snapshot) if hasattr(viz, "segsum") else ""
        return viz.segment_plot(snapshot), summary
    if hasattr(viz, "segments"):
        # Older torch: snapshots were lists of segments and segments() produced flamegraph
        # input for flamegraph.pl (which it downloads): keep the input instead.
        segments = snapshot["segments"]
        stats_text = repr(viz.stats(segments)) if hasattr(viz, "stats") else ""
        folded = viz.segments(segments, format_flamegraph=lambda lines: lines)
        note = ("This torch's _memory_viz has no segment_plot (PyTorch 2.1+); shown are its "
                "stats() and segments() outputs for the vmm snapshot. Render the flamegraph "
                "input with flamegraph.pl, or load the pickle at https://pytorch.org/memory_viz.")
        return _folded_page("vmm snapshot in torch.cuda._memory_viz", stats_text, folded,
                            note), stats_text
    raise RuntimeError("torch.cuda._memory_viz in this torch offers neither segment_plot nor "
                       "segments; save the snapshot with --pickle and open it at "
                       "https://pytorch.org/memory_viz")


# --- Command line ----------------------------------------------------------------------------


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _cmd_summarize(args: argparse.Namespace) -> int:
    sys.stdout.write(summarize(load_dump(args.dump)))
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    _write(args.output, render(load_dump(args.dump)))
    print(f"wrote {args.output}")
    return 0


def _cmd_torch_viz(args: argparse.Namespace) -> int:
    snapshot = torch_snapshot(load_dump(args.dump))
    if args.pickle:
        with open(args.pickle, "wb") as f:
            pickle.dump(snapshot, f)
        print(f"wrote {args.pickle} (open it at https://pytorch.org/memory_viz)")
    try:
        page, summary = torch_viz_html(snapshot)
    except ImportError as e:
        print(f"torch-viz: cannot import torch.cuda._memory_viz: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"torch-viz: {e}", file=sys.stderr)
        return 2
    _write(args.output, page)
    if summary:
        print(summary)
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vmm_torch.stats",
        description="Read statistics dumps written by vmm_torch.dump_stats().")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summarize", help="print the stats and segments as text tables")
    p.add_argument("dump")
    p.set_defaults(run=_cmd_summarize)
    p = sub.add_parser("render", help="write an HTML page drawing segments and blocks")
    p.add_argument("dump")
    p.add_argument("-o", "--output", default="vmm_memory.html")
    p.set_defaults(run=_cmd_render)
    p = sub.add_parser("torch-viz", help="render the snapshot with torch.cuda._memory_viz")
    p.add_argument("dump")
    p.add_argument("-o", "--output", default="vmm_torch_viz.html")
    p.add_argument("--pickle", help="also save the snapshot as a pickle for pytorch.org/memory_viz")
    p.set_defaults(run=_cmd_torch_viz)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (OSError, ValueError) as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
