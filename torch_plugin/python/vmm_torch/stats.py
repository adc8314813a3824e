"""Reading vmm statistics dumps (vmm_torch.dump_stats) and PyTorch memory snapshots from the
command line.

    python -m vmm_torch.stats summarize DUMP.json            # text tables
    python -m vmm_torch.stats render DUMP.json -o OUT.html   # segments and blocks as SVG
    python -m vmm_torch.stats torch-viz DUMP.json -o OUT.html [--pickle SNAPSHOT.pickle]
    python -m vmm_torch.stats timeline SNAPSHOT -o OUT.svg [--device N] [--width W]
                                       [--height H] [--top K]   # active memory timeline

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

``timeline`` draws the Active Memory Timeline of https://pytorch.org/memory_viz as a
self-contained SVG from a snapshot (what ``torch.cuda.memory._dump_snapshot`` writes, or the
same dict as JSON): each allocation of the GPU's trace is a band from its alloc to its
free (``free_completed``, else ``free_requested``, else the end), stacked on those allocated
before it; x counts the allocs and frees, y bytes. The snapshot is untrusted too: pickles
load only as builtin containers and scalars (:mod:`vmm_torch._pickles`: no global is
imported, nothing is called) and at most :data:`SNAPSHOT_LIMIT` bytes are read; see
:func:`check_snapshot`, :func:`timeline`, :func:`user_frame` and :func:`timeline_svg`.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import math
import os
import pickle
import re
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ._files import write_file
from ._pickles import NotAPickle, PickleRefused, load_builtins

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
    """A short, printable description of a value found in a dump or snapshot (for error
    messages)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _LIMIT:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return printable(repr(value), 60)
    if value is None or isinstance(value, (str, int)):
        return printable(json.dumps(value), 60)
    return f"a {type(value).__name__}"  # what a pickle holds beyond JSON: tuple, bytes, set


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


def _first_visit(value: Any, seen: Set[Tuple[str, int]], kind: str) -> bool:
    """Whether one check meets the container `value` (held by the document) as a `kind` of
    part ("frames", "blocks", ...) for the first time, noting it: a pickle shares an object at
    2 bytes a reference, so a check that walked each reference again would take a power of
    the file's size (three levels of n-fold sharing: n**3). Each distinct container is walked
    once for each kind of part it stands for (a list that is a trace in one place and frames
    in another is checked as both)."""
    key = (kind, id(value))
    if key in seen:
        return False
    seen.add(key)
    return True


def _check_stats(value: Any, path: Sequence[Any], seen: Set[Tuple[str, int]]) -> None:
    if not _first_visit(_object(value, path), seen, "stats"):
        return
    for key, item in value.items():
        _number(item, list(path) + [key])


def _check_pool(value: Any, path: Sequence[Any], seen: Set[Tuple[str, int]]) -> None:
    pool = _object(value, path)
    _optional(pool, "device", _device, path)
    _optional(pool, "handle_type", _text, path)
    _optional(pool, "stats", lambda v, p: _check_stats(v, p, seen), path)


def _check_block(value: Any, path: Sequence[Any]) -> None:
    block = _object(value, path)
    for key in ("address", "size", "requested_size"):
        _optional(block, key, _count, path)
    for key in ("state", "vmm_state"):
        _optional(block, key, _text, path)


def _check_segment(value: Any, path: Sequence[Any], seen: Set[Tuple[str, int]],
                   frames: bool = False) -> None:
    """Checks a segment and its blocks (each distinct blocks list once: `seen`), and with
    `frames` the blocks' optional "frames"."""
    segment = _object(value, path)
    _optional(segment, "device", _device, path)
    for key in ("address", "total_size", "allocated_size"):
        _optional(segment, key, _count, path)
    blocks = segment.get("blocks")
    if blocks is not None and _first_visit(_array(blocks, list(path) + ["blocks"]), seen, "blocks"):
        for i, block in enumerate(blocks):
            where = list(path) + ["blocks", i]
            _check_block(block, where)
            if frames:
                _optional(block, "frames", lambda v, p: _check_frames(v, p, seen), where)


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
    seen: Set[Tuple[str, int]] = set()  # the containers walked (see _first_visit)
    stats = document.get("stats")
    if stats is not None:
        for device, item in _object(stats, ["stats"]).items():
            _check_stats(item, ["stats", device], seen)
    pools = document.get("pools")
    if pools is not None:
        for pool_id, pool in _object(pools, ["pools"]).items():
            if not _POOL_ID.fullmatch(pool_id):
                raise DumpError(f"pools has the key {_shown(pool_id)}, expected pool ids "
                                f"(decimal integers)")
            _check_pool(pool, ["pools", pool_id], seen)
    segments = document["snapshot"].get("segments")
    if segments is not None:
        for i, segment in enumerate(_array(segments, ["snapshot", "segments"])):
            _check_segment(segment, ["snapshot", "segments", i], seen)
    return document


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DumpError(f"the number {printable(text, 60)} is out of range")
    return value


