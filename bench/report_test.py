"""Tests of bench/report.py's tables: one column per allocator configuration, and the target
marks of a row in the order of its vmm columns.

    bazel test //bench:report_test
"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


def replay(allocator, page, trace, value, metric="peak_reserved_over_peak_allocated"):
    record = {"bench": "trace_replay", "name": "trace_replay", "allocator": allocator,
              "metric": metric, "value": value, "unit": "x", "trace": f"/t/{trace}.txt"}
    if allocator == "vmm":
        record.update(growth_fraction=0.05, max_growth_extra_mib="64", max_chunk_mib=65536,
                      large_page_mib=page, growth_page_mib=4 * page)
    return record


def row(text, name, metric="peak_reserved_over_peak_allocated"):
    for line in text.splitlines():
        if line.startswith(f"| {name} | {metric}"):
            return [cell.strip() for cell in line.strip().strip("|").split("|")]
    raise AssertionError(f"no row {name} {metric} in:\n{text}")


def test_marks_follow_the_column_order_whatever_the_order_of_the_records():
    # The 8 MiB configuration's records come first, but its column sorts after 0 MiB's.
    records = [replay("vmm", 8, "churn", 1.0177), replay("vmm", 0, "churn", 1.2091),
               replay("cuda_malloc_async", 0, "churn", 1.1404),
               replay("vmm", 8, "kv", 1.0141), replay("vmm", 0, "kv", 1.1687),
               replay("cuda_malloc_async", 0, "kv", 1.0711)]
    text = report.tables(records)
    header = next(line for line in text.splitlines() if line.startswith("| test"))
    columns = [c.strip() for c in header.strip().strip("|").split("|")][2:-1]
    assert [c.split(" [")[0] for c in columns] == ["vmm", "vmm", "cuda_malloc_async"]
    assert "large_page_mib=0" in columns[0] and "large_page_mib=8" in columns[1]
    cells = row(text, "trace_replay/churn")
    assert cells[2:5] == ["1.2091", "1.0177", "1.1404"]
    assert cells[-1].endswith("✗ ✓"), cells[-1]


def test_a_training_variant_keeps_the_training_target():
    records = [replay("vmm", 8, "training.layers-48", 1.0000),
               replay("vmm", 8, "churn", 1.0177)]
    cells = row(report.tables(records), "trace_replay/training.layers-48")
    assert cells[-1].startswith("≤ 1.01"), cells[-1]


def test_rounds_of_one_trace_give_one_row_of_their_medians(tmp_path):
    # trace_suite.sh's TRACE_ROUNDS: the files of each round, for two traces; the row of a
    # trace holds the median of its rounds whatever the order of the files.
    for i, (cold, cma) in enumerate([(100.0, 7.0), (1.0, 9.0), (5.0, 8.0)]):
        suffix = "" if i == 0 else f".r{i + 1}"
        for trace, scale in [("kv", 1), ("churn", 10)]:
            records = [replay("vmm", 8, trace, cold * scale, metric="ns_per_op_cold"),
                       replay("cuda_malloc_async", 0, trace, cma * scale,
                              metric="ns_per_op_cold")]
            (tmp_path / f"{trace}.vmm{suffix}.jsonl").write_text(
                "log line, skipped\n" + "\n".join(json.dumps(r) for r in records) + "\n")
    paths = sorted(str(p) for p in tmp_path.glob("*.jsonl"))
    text = report.tables(report.load(paths))
    kv = row(text, "trace_replay/kv", "ns_per_op_cold")
    churn = row(text, "trace_replay/churn", "ns_per_op_cold")
    def values(cells):
        return [float(cells[i].split(" ")[0].replace(",", "")) for i in (2, 3)]

    assert values(kv) == [5.0, 8.0], kv
    assert values(churn) == [50.0, 80.0], churn
    assert sum(1 for line in text.splitlines() if "| ns_per_op_cold" in line) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
