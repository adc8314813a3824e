#!/usr/bin/env python3
"""Turn the JSON lines of the benchmarks into Markdown tables, and keep the results history.

Reads the output of replay, growth_bench, vmm_peer_bench, torch_peer_bench and import_bench
(one JSON object per line; other lines are skipped), takes the median of each (test, metric,
allocator) over all files, and writes one table per benchmark: a row per test and metric, a
column per allocator with its median and its ratio to PyTorch's native allocator, and the
target (docs/DESIGN.md §5) with whether vmm meets it. Replays of several traces (the suite of
bench/traces.py, bench/trace_suite.sh) get a row per trace, named after the trace's file.

    python3 bench/report.py results/*.jsonl > results/report.md
    python3 bench/report.py --all results/*.jsonl      # every count, not just the main ones

With --out, the tables become a dated entry of the results history (docs/results/): the file
is created, or the entry appended to it, headed by the date, the commit, the machine and the
command that produced the results; a new file is also listed in the folder's README.md.

    python3 bench/report.py --results-dir results --out docs/results/2026-12-02.md \
        --machine "one H200, driver 580, torch 2.11.0+cu130" --command "tests/gpu/run.sh bench"
    python3 bench/report.py --results-dir results --out docs/results/   # file named by --date
"""
import argparse
import collections
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys

BASELINE = "torch_native"
# Column order; allocators not listed here follow in name order.
ALLOCATOR_ORDER = ["vmm", "torch_native", "torch_expandable", "torch_cuda_malloc_async",
                   "cuda_malloc_async", "cuda_malloc", "bare_driver"]
# Metrics shown by default, in this order.
MAIN_METRICS = ["ns_per_pair", "peak_reserved_over_peak_allocated", "num_device_alloc",
                "num_device_free", "num_device_alloc_plus_free", "driver_calls",
                "driver_create", "driver_map", "driver_unmap", "driver_release",
                "driver_set_access", "moved_bytes", "driver_calls_warm", "moved_bytes_warm",
                "ns_per_op_cold", "ns_per_op_warm", "driver_ns_per_op_cold",
                "driver_ns_per_op_warm", "grow_us", "grow_over_bare", "release_us",
                "us_per_chunk", "caller_us_per_chunk", "release_us_per_chunk", "create_us"]
# Fields that tell configurations of one allocator apart.
CONFIG_FIELDS = ["growth_fraction", "max_growth_extra_mib", "max_chunk_mib", "large_page_mib",
                 "growth_page_mib"]


def target(name, metric, values):
    """The target of a row (docs/DESIGN.md §5) as (text, check(vmm value) -> bool), or
    None."""
    if metric == "ns_per_pair" and name.endswith("live=64"):
        return "≤ 100 ns", lambda v: v <= 100
    if metric == "peak_reserved_over_peak_allocated":
        # A variant (trace_suite.sh's WORKLOAD.PARAM-VALUE names) takes its workload's target.
        workload = name.split(".", 1)[0]
        if not name.startswith("trace_replay/") or workload == "trace_replay/training":
            return "≤ 1.01", lambda v: v <= 1.01
        # The other traces of bench/traces.py.
        ref = values.get("cuda_malloc_async")
        if ref is None:
            return "≤ 1.02", lambda v: v <= 1.02
        return f"≤ 1.02, < cuda_malloc_async ({ref:.4f})", lambda v: v <= 1.02 and v < ref
    if metric == "num_device_alloc_plus_free" and "torch_expandable" in values:
        ref = values["torch_expandable"]
        return f"< torch_expandable ({ref:.0f})", lambda v: v < ref
    if metric == "driver_calls" and "torch_expandable" in values:
        ref = values["torch_expandable"]
        return f"< torch_expandable ({ref:.0f}, at least)", lambda v: v < ref
    if metric == "ns_per_op_cold" and "cuda_malloc_async" in values:
        ref = values["cuda_malloc_async"]
        return f"< cuda_malloc_async ({fmt(ref, 'ns')})", lambda v: v < ref
    if metric == "grow_over_bare":
        return "≤ 1.5", lambda v: v <= 1.5
    return None