def _no_constant(text: str) -> Any:
    raise DumpError(f"{text} is not a number JSON allows")


def _parse_json(data: bytes, kind: str) -> Any:
    """The JSON value of `data` (UTF-8) with the dump's limits; DumpError otherwise (`kind`
    names the file's kind in the message)."""
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
        raise DumpError(f"not a {kind}: JSON nested too deeply") from None
    except DumpError:
        raise
    except ValueError as e:  # integers with more digits than Python converts
        raise DumpError(f"not JSON this reader takes: {printable(e, 200)}") from None
    return document


def parse_dump(data: bytes) -> Document:
    """The checked document of a dump file's contents (UTF-8 JSON). DumpError otherwise."""
    return check_dump(_parse_json(data, "dump"))

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


# --- Memory snapshots (timeline) -------------------------------------------------------------
# A snapshot is what torch.cuda.memory._snapshot() returns: {"segments": [...],
# "device_traces": [[entry, ...] per device], ...}, as the pickle _dump_snapshot() writes or as
# JSON. Both are untrusted: pickles load with vmm_torch._pickles (builtin containers and
# scalars only, nothing imported or called), and the parts the timeline reads are checked.

SNAPSHOT_LIMIT = 512 << 20  # bytes: larger files are refused before they are read whole
MAX_EVENTS = 20_000  # events drawn one by one; beyond that, sampled down to this many columns
_JSON = re.compile(rb"[ \t\r\n]*[\[{]")  # how JSON of an object or array begins


def _has(document: Dict[str, Any], key: str, path: Sequence[Any]) -> Any:
    if key not in document:
        raise DumpError(f"{_where(path)} has no \"{key}\"")
    return document[key]


def _check_frames(value: Any, path: Sequence[Any], seen: Set[Tuple[str, int]]) -> None:
    if not _first_visit(_array(value, path), seen, "frames"):
        return  # a list of frames shared by many entries (PyTorch shares them too)
    for i, frame in enumerate(value):
        if (type(frame) is dict and type(frame.get("filename")) is str
                and type(frame.get("name")) is str and type(frame.get("line")) is int
                and 0 <= frame["line"] < _LIMIT):
            continue  # the common case, checked fast
        where = list(path) + [i]
        frame = _object(frame, where)
        for key, check in (("filename", _text), ("name", _text), ("line", _count)):
            check(_has(frame, key, where), where + [key])


def _check_trace_entry(value: Any, path: Sequence[Any], seen: Set[Tuple[str, int]]) -> None:
    entry = _object(value, path)
    for key, check in (("action", _text), ("addr", _count), ("size", _count)):
        check(_has(entry, key, path), list(path) + [key])
    _optional(entry, "time_us", _number, path)
    _optional(entry, "frames", lambda v, p: _check_frames(v, p, seen), path)


