"""dump_stats and `python -m vmm_torch.stats` (summarize, render, torch-viz) on a real dump."""

import gc
import json
import os
import pickle
import subprocess
import sys

import pytest

import vmm_torch
from vmm_torch import stats as stats_cli

MIB = 1 << 20


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A dump of a host pool holding live, freed and exported blocks."""
    path = tmp_path_factory.mktemp("dump") / "vmm_dump.json"
    pool = vmm_torch.Pool("host", handle_type="posix_fd")
    keep = [pool.empty((n * MIB // 4,)) for n in (1, 3, 2)]
    freed = pool.empty((MIB,))
    shared = pool.empty((MIB // 4,), shareable=True)
    vmm_torch.export_tensor(shared)
    del freed
    gc.collect()
    document = vmm_torch.dump_stats(path)
    yield path, document, pool
    del keep, shared
    pool.close()


def run_cli(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable, "-m", "vmm_torch.stats", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)


def test_dump_layout(dump):
    path, document, pool = dump
    with open(path) as f:
        on_disk = json.load(f)
    assert on_disk.keys() >= {"stats", "snapshot", "backend", "time", "pools"}
    assert on_disk["backend"] in ("host", "cuda")
    assert "0" in on_disk["stats"]
    assert "allocated_bytes.all.current" in on_disk["stats"]["0"]
    pool_entry = on_disk["pools"][str(pool.id)]
    assert pool_entry["device"] == "host" and pool_entry["handle_type"] == "posix_fd"
    assert pool_entry["stats"]["allocation.all.current"] == 4
    assert pool_entry["stats"]["vmm.num_exports"] == 1
    states = {b["state"] for s in on_disk["snapshot"]["segments"] for b in s["blocks"]}
    assert "active_allocated" in states and "inactive" in states


def test_summarize(dump):
    path, _, pool = dump
    result = run_cli("summarize", path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Device pool 0" in out
    assert f"Pool {pool.id} (device host, handle type posix_fd)" in out
    for word in ("allocated", "reserved", "active", "current", "peak", "driver calls",
                 "fragmentation", "largest free block", "Segments", "active_allocated"):
        assert word in out, word


def test_render(dump, tmp_path):
    path, document, _ = dump
    out = tmp_path / "vmm.html"
    result = run_cli("render", path, "-o", out)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<svg" in page and "<rect" in page and "active_allocated" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and "<script" not in page  # self-contained
    assert page.count("<svg") == len(document["snapshot"]["segments"])


def test_torch_viz(dump, tmp_path):
    path, document, _ = dump
    out = tmp_path / "viz.html"
    snap = tmp_path / "snapshot.pickle"
    result = run_cli("torch-viz", path, "-o", out, "--pickle", snap)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "<html" in page.lower()
    with open(snap, "rb") as f:
        snapshot = pickle.load(f)
    assert "vmm_pools" not in snapshot
    assert snapshot["segments"] == document["snapshot"]["segments"]


def test_torch_viz_helpers_accept_the_snapshot(dump):
    """The snapshot satisfies the checks of this torch's _memory_viz functions."""
    from torch.cuda import _memory_viz as viz

    snapshot = stats_cli.torch_snapshot(dump[1])
    if hasattr(viz, "segsum"):
        assert "segments:" in viz.segsum(snapshot)
    if hasattr(viz, "stats"):  # torch 1.x: takes the list of segments, asserts the sizes
        stats = viz.stats(snapshot["segments"])
        assert stats["segments"] == len(snapshot["segments"])
    page, _ = stats_cli.torch_viz_html(snapshot, viz)
    assert page


def test_torch_viz_without_a_visualiser_fails_clearly(dump):
    class Empty:
        pass

    with pytest.raises(RuntimeError, match="neither segment_plot nor segments"):
        stats_cli.torch_viz_html(stats_cli.torch_snapshot(dump[1]), Empty())


def test_bad_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    result = run_cli("summarize", bad)
    assert result.returncode == 1 and "not a vmm_torch.dump_stats() file" in result.stderr
    result = run_cli("summarize", tmp_path / "missing.json")
    assert result.returncode == 1
    result = run_cli("frobnicate", bad)
    assert result.returncode == 2


def test_format_bytes():
    assert stats_cli.format_bytes(0) == "0 B"
    assert stats_cli.format_bytes(1536) == "1.5 KiB"
    assert stats_cli.format_bytes(3 * MIB) == "3.0 MiB"
    assert stats_cli.format_bytes(5 << 40) == "5.0 TiB"