def fmt(value, unit):
    if value is None:
        return "—"
    if unit == "x":
        return f"{value:.4f}"
    if unit == "bytes":
        return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.1f} MiB"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def load(paths):
    records = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if {"bench", "name", "allocator", "metric", "value"} <= r.keys():
                    records.append(r)
    return records


def config(r):
    return ", ".join(f"{k}={r[k]}" for k in CONFIG_FIELDS if k in r)


def column_names(records):
    """Allocator label per record, with its configuration where one benchmark has results of
    several configurations of that allocator."""
    configs = collections.defaultdict(set)
    for r in records:
        configs[(r["bench"], r["allocator"])].add(config(r))
    names = []
    for r in records:
        label = r["allocator"]
        if len(configs[(r["bench"], label)]) > 1:
            label += f" [{config(r)}]"
        names.append(label)
    return names


def row_names(records):
    """The row name of each record: its test name, followed by the name of its trace file
    (bench/traces.py's workload) where one benchmark has results of several traces."""
    def trace(r):
        return os.path.splitext(os.path.basename(r["trace"]))[0] if "trace" in r else None

    traces = collections.defaultdict(set)
    for r in records:
        traces[r["bench"]].add(trace(r))
    return [r["name"] + (f"/{trace(r)}" if trace(r) and len(traces[r["bench"]]) > 1 else "")
            for r in records]


def order_key(column):
    base = column.split(" [")[0]
    rank = ALLOCATOR_ORDER.index(base) if base in ALLOCATOR_ORDER else len(ALLOCATOR_ORDER)
    return (rank, column)


def tables(records, show_all=False):
    """The Markdown tables of `records`, one per benchmark, as one string."""
    # (bench, name, metric) -> column -> values; units by metric.
    table = collections.defaultdict(lambda: collections.defaultdict(list))
    units = {}
    for r, column, name in zip(records, column_names(records), row_names(records)):
        if r["value"] is None:
            continue
        if not show_all and r["metric"] not in MAIN_METRICS:
            continue
        table[(r["bench"], name, r["metric"])][column].append(float(r["value"]))
        units[r["metric"]] = r.get("unit", "")

    def row_key(key):
        bench, name, metric = key
        rank = MAIN_METRICS.index(metric) if metric in MAIN_METRICS else len(MAIN_METRICS)
        return (bench, name, rank, metric)

    by_bench = collections.defaultdict(list)
    for key in sorted(table, key=row_key):
        by_bench[key[0]].append(key)
    lines = []
    for bench, keys in by_bench.items():
        columns = sorted({c for k in keys for c in table[k]}, key=order_key)
        lines.append(f"### {bench}\n")
        lines.append("| test | metric | " + " | ".join(columns) + " | target |")
        lines.append("|---|---|" + "---:|" * len(columns) + "---|")
        for key in keys:
            _, name, metric = key
            unit = units[metric]
            medians = {c: statistics.median(v) for c, v in table[key].items()}
            base = medians.get(BASELINE)
            cells = []
            for c in columns:
                v = medians.get(c)
                cell = fmt(v, unit)
                if v is not None and base and c != BASELINE:
                    cell += f" ({v / base:.2f}× native)"
                cells.append(cell)
            goal = target(name, metric, medians)
            met = ""
            if goal:
                text, check = goal
                # One mark per vmm column, in the columns' order.
                vmm = [medians[c] for c in columns if c in medians and c.split(" [")[0] == "vmm"]
                marks = " ".join("✓" if check(v) else "✗" for v in vmm)
                met = f"{text} {marks}".strip()
            unit_text = f" ({unit})" if unit and unit not in ("calls", "bytes") else ""
            lines.append(f"| {name} | {metric}{unit_text} | " + " | ".join(cells) + f" | {met} |")
        lines.append("")
    return "\n".join(lines)