def check_snapshot(document: Any) -> Document:
    """Returns `document` if it has the layout of torch.cuda.memory._snapshot() in the parts
    the timeline reads: "device_traces" (a list per device of entries with "action" (str),
    "addr" and "size" (integers), optional "time_us" and "frames" ({"filename", "name",
    "line"})) and "segments" (as in a dump, blocks with optional "frames"); DumpError naming
    the first thing that is wrong otherwise. Each distinct list (a trace, a list of blocks or
    of frames) is checked once however often the document refers to it, so the check takes
    time linear in the size of the pickle it was loaded from."""
    if not isinstance(document, dict) or "device_traces" not in document:
        what = "no \"device_traces\"" if isinstance(document, dict) else (
            f"the document is {_shown(document)}")
        raise DumpError(f"not a memory snapshot of torch.cuda.memory._snapshot() ({what})")
    seen: Set[Tuple[str, int]] = set()  # the containers walked (see _first_visit)
    traces = _array(document["device_traces"], ["device_traces"])
    for device, trace in enumerate(traces):
        if _first_visit(_array(trace, ["device_traces", device]), seen, "trace"):
            for i, entry in enumerate(trace):
                _check_trace_entry(entry, ["device_traces", device, i], seen)
    segments = _array(_has(document, "segments", []), ["segments"])
    for i, segment in enumerate(segments):
        _check_segment(segment, ["segments", i], seen, frames=True)
    return document


def parse_snapshot(data: bytes) -> Document:
    """The checked snapshot of a file's contents: a JSON object, or a pickle of builtin
    containers and scalars (what torch.cuda.memory._dump_snapshot() writes). DumpError
    otherwise; a pickle that needs any global (a class, a function) is refused unloaded."""
    if len(data) > SNAPSHOT_LIMIT:
        raise DumpError(f"larger than {format_bytes(SNAPSHOT_LIMIT)}, the most this reader "
                        f"takes")
    if not data:
        raise DumpError("the file is empty")
    if _JSON.match(data):
        return check_snapshot(_parse_json(data, "snapshot"))
    try:
        document = load_builtins(data)
    except NotAPickle as e:
        if data[:1] == b"\x80":  # a pickle of protocol 2 or later
            raise DumpError(e) from None
        raise DumpError(f"neither JSON nor a pickle ({e})") from None
    except PickleRefused as e:
        raise DumpError(e) from None
    return check_snapshot(document)


def load_snapshot(path: str) -> Document:
    """The checked snapshot in the file `path` (OSError if it cannot be read, DumpError if it
    is not a snapshot: see parse_snapshot). At most SNAPSHOT_LIMIT bytes are read."""
    with open(path, "rb") as f:
        data = f.read(SNAPSHOT_LIMIT + 1)
    return parse_snapshot(data)


class Allocation(NamedTuple):
    """One allocation on the timeline: drawn over the events first..last (inclusive)."""
    first: int
    last: int
    size: int
    frames: List[Dict[str, Any]]
    before_trace: bool  # allocated before the trace began
    after_trace: bool  # still allocated at its end
    seen: int  # where the trace first shows it (its alloc or free; after the trace: alive
    #            throughout), which ranks allocations of equal size as PyTorch's viewer does


class Timeline(NamedTuple):
    """The allocations of one GPU's trace in stacking order (those alive before the trace
    first), and the number of events (alloc and free) that the x axis counts."""
    allocations: List[Allocation]
    events: int


def _spans(trace: List[Dict[str, Any]]) -> Tuple[List[List[Any]], Set[int]]:
    """[[first entry index or None, last entry index or None, size, frames]] of the trace's
    allocations, and the addresses not freed (completed) at its end. An allocation ends at its
    free_completed, or at its free_requested where none follows; one freed without an alloc
    in the trace was allocated before it began."""
    spans: List[List[Any]] = []
    live: Dict[int, List[Any]] = {}  # addr -> [alloc index, size, frames, requested index]
    before: Dict[int, List[Any]] = {}  # addr -> [requested index, size, frames]
    for i, entry in enumerate(trace):
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            old = live.pop(addr, None)
            if old is not None:  # allocated again without a completed free
                spans.append([old[0], old[3] if old[3] is not None else i, old[1], old[2]])
            live[addr] = [i, entry["size"], entry.get("frames") or [], None]
        elif action in ("free_requested", "free_completed"):
            alive = live.get(addr)
            if alive is not None:
                if action == "free_completed":
                    spans.append([alive[0], i, alive[1], alive[2]])
                    del live[addr]
                elif alive[3] is None:
                    alive[3] = i
            elif action == "free_requested":
                before.setdefault(addr, [i, entry["size"], entry.get("frames") or []])
            else:
                requested = before.pop(addr, None)
                first = requested if requested is not None else [i, entry["size"], []]
                spans.append([None, i, first[1], first[2]])
    for alive in live.values():  # to the free requested, if any, else to the end
        spans.append([alive[0], alive[3], alive[1], alive[2]])
    for requested in before.values():
        spans.append([None, requested[0], requested[1], requested[2]])
    return spans, set(live)


