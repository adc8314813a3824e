"""Reading vmm statistics dumps (vmm_torch.dump_stats) from the command line.

    python -m vmm_torch.stats summarize DUMP.json            # text tables
    python -m vmm_torch.stats render DUMP.json -o OUT.html   # segments and blocks as SVG
    python -m vmm_torch.stats torch-viz DUMP.json -o OUT.html [--pickle SNAPSHOT.pickle]

``render`` writes a self-contained page (no scripts, nothing fetched; every value from the
dump is escaped). ``torch-viz`` hands
the snapshot to PyTorch's own ``torch.cuda._memory_viz`` (``segment_plot`` where this torch
has it; the segment flamegraph input and ``stats`` on older versions) and can save the
snapshot as a pickle for https://pytorch.org/memory_viz.

Only the dump file is read: the commands work without a GPU and without vmm's libraries.
The dump is untrusted input: :func:`load_dump` and :func:`check_dump` accept only JSON of
the layout dump_stats writes (extra keys are ignored; wrong types, numbers that are not
finite or beyond 64 bits, timestamps out of range, deep nesting and bytes that are not UTF-8
raise :class:`DumpError` saying where). Every command fails in one line on stderr,
``vmm-stats: FILE: what is wrong``, with exit code 1.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import math
import pickle
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._files import write_file

Document = Dict[str, Any]
PROG = "vmm-stats"


class DumpError(ValueError):
    """A file that is not a dump as vmm_torch.dump_stats() writes it (the message says where
    and what)."""


# --- Reading and checking a dump -------------------------------------------------------------

_LIMIT = 2**64  # numbers in a dump are byte counts, addresses and counters: below 2**64
_POOL_ID = re.compile(r"[0-9]{1,19}")


def printable(value: Any, limit: Optional[int] = None) -> str:
    """`value` as text with every non-printable character (control characters, line breaks,
    terminal escapes, bidirectional overrides) written as a Python escape, so that text from
    a dump cannot drive a terminal or break a line; cut to `limit` characters."""
    text = value if isinstance(value, str) else str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _shown(value: Any) -> str:
    """A short, printable description of a value found in a dump (for error messages)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return printable(json.dumps(value) if not isinstance(value, float) else repr(value), 60)