def git_commit():
    """The checkout's short commit, marked when tracked files differ from it; None outside
    a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "diff", "--quiet", "HEAD", "--"],
                               capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"`{sha}` (with uncommitted changes)" if dirty else f"`{sha}`"


def entry(body, date, commit, machine, command, inputs, title):
    """One dated entry of the results history."""
    head = [f"## {title} — {date}, commit {commit}" if commit else f"## {title} — {date}", ""]
    head.append(f"- Date: {date}")
    head.append(f"- Commit: {commit}" if commit else "- Commit: unknown")
    if machine:
        head.append(f"- Machine: {machine}")
    if command:
        head.append(f"- Command: `{command}`")
    head.append("- Inputs: " + ", ".join(f"`{os.path.basename(p)}`" for p in inputs))
    head.append("- Medians over all inputs; ratios to PyTorch native; ✓ / ✗: vmm meets the "
                "target or not (docs/DESIGN.md §5).")
    # The per-benchmark headings sit one level below the entry's.
    body = body.replace("\n### ", "\n#### ")
    if body.startswith("### "):
        body = "#" + body
    return "\n".join(head) + "\n\n" + body.rstrip() + "\n"


def add_to_history(path, text, date, machine, command):
    """Appends `text` to the dated file `path` (creating it with a title), and lists a new
    file in the README.md of its folder, if there is one."""
    new = not os.path.exists(path)
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write(f"# Results of {date}\n")
        f.write("\n---\n\n" if not new else "\n")
        f.write(text)
    index = os.path.join(os.path.dirname(os.path.abspath(path)), "README.md")
    name = os.path.basename(path)
    if not os.path.exists(index):
        return
    with open(index, encoding="utf-8") as f:
        listed = f"]({name})" in f.read()
    if not listed:
        what = "; ".join(x for x in (machine, f"`{command}`" if command else "") if x)
        with open(index, "a", encoding="utf-8") as f:
            f.write(f"- [{os.path.splitext(name)[0]}]({name})" + (f": {what}" if what else "")
                    + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("files", nargs="*", help="files of JSON lines")
    p.add_argument("--results-dir", action="append", default=[],
                   help="read every *.jsonl file in this folder (repeatable)")
    p.add_argument("--all", action="store_true", help="show every metric")
    p.add_argument("--out", help="append a dated entry to this Markdown file (created if "
                                 "missing); a folder means FOLDER/DATE.md")
    p.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date()
                   .isoformat(), help="date of the entry (default: today, UTC)")
    p.add_argument("--commit", help="commit measured (default: this checkout's; give it when "
                                    "the results come from another checkout)")
    p.add_argument("--machine", default="", help="the machine, e.g. 'one H200, driver 580, "
                                                 "torch 2.11.0+cu130'")
    p.add_argument("--command", default="", help="the command that produced the results")
    p.add_argument("--title", default="Allocator benchmarks", help="the entry's heading")
    args = p.parse_args()

    files = list(args.files)
    for folder in args.results_dir:
        found = sorted(glob.glob(os.path.join(folder, "*.jsonl")))
        if not found:
            sys.exit(f"report.py: no *.jsonl files in {folder}")
        files += found
    if not files:
        p.error("give files of JSON lines or --results-dir")
    records = load(files)
    if not records:
        sys.exit("report.py: no results in " + " ".join(files))
    body = tables(records, args.all)
    if not args.out:
        print(body)
        return
    path = args.out
    if os.path.isdir(path) or path.endswith(os.sep):
        path = os.path.join(path, f"{args.date}.md")
    commit = f"`{args.commit}`" if args.commit else git_commit()
    add_to_history(path, entry(body, args.date, commit, args.machine, args.command, files,
                               args.title), args.date, args.machine, args.command)
    print(f"report.py: wrote an entry to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