def timeline(snapshot: Document, device: int = 0) -> Timeline:
    """The allocations of `device`'s trace in the checked snapshot (DumpError if the snapshot
    has no trace for it). Blocks "active_allocated" in that GPU's segments that the trace
    does not hold at its end were allocated before it began and stay to its end, as in
    PyTorch's memory viewer (their size is the requested one where given). A list of blocks
    that several segments share (one object, as only a pickle can make) counts once."""
    check_snapshot(snapshot)
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        have = f"devices 0 to {len(traces) - 1}" if traces else "no device"
        raise DumpError(f"no trace of device {device} (the snapshot has {have})")
    spans, not_freed = _spans(traces[device])
    whole = []
    # Blocks lists drawn: one shared by several segments is drawn once.
    walked: Set[Tuple[str, int]] = set()
    for segment in _segments(snapshot):
        if segment.get("device", device) != device or not segment.get("blocks") or \
                not _first_visit(segment["blocks"], walked, "blocks"):
            continue
        for block in segment["blocks"]:
            if block.get("state") == "active_allocated" and \
                    _get(block, "address", -1) not in not_freed:
                size = block.get("requested_size") or _get(block, "size", 0)
                whole.append([None, None, size, _get(block, "frames", [])])
    # Stacking order: the blocks alive throughout at the bottom, then those freed during the
    # trace (earliest free first), then the trace's allocations in the order they were made.
    spans = (whole + sorted((s for s in spans if s[0] is None), key=lambda s: s[1])
             + sorted((s for s in spans if s[0] is not None), key=lambda s: s[0]))
    indices = sorted({i for span in spans for i in span[:2] if i is not None})
    column = {index: c for c, index in enumerate(indices)}
    events = max(len(indices), 1)
    allocations = [Allocation(column[first] if first is not None else 0,
                              column[last] if last is not None else events - 1,
                              size, frames, first is None, last is None,
                              first if first is not None else
                              last if last is not None else len(traces[device]) + k)
                   for k, (first, last, size, frames) in enumerate(spans, 1)]
    return Timeline(allocations, events)


_INTERNAL_DIR = re.compile(r"(^|[/\\])(torch|torchinductor_[^/\\]*)[/\\]")
_BACKWARD = re.compile(r"torch::autograd::generated::(\w+)::apply")


def _short_path(filename: str) -> str:
    parts = re.split(r"[/\\]", filename)
    return filename if len(parts) <= 3 else ".../" + "/".join(parts[-2:])


