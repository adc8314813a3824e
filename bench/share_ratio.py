#!/usr/bin/env python3
"""Share latency of two builds side by side, from share_latency.py's --out files.

    python3 bench/share_ratio.py --after after.jsonl [--before before.jsonl]

Each file holds the "share_latency" rows of one build (tests/gpu/run.sh compare appends one
run per round). For every mode and size it prints the median over the runs of each run's
median latency, and after / before: a Markdown table, then one JSON line per row. Rows with an
error are reported as such. Without --before, the after build alone.
"""
import argparse
import json
import statistics
import sys


def medians(path):
    """{(mode, bytes): [median_ms of each run]} and {(mode, bytes): error} of a file."""
    runs, errors = {}, {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if row.get("bench") != "share_latency":
                continue
            key = (row.get("mode"), row.get("bytes"))
            if "error" in row:
                errors[key] = row["error"]
            elif "median_ms" in row:
                runs.setdefault(key, []).append(float(row["median_ms"]))
    return runs, errors


def size_name(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after", required=True)
    p.add_argument("--before")
    a = p.parse_args()
    after, after_errors = medians(a.after)
    before, before_errors = medians(a.before) if a.before else ({}, {})
    keys = sorted(set(after) | set(before) | set(after_errors) | set(before_errors),
                  key=lambda k: (str(k[0]), k[1] or 0))
    if not keys:
        print("share_ratio: no share_latency rows", file=sys.stderr)
        return 1
    print("| mode | size | after (ms) | before (ms) | after / before |")
    print("|---|---|---:|---:|---:|")
    lines = []
    for key in keys:
        mode, size = key
        am = statistics.median(after[key]) if key in after else None
        bm = statistics.median(before[key]) if key in before else None
        ratio = am / bm if am is not None and bm else None
        cell = lambda v, err: f"{v:.3f}" if v is not None else (f"error: {err}" if err else "")
        print(f"| {mode} | {size_name(size or 0)} | {cell(am, after_errors.get(key))} | "
              f"{cell(bm, before_errors.get(key))} | "
              f"{'' if ratio is None else f'{ratio:.3f}'} |")
        lines.append({"bench": "share_compare", "mode": mode, "bytes": size,
                      "after_ms": am, "before_ms": bm, "ratio": ratio,
                      "after_runs": after.get(key, []), "before_runs": before.get(key, [])})
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
