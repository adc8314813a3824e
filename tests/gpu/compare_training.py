#!/usr/bin/env python3
"""Compares train_loop.py results: losses step by step, median step time, peak reserved.

    python3 tests/gpu/compare_training.py native.json expandable.json vmm.json
Exits nonzero if vmm's losses differ from native's beyond float noise.
"""
import json
import sys


def main():
    runs = {}
    for path in sys.argv[1:]:
        with open(path) as f:
            r = json.load(f)
        runs[r["allocator"]] = r
    native = runs["native"]
    rows = []
    for name, r in runs.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], native["losses"]))
        rows.append({
            "bench": "training", "allocator": name,
            "median_step_ms": r["median_step_ms"],
            "step_time_ratio": r["median_step_ms"] / native["median_step_ms"],
            "peak_reserved_gib": r["peak_reserved"] / 2**30,
            "peak_allocated_gib": r["peak_allocated"] / 2**30,
            "max_loss_diff_vs_native": diff,
            "final_loss": r["final_loss"],
        })
    for row in rows:
        print(json.dumps(row))
    bad = [r["allocator"] for r in rows
           if r["allocator"].startswith("vmm") and r["max_loss_diff_vs_native"] > 1e-3]
    if bad:
        print(f"losses differ from native's: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