def user_frame(frames: List[Dict[str, Any]]) -> str:
    """Where an allocation was made, in one line: the innermost Python frame outside torch
    (a file not under a directory named torch or torchinductor_*, which holds the code
    torch.compile generates); for an allocation of the backward pass (made on autograd's
    thread, with no Python frame) the gradient function; else the innermost Python frame;
    else "no Python frame". Frames are innermost first, as PyTorch records them."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    for frame in python:
        if not _INTERNAL_DIR.search(frame["filename"]):
            return f"{frame['name']} {_short_path(frame['filename'])}:{frame['line']}"
    for frame in frames:
        match = _BACKWARD.search(frame["name"])
        if match:
            return f"backward: {match.group(1)}"
    for frame in python:
        return f"{frame['name']} {_short_path(frame['filename'])}:{frame['line']}"
    return "no Python frame" if frames else "no stack recorded"


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
            "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#393b79", "#637939")
_GREY = "#b0b0b0"
_LINE = 16  # legend line height
_TOP, _LEFT, _RIGHT, _AXIS = 54, 78, 24, 40  # margins around the plot


def _x(value: Any) -> str:
    """Text from a snapshot, escaped for XML text and (quoted) attribute values."""
    return html.escape(printable(value), quote=True)


def _legend_lines(top: int) -> int:
    return top + 2  # the coloured allocations, the grey ones, a note


def timeline_min_height(top: int) -> int:
    """The least SVG height that holds a plot and a legend of `top` coloured allocations."""
    return _TOP + _AXIS + 120 + _legend_lines(top) * _LINE


def _nice(raw: float) -> int:
    """The least of 1, 2, 5, 10, 20, 50, ... that is at least `raw`."""
    power = 1
    while True:
        for m in (1, 2, 5):
            if power * m >= raw:
                return power * m
        power *= 10


def _byte_ticks(top: float) -> Tuple[int, int, str]:
    """(step, unit, unit name) for about seven ticks up to `top` bytes."""
    raw = max(top / 7, 1)
    unit, name = 1, "B"
    for u, n in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if raw >= u:
            unit, name = u, n
            break
    return _nice(raw / unit) * unit, unit, name


def _step_path(runs: List[Tuple[float, float, float]]) -> List[Tuple[float, float]]:
    """Points of a step line through (x from, x to, y) runs, equal neighbours merged."""
    points: List[Tuple[float, float]] = []
    for x0, x1, y in runs:
        y = round(y, 1)  # as written: neighbours equal to a tenth of a pixel are merged
        if points and points[-1][1] == y:
            points[-1] = (x1, y)
        else:
            points += [(x0, y), (x1, y)]
    return points


def _points(points: List[Tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def timeline_svg(snapshot: Document, device: int = 0, width: int = 1200, height: int = 720,
                 top: int = 15, max_events: int = MAX_EVENTS, source: str = "") -> str:
    """The active memory timeline of `device`'s trace in the snapshot as a self-contained SVG
    (no scripts, nothing fetched, every text from the snapshot escaped). Allocations are
    stacked in the order of timeline() (one freed lets those above it drop); the `top`
    largest get a colour and a legend entry (size, user_frame(), events), the others are
    summed in one grey band on top of them, as PyTorch's viewer does with the allocations
    beyond its limit. x: the events (allocs and frees), sampled down to `max_events` columns
    (the one with the most memory of each) beyond that; y: bytes, the peak marked.
    DumpError for a snapshot that is not one or has no trace of `device`; ValueError for a
    height below timeline_min_height(top)."""
    if height < timeline_min_height(top):
        raise ValueError(f"a height of {height} leaves no room for the plot and a legend of "
                         f"{top} allocations (at least {timeline_min_height(top)})")
    line = timeline(snapshot, device)
    allocations, events = line.allocations, line.events
    ranked = sorted(range(len(allocations)),
                    key=lambda i: (-allocations[i].size, allocations[i].seen))[:top]
    colour = {i: _PALETTE[rank % len(_PALETTE)] for rank, i in enumerate(ranked)}

    # Bytes per event column: all allocations, and the coloured ones.
    total_delta = [0] * (events + 1)
    coloured_delta = [0] * (events + 1)
    for i, a in enumerate(allocations):
        for delta in ((total_delta, coloured_delta) if i in colour else (total_delta,)):
            delta[a.first] += a.size
            delta[a.last + 1] -= a.size
    total, coloured, running, running_coloured = [], [], 0, 0
    for c in range(events):
        running += total_delta[c]
        running_coloured += coloured_delta[c]
        total.append(running)
        coloured.append(running_coloured)
    peak = max(total) if total else 0
    peak_at = total.index(peak) if total else 0

    legend_h = _legend_lines(len(colour)) * _LINE
    plot_x, plot_y = _LEFT, _TOP
    plot_w = width - _LEFT - _RIGHT
    plot_h = height - _TOP - _AXIS - legend_h
    step, unit, unit_name = _byte_ticks(max(peak, 1024))
    y_max = max(peak * 1.12, step)

    def x_of(c: float) -> float:
        return plot_x + plot_w * c / events

    def y_of(v: float) -> float:
        return plot_y + plot_h - plot_h * v / y_max

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" '
           f'role="img">',
           f"<title>Active memory timeline, device {device}</title>",
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>']
    name = f"{printable(source, 120)}: " if source else ""
    out.append(f'<text x="{plot_x}" y="20" font-size="15" font-weight="bold">Active memory '
               f"timeline, device {device}</text>")
    summary = (f"{name}{len(allocations)} allocations, {events} events (allocs and frees); "
               f"peak {format_bytes(peak)} at event {peak_at}")
    out.append(f'<text x="{plot_x}" y="38" class="summary">{_x(summary)}</text>')

    # The grey band (summed, sampled down beyond max_events columns), then the coloured ones.
    if events > max_events:
        bounds = [events * b // max_events for b in range(max_events + 1)]
        picks = [max(range(bounds[b], bounds[b + 1]), key=total.__getitem__)
                 for b in range(max_events)]
    else:
        bounds, picks = list(range(events + 1)), list(range(events))
    if len(colour) < len(allocations):
        upper = _step_path([(x_of(bounds[b]), x_of(bounds[b + 1]), y_of(total[c]))
                            for b, c in enumerate(picks)])
        lower = _step_path([(x_of(bounds[b]), x_of(bounds[b + 1]), y_of(coloured[c]))
                            for b, c in enumerate(picks)])
        out.append(f'<polygon class="other" fill="{_GREY}" points="'
                   f'{_points(upper + lower[::-1])}"><title>'
                   f"{len(allocations) - len(colour)} other allocations</title></polygon>")
    order = sorted(colour)  # stacking order
    labels = {}
    where: Dict[int, str] = {}  # user_frame by frames list (one list may serve many)
    for k, i in enumerate(order):
        a = allocations[i]
        below = [allocations[j] for j in order[:k] if allocations[j].last >= a.first]
        offset = sum(b.size for b in below)
        drops: Dict[int, int] = {}  # column -> bytes freed below this one before it
        for b in below:
            if b.last < a.last:
                drops[b.last + 1] = drops.get(b.last + 1, 0) + b.size
        bottom = [(x_of(a.first), y_of(offset))]
        for drop in sorted(drops):
            offset -= drops[drop]
            bottom += [(x_of(drop), bottom[-1][1]), (x_of(drop), y_of(offset))]
        bottom.append((x_of(a.last + 1), bottom[-1][1]))
        top_path = [(x, y - plot_h * a.size / y_max) for x, y in bottom]
        span = "before the trace" if a.before_trace else f"event {a.first}"
        until = "the end" if a.after_trace else f"event {a.last}"
        if id(a.frames) not in where:
            where[id(a.frames)] = user_frame(a.frames)
        labels[i] = (f"{format_bytes(a.size)}, {where[id(a.frames)]}, from {span} to "
                     f"{until}")
        out.append(f'<polygon class="band" fill="{colour[i]}" stroke="#ffffff" '
                   f'stroke-width="0.5" points="{_points(bottom + top_path[::-1])}">'
                   f"<title>{_x(printable(labels[i], 400))}</title></polygon>")

    # Axes, ticks, the peak.
    out.append(f'<g stroke="#444444" stroke-width="1"><line x1="{plot_x}" y1="{plot_y}" '
               f'x2="{plot_x}" y2="{plot_y + plot_h}"/><line x1="{plot_x}" '
               f'y1="{plot_y + plot_h}" x2="{plot_x + plot_w}" y2="{plot_y + plot_h}"/></g>')
    ticks = []
    value = 0
    while value <= y_max:
        y = y_of(value)
        label = "0" if value == 0 else f"{value / unit:g} {unit_name}"
        ticks.append(f'<line x1="{plot_x - 4}" y1="{y:.1f}" x2="{plot_x + plot_w}" '
                     f'y2="{y:.1f}" stroke="#e0e0e0"/><text x="{plot_x - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end" class="ytick">{label}</text>')
        value += step
    every = _nice(events / 8)
    for c in range(0, events + 1, every):
        x = x_of(c)
        ticks.append(f'<line x1="{x:.1f}" y1="{plot_y + plot_h}" x2="{x:.1f}" '
                     f'y2="{plot_y + plot_h + 4}" stroke="#444444"/><text x="{x:.1f}" '
                     f'y="{plot_y + plot_h + 16}" text-anchor="middle" class="xtick">{c}</text>')
    out.append('<g font-size="10">' + "".join(ticks) + "</g>")
    out.append(f'<text x="{plot_x + plot_w}" y="{plot_y + plot_h + 32}" text-anchor="end">'
               f"event (allocs and frees of the trace)</text>")
    py = y_of(peak)
    px = x_of(peak_at + 0.5)
    out.append(f'<g class="peak"><line x1="{plot_x}" y1="{py:.1f}" x2="{plot_x + plot_w}" '
               f'y2="{py:.1f}" stroke="#d62728" stroke-dasharray="4 3"/>'
               f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="#d62728"/>'
               f'<text x="{plot_x + plot_w}" y="{py - 5:.1f}" text-anchor="end" '
               f'fill="#d62728" class="peak-label">peak {format_bytes(peak)} at event '
               f"{peak_at}</text></g>")

    # Legend: the coloured allocations, largest first; the grey ones; sampling.
    chars = max((width - _LEFT - 30) // 6, 20)
    legend_y = plot_y + plot_h + _AXIS + 4
    entries = [(colour[i], labels[i]) for i in ranked]
    others = len(allocations) - len(colour)
    if others:
        largest = max(a.size for i, a in enumerate(allocations) if i not in colour)
        entries.append((_GREY, f"{others} other allocations (up to {format_bytes(largest)} "
                               f"each), summed"))
    items = []
    for k, (fill, text) in enumerate(entries):
        y = legend_y + k * _LINE
        items.append(f'<rect x="{plot_x}" y="{y}" width="10" height="10" fill="{fill}"/>'
                     f'<text x="{plot_x + 16}" y="{y + 9}">{_x(printable(text, chars))}</text>')
    note = (f"{events} events sampled down to {max_events} columns (each the event with the "
            f"most memory of its stretch)" if events > max_events else
            "every event drawn")
    note += "; stacked in order of allocation, the coloured ones below the grey sum"
    items.append(f'<text x="{plot_x}" y="{legend_y + len(entries) * _LINE + 9}" '
                 f'fill="#555555" class="note">{_x(printable(note, chars))}</text>')
    out.append('<g class="legend">' + "".join(items) + "</g>")
    out.append("</svg>\n")
    return "\n".join(out)


# --- Command line ---------------------------------------------------------------------------


class CommandError(Exception):
    """A failure the command line reports as ``vmm-stats: FILE: WHAT`` (exit code 1)."""

    def __init__(self, path: Any, what: Any) -> None:
        super().__init__(f"{printable(path)}: {printable(what)}")


def _os_error(e: OSError) -> str:
    return e.strerror if e.strerror else str(e)


def _load(path: str, load: Callable[[str], Document], kind: str) -> Document:
    """load(path), its failures as CommandErrors naming `path` (`kind`: what the file should be)."""
    try:
        return load(path)
    except OSError as e:
        raise CommandError(path, _os_error(e)) from None
    except (DumpError, RecursionError, MemoryError) as e:
        what = e if isinstance(e, DumpError) else f"not a {kind} ({type(e).__name__})"
        raise CommandError(path, what) from None


def _read(path: str) -> Document:
    return _load(path, load_dump, "dump")


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


def _read_snapshot(path: str) -> Document:
    return _load(path, load_snapshot, "snapshot")


def _cmd_timeline(args: argparse.Namespace) -> int:
    if args.height < timeline_min_height(args.top):
        raise CommandError(args.output, f"--height {args.height} leaves no room for the plot "
                                        f"and a legend of {args.top} allocations (at least "
                                        f"{timeline_min_height(args.top)})")
    snapshot = _read_snapshot(args.snapshot)
    svg = _checked(args.snapshot, lambda: timeline_svg(
        snapshot, args.device, args.width, args.height, args.top,
        source=os.path.basename(args.snapshot)))
    _write(args.output, svg)
    print(f"wrote {printable(args.output)}")
    return 0


def _bounded(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value
    return parse


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
        description="Read statistics dumps written by vmm_torch.dump_stats() and memory "
                    "snapshots of torch.cuda.memory._dump_snapshot().")
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
    p = sub.add_parser("timeline", help="draw the active memory timeline of a memory snapshot "
                                        "(torch.cuda.memory._dump_snapshot) as SVG")
    p.add_argument("snapshot", help="a pickle as _dump_snapshot() writes it, or the same as JSON")
    p.add_argument("-o", "--output", default="vmm_timeline.svg")
    p.add_argument("--device", type=_bounded(0, 1 << 16), default=0)
    p.add_argument("--width", type=_bounded(400, 20000), default=1200)
    p.add_argument("--height", type=_bounded(300, 20000), default=720)
    p.add_argument("--top", type=_bounded(0, 100), default=15,
                   help="how many of the largest allocations get a colour (default 15)")
    p.set_defaults(run=_cmd_timeline)
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