def _where(path: Sequence[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (
            f".{printable(part, 60)}" if out else printable(part, 60))
    return out or "the document"


def _fail(path: Sequence[Any], expected: str, value: Any) -> DumpError:
    return DumpError(f"{_where(path)} is {_shown(value)}, expected {expected}")


def _object(value: Any, path: Sequence[Any]) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, "an object", value)
    return value


def _array(value: Any, path: Sequence[Any]) -> List[Any]:
    if not isinstance(value, list):
        raise _fail(path, "an array", value)
    return value


def _number(value: Any, path: Sequence[Any]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, "a number", value)
    if isinstance(value, float) and not math.isfinite(value) or abs(value) >= _LIMIT:
        raise _fail(path, "a number below 2**64", value)


def _count(value: Any, path: Sequence[Any]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _LIMIT:
        raise _fail(path, "an integer in [0, 2**64)", value)


def _text(value: Any, path: Sequence[Any]) -> None:
    if not isinstance(value, str):
        raise _fail(path, "a string", value)


def _device(value: Any, path: Sequence[Any]) -> None:
    if isinstance(value, str):
        return
    _count(value, path)


def _optional(document: Dict[str, Any], key: str, check: Callable[[Any, Sequence[Any]], Any],
              path: Sequence[Any]) -> None:
    value = document.get(key)
    if value is not None:
        check(value, list(path) + [key])


def _check_stats(value: Any, path: Sequence[Any]) -> None:
    for key, item in _object(value, path).items():
        _number(item, list(path) + [key])


def _check_pool(value: Any, path: Sequence[Any]) -> None:
    pool = _object(value, path)
    _optional(pool, "device", _device, path)
    _optional(pool, "handle_type", _text, path)
    _optional(pool, "stats", _check_stats, path)


def _check_block(value: Any, path: Sequence[Any]) -> None:
    block = _object(value, path)
    for key in ("address", "size", "requested_size"):
        _optional(block, key, _count, path)
    for key in ("state", "vmm_state"):
        _optional(block, key, _text, path)


def _check_segment(value: Any, path: Sequence[Any]) -> None:
    segment = _object(value, path)
    _optional(segment, "device", _device, path)
    for key in ("address", "total_size", "allocated_size"):
        _optional(segment, key, _count, path)
    blocks = segment.get("blocks")
    if blocks is not None:
        for i, block in enumerate(_array(blocks, list(path) + ["blocks"])):
            _check_block(block, list(path) + ["blocks", i])


def _check_time(value: Any, path: Sequence[Any]) -> None:
    _number(value, path)
    try:
        datetime.datetime.fromtimestamp(value)
    except (OverflowError, OSError, ValueError):
        raise _fail(path, "a time in seconds since 1970 (years 1 to 9999)", value) from None


def check_dump(document: Any) -> Document:
    """Returns `document` if it has the layout dump_stats writes (see the module docstring);
    DumpError naming the first thing that is wrong otherwise. Keys the readers do not use
    are not checked."""
    if not isinstance(document, dict) or not isinstance(document.get("snapshot"), dict):
        what = "no \"snapshot\" object" if isinstance(document, dict) else (
            f"the document is {_shown(document)}")
        raise DumpError(f"not a vmm_torch.dump_stats() file ({what})")
    for key in ("backend", "torch_version"):
        _optional(document, key, _text, [])
    _optional(document, "time", _check_time, [])
    stats = document.get("stats")
    if stats is not None:
        for device, item in _object(stats, ["stats"]).items():
            _check_stats(item, ["stats", device])
    pools = document.get("pools")
    if pools is not None:
        for pool_id, pool in _object(pools, ["pools"]).items():
            if not _POOL_ID.fullmatch(pool_id):
                raise DumpError(f"pools has the key {_shown(pool_id)}, expected pool ids "
                                f"(decimal integers)")
            _check_pool(pool, ["pools", pool_id])
    segments = document["snapshot"].get("segments")
    if segments is not None:
        for i, segment in enumerate(_array(segments, ["snapshot", "segments"])):
            _check_segment(segment, ["snapshot", "segments", i])
    return document


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DumpError(f"the number {printable(text, 60)} is out of range")
    return value


def _no_constant(text: str) -> Any:
    raise DumpError(f"{text} is not a number JSON allows")


def parse_dump(data: bytes) -> Document:
    """The checked document of a dump file's contents (UTF-8 JSON). DumpError otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DumpError(f"not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    try:
        document = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise DumpError(f"not JSON: {printable(e.msg)} at line {e.lineno} column {e.colno}"
                        ) from None
    except RecursionError:
        raise DumpError("not a dump: JSON nested too deeply") from None
    except DumpError:
        raise
    except ValueError as e:  # integers with more digits than Python converts
        raise DumpError(f"not JSON this reader takes: {printable(e, 200)}") from None
    return check_dump(document)

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
    """The checked document of the dump file `path` (OSError if it cannot be read, DumpError
    if it is not a dump)."""
    with open(path, "rb") as f:
        return parse_dump(f.read())


def _get(mapping: Dict[str, Any], key: str, default: Any) -> Any:
    value = mapping.get(key)
    return default if value is None else value


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
    return block.get("vmm_state") or _get(block, "state", "?")


def _state_totals(blocks: List[Dict[str, Any]]) -> Dict[str, Tuple[int, int]]:
    totals: Dict[str, Tuple[int, int]] = {}
    for block in blocks:
        state = _block_state(block)
        count, size = totals.get(state, (0, 0))
        totals[state] = (count + 1, size + _get(block, "size", 0))
    return totals


def _segments(snapshot: Dict[str, Any]) -> List[Dict[str, Any]]:
    return _get(snapshot, "segments", [])


def _blocks(segment: Dict[str, Any]) -> List[Dict[str, Any]]:
    return _get(segment, "blocks", [])


def summarize_segments(snapshot: Dict[str, Any]) -> List[str]:
    """Text lines listing the snapshot's segments and the states of their blocks."""
    segments = _segments(snapshot)
    lines = [f"Segments ({len(segments)})"]
    if not segments:
        return lines + ["  (none)"]
    rows = []
    for seg in segments:
        totals = _state_totals(_blocks(seg))
        states = ", ".join(f"{printable(state)} {count} x {format_bytes(size)}"
                           for state, (count, size) in sorted(totals.items()))
        rows.append((printable(_get(seg, "device", "?")), hex(_get(seg, "address", 0)),
                     format_bytes(_get(seg, "total_size", 0)), len(_blocks(seg)), states))
    return lines + _table(rows, header=("device", "address", "size", "blocks", "block states"))


def _pools(document: Document) -> List[Tuple[str, Dict[str, Any]]]:
    return sorted(_get(document, "pools", {}).items(), key=lambda kv: int(kv[0]))


def _pool_title(pool_id: str, pool: Dict[str, Any]) -> str:
    return (f"Pool {pool_id} (device {_get(pool, 'device', '?')}, "
            f"handle type {_get(pool, 'handle_type', '?')})")


def summarize(document: Document) -> str:
    """The text report of a dump (checked first: DumpError if it is not one). Text from the
    dump is printed with non-printable characters escaped."""
    check_dump(document)
    when = datetime.datetime.fromtimestamp(_get(document, "time", 0)).isoformat(" ", "seconds")
    lines = [f"vmm statistics: backend {printable(_get(document, 'backend', '?'))}, "
             f"torch {printable(_get(document, 'torch_version', '?'))}, dumped {when}", ""]
    for device, stats in sorted(_get(document, "stats", {}).items()):
        lines.append(f"Device pool {printable(device)}")
        lines += summarize_stats(stats) + [""]
    for pool_id, pool in _pools(document):
        lines.append(printable(_pool_title(pool_id, pool)))
        lines += summarize_stats(_get(pool, "stats", {})) + [""]
    lines += summarize_segments(document["snapshot"])
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


def _h(value: Any) -> str:
    """Text from a dump, escaped for HTML text and (quoted) attribute values."""
    return html.escape(printable(value), quote=True)


def _stats_table(stats: Dict[str, Any]) -> str:
    rows = ["<tr><th></th><th>current</th><th>peak</th></tr>"]
    for label, key in _BYTE_ROWS:
        rows.append(f"<tr><td>{label}</td>"
                    f"<td>{_h(format_bytes(_stat(stats, key + '.current')))}</td>"
                    f"<td>{_h(format_bytes(_stat(stats, key + '.peak')))}</td></tr>")
    for label, key in _COUNT_ROWS:
        rows.append(f"<tr><td>{label}</td><td>{_h(_stat(stats, key + '.current'))}</td>"
                    f"<td>{_h(_stat(stats, key + '.peak'))}</td></tr>")
    extra = "; ".join(f"{label} {_stat(stats, key)}" for label, key in _COUNTERS)
    calls = ", ".join(f"{n} {_stat(stats, 'vmm.driver_calls.' + n)}" for n in _DRIVER_CALLS)
    frag = 100 * float(_stat(stats, "vmm.fragmentation"))
    largest = format_bytes(_stat(stats, "vmm.largest_free_block"))
    return ("<table>" + "".join(rows) + "</table>"
            f"<p class=caption>driver calls: {_h(calls)}<br>{_h(extra)}<br>"
            f"fragmentation {frag:.1f}%, largest free block {_h(largest)}</p>")


def _block_rect(block: Dict[str, Any], x: float, width: float) -> str:
    state = _block_state(block)
    color = _COLORS.get(state, "#999999")  # from the table above, never from the dump
    title = (f"{state} at {hex(_get(block, 'address', 0))}: "
             f"{format_bytes(_get(block, 'size', 0))}"
             f" (requested {format_bytes(_get(block, 'requested_size', 0))})")
    return (f'<rect x="{x:.2f}" y="0" width="{max(width, 0.5):.2f}" height="{_BAR_HEIGHT}" '
            f'fill="{color}" stroke="#ffffff" stroke-width="0.5">'
            f"<title>{_h(title)}</title></rect>")


def _segment_svg(segment: Dict[str, Any]) -> str:
    total = max(_get(segment, "total_size", 0), 1)
    offset = 0
    rects = []
    for block in _blocks(segment):
        size = _get(block, "size", 0)
        rects.append(_block_rect(block, _SVG_WIDTH * offset / total, _SVG_WIDTH * size / total))
        offset += size
    caption = (f"device {_get(segment, 'device', '?')}, {hex(_get(segment, 'address', 0))}, "
               f"{format_bytes(_get(segment, 'total_size', 0))}, "
               f"{len(_blocks(segment))} blocks, "
               f"allocated {format_bytes(_get(segment, 'allocated_size', 0))}")
    return (f'<div class=segment><div class=caption>{_h(caption)}</div>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_SVG_WIDTH}" '
            f'height="{_BAR_HEIGHT}" role="img">{"".join(rects)}</svg></div>')


def _legend() -> str:
    items = "".join(f'<span><span class=swatch style="background:{color}"></span>'
                    f"{html.escape(state)}</span>" for state, color in _COLORS.items())
    return f"<p class=legend>{items}</p>"


def render(document: Document) -> str:
    """A self-contained HTML page of a dump: stats tables and one bar per segment. The dump is
    checked first (DumpError if it is not one); every value taken from it is escaped."""
    check_dump(document)
    parts = [f"<!DOCTYPE html><html><head><meta charset=utf-8><title>vmm memory</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>vmm memory</h1><p>backend {_h(_get(document, 'backend', '?'))}, "
             f"torch {_h(_get(document, 'torch_version', '?'))}</p>"]
    for device, stats in sorted(_get(document, "stats", {}).items()):
        parts.append(f"<h2>Device pool {_h(device)}</h2>{_stats_table(stats)}")
    for pool_id, pool in _pools(document):
        parts.append(f"<h2>{_h(_pool_title(pool_id, pool))}</h2>"
                     f"{_stats_table(_get(pool, 'stats', {}))}")
    segments = _segments(document["snapshot"])
    parts.append(f"<h2>Segments ({len(segments)})</h2>{_legend()}")
    parts += [_segment_svg(seg) for seg in segments]
    parts.append("</body></html>\n")
    return "".join(parts)


# --- torch-viz -------------------------------------------------------------------------------


def torch_snapshot(document: Document) -> Dict[str, Any]:
    """The dump's snapshot as torch.cuda.memory._snapshot() gives it (vmm's extras removed)."""
    check_dump(document)
    snapshot = {k: v for k, v in document["snapshot"].items() if k != "vmm_pools"}
    if snapshot.get("segments") is None:
        snapshot["segments"] = []
    if snapshot.get("device_traces") is None:
        snapshot["device_traces"] = [[]]
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


# --- Command line ---------------------------------------------------------------------------


class CommandError(Exception):
    """A failure the command line reports as ``vmm-stats: FILE: WHAT`` (exit code 1)."""

    def __init__(self, path: Any, what: Any) -> None:
        super().__init__(f"{printable(path)}: {printable(what)}")


def _os_error(e: OSError) -> str:
    return e.strerror if e.strerror else str(e)


def _read(path: str) -> Document:
    try:
        return load_dump(path)
    except OSError as e:
        raise CommandError(path, _os_error(e)) from None
    except (DumpError, RecursionError, MemoryError) as e:
        what = e if isinstance(e, DumpError) else f"not a dump ({type(e).__name__})"
        raise CommandError(path, what) from None


def _checked(path: str, make: Callable[[], Any]) -> Any:
    """make() for the dump `path`: its DumpError as a CommandError."""
    try:
        return make()
    except DumpError as e:
        raise CommandError(path, e) from None


def _write(path: str, data: Any, binary: bool = False) -> None:
    try:
        write_file(path, lambda f: f.write(data), binary)
    except (OSError, ValueError, TypeError) as e:
        raise CommandError(path, _os_error(e) if isinstance(e, OSError) and e.strerror
                           else e) from None


def _cmd_summarize(args: argparse.Namespace) -> int:
    document = _read(args.dump)
    sys.stdout.write(_checked(args.dump, lambda: summarize(document)))
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    document = _read(args.dump)
    _write(args.output, _checked(args.dump, lambda: render(document)))
    print(f"wrote {printable(args.output)}")
    return 0


def _cmd_torch_viz(args: argparse.Namespace) -> int:
    document = _read(args.dump)
    snapshot = _checked(args.dump, lambda: torch_snapshot(document))
    if args.pickle:
        _write(args.pickle, pickle.dumps(snapshot), binary=True)
        print(f"wrote {printable(args.pickle)} (open it at https://pytorch.org/memory_viz)")
    try:
        page, summary = torch_viz_html(snapshot)
    except ImportError as e:
        raise CommandError(args.dump, f"cannot import torch.cuda._memory_viz: {e}") from None
    except RuntimeError as e:
        raise CommandError(args.dump, e) from None
    except Exception as e:  # PyTorch's code, on a snapshot it does not accept
        raise CommandError(args.dump, f"torch.cuda._memory_viz cannot read this snapshot: "
                                      f"{type(e).__name__}: {printable(e, 200)}") from None
    _write(args.output, page)
    if summary:
        print("\n".join(printable(line) for line in summary.splitlines()))
    print(f"wrote {printable(args.output)}")
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
    """Runs the command line. Usage errors exit with 2 (argparse); every other failure prints
    one line, ``vmm-stats: FILE: what is wrong``, on stderr and returns 1."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CommandError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
