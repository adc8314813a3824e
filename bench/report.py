#!/usr/bin/env python3
"""Turn the JSON lines of the benchmarks into Markdown tables for README.md.

Reads the output of replay, growth_bench, vmm_peer_bench and torch_peer_bench (one JSON
object per line; other lines are skipped), takes the median of each (test, metric, allocator)
over all files, and prints one table per benchmark: a row per test and metric, a column per
allocator with its median and its ratio to PyTorch's native allocator, and the SPEC §5 target
with whether vmm meets it.

    python3 bench/report.py results/*.jsonl > results/report.md
    python3 bench/report.py --all results/*.jsonl      # every count, not just the main ones
"""
import argparse
import collections
import json
import statistics
import sys

BASELINE = "torch_native"
# Column order; allocators not listed here follow in name order.
ALLOCATOR_ORDER = ["vmm", "torch_native", "torch_expandable", "torch_cuda_malloc_async",
                   "cuda_malloc_async", "cuda_malloc", "bare_driver"]
# Metrics shown by default, in this order.
MAIN_METRICS = ["ns_per_pair", "peak_reserved_over_peak_allocated", "num_device_alloc",
                "num_device_free", "num_device_alloc_plus_free", "driver_calls",
                "ns_per_op_cold", "ns_per_op_warm", "grow_us", "grow_over_bare", "release_us"]
# Fields that tell configurations of one allocator apart.
CONFIG_FIELDS = ["growth_fraction", "max_growth_extra_mib", "max_chunk_mib"]


def target(name, metric, values):
    """SPEC §5's target for a row as (text, check(vmm value) -> bool), or None."""
    if metric == "ns_per_pair" and name.endswith("live=64"):
        return "≤ 100 ns", lambda v: v <= 100
    if metric == "peak_reserved_over_peak_allocated":
        return "≤ 1.01", lambda v: v <= 1.01
    if metric == "num_device_alloc_plus_free" and "torch_expandable" in values:
        ref = values["torch_expandable"]
        return f"< torch_expandable ({ref:.0f})", lambda v: v < ref
    if metric == "grow_over_bare":
        return "≤ 1.5", lambda v: v <= 1.5
    return None


def fmt(value, unit):
    if value is None:
        return "—"
    if unit == "x":
        return f"{value:.4f}"
    if unit == "calls" or float(value).is_integer():
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


def order_key(column):
    base = column.split(" [")[0]
    rank = ALLOCATOR_ORDER.index(base) if base in ALLOCATOR_ORDER else len(ALLOCATOR_ORDER)
    return (rank, column)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="files of JSON lines")
    p.add_argument("--all", action="store_true", help="show every metric")
    args = p.parse_args()

    records = load(args.files)
    if not records:
        sys.exit("report.py: no results in " + " ".join(args.files))
    # (bench, name, metric) -> column -> values; units by metric.
    table = collections.defaultdict(lambda: collections.defaultdict(list))
    units = {}
    for r, column in zip(records, column_names(records)):
        if r["value"] is None:
            continue
        if not args.all and r["metric"] not in MAIN_METRICS:
            continue
        table[(r["bench"], r["name"], r["metric"])][column].append(float(r["value"]))
        units[r["metric"]] = r.get("unit", "")

    def row_key(key):
        bench, name, metric = key
        rank = MAIN_METRICS.index(metric) if metric in MAIN_METRICS else len(MAIN_METRICS)
        return (bench, name, rank, metric)

    by_bench = collections.defaultdict(list)
    for key in sorted(table, key=row_key):
        by_bench[key[0]].append(key)
    for bench, keys in by_bench.items():
        columns = sorted({c for k in keys for c in table[k]}, key=order_key)
        print(f"### {bench}\n")
        print("| test | metric | " + " | ".join(columns) + " | SPEC target |")
        print("|---|---|" + "---:|" * len(columns) + "---|")
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
            spec = ""
            if goal:
                text, check = goal
                vmm = [v for c, v in medians.items() if c.split(" [")[0] == "vmm"]
                marks = " ".join("✓" if check(v) else "✗" for v in vmm)
                spec = f"{text} {marks}".strip()
            unit_text = f" ({unit})" if unit and unit != "calls" else ""
            print(f"| {name} | {metric}{unit_text} | " + " | ".join(cells) + f" | {spec} |")
        print()


if __name__ == "__main__":
    main()
