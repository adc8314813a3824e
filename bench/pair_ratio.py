#!/usr/bin/env python3
"""The cached alloc+free pair of two builds side by side, from pool_bench's JSON output.

    python3 bench/pair_ratio.py --after a1.json a2.json ... [--before b1.json b2.json ...]

Each file is what `pool_bench --benchmark_filter=BM_CachedAllocFreePair
--benchmark_out=F --benchmark_out_format=json` wrote (tests/gpu/run.sh compare runs the two
builds interleaved, several rounds). For every benchmark (one per number of live blocks) it
prints the median real time per pair of each build over all its runs, and after / before:
a Markdown table, then one JSON line per benchmark. Without --before files, the after build
alone.
"""
import argparse
import json
import re
import statistics
import sys

NS_PER_UNIT = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def pair_times(paths):
    """{benchmark name: [ns per pair of every iteration run]} over the files."""
    times = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for b in report.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
                continue
            ns = b["real_time"] * NS_PER_UNIT[b.get("time_unit", "ns")]
            times.setdefault(b.get("run_name", b["name"]), []).append(ns)
    return times


def natural_key(name):
    """"BM_X/64" before "BM_X/1024": numbers in names compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after", nargs="+", required=True, help="JSON files of the build under test")
    p.add_argument("--before", nargs="*", default=[], help="JSON files of the reference build")
    a = p.parse_args(argv)
    after, before = pair_times(a.after), pair_times(a.before)
    if not after:
        print("pair_ratio: no benchmark results in the --after files", file=sys.stderr)
        return 1
    print("| benchmark | after (ns/pair) | before (ns/pair) | after / before | runs |")
    print("|---|---:|---:|---:|---|")
    rows = []
    for name in sorted(set(after) | set(before), key=natural_key):
        a_ns = statistics.median(after[name]) if name in after else None
        b_ns = statistics.median(before[name]) if name in before else None
        ratio = a_ns / b_ns if a_ns is not None and b_ns else None
        rows.append({"bench": "compare", "name": name, "after_ns": a_ns, "before_ns": b_ns,
                     "after_over_before": ratio, "after_runs": len(after.get(name, [])),
                     "before_runs": len(before.get(name, []))})
        cell = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
        print(f"| {name} | {cell(a_ns, '.1f')} | {cell(b_ns, '.1f')} | {cell(ratio, '.3f')} | "
              f"{len(after.get(name, []))} / {len(before.get(name, []))} |")
    print()
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
