"""dump_stats and `python -m vmm_torch.stats` (summarize, render, torch-viz) on a real dump,
on hostile dumps (escaped output, one-line failures), and dump_stats' file handling."""

import copy
import gc
import html.parser
import json
import os
import pickle
import stat
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

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


# --- dump_stats writes files safely ------------------------------------------------------------


def _names(directory):
    return sorted(os.listdir(directory))


def test_dump_stats_writes_through_a_symlink(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    vmm_torch.dump_stats(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "snapshot" in json.loads(target.read_text())
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "new.json")  # a link to a file not there yet
    vmm_torch.dump_stats(dangling)
    assert dangling.is_symlink() and "snapshot" in json.loads((tmp_path / "new.json").read_text())
    assert _names(tmp_path) == ["dangling.json", "link.json", "new.json", "real.json"]


def test_dump_stats_refuses_to_replace_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    (tmp_path / "dir").mkdir()
    for path in (fifo, link, tmp_path / "dir"):
        with pytest.raises(FileExistsError, match="not a regular file"):
            vmm_torch.dump_stats(path)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and link.is_symlink()
    assert _names(tmp_path) == ["dir", "fifo", "link"]
    if os.path.exists("/dev/null"):  # a device node: refused, never replaced
        with pytest.raises(FileExistsError, match="character device"):
            vmm_torch.dump_stats("/dev/null")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("fail_in", ["json.dump", "os.replace"])
def test_dump_stats_leaves_no_temporary_file(tmp_path, monkeypatch, fail_in):
    module, name = fail_in.split(".")
    real = getattr({"json": json, "os": os}[module], name)

    def broken(*args, **kwargs):
        if fail_in == "json.dump":
            args[1].write("{partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr({"json": json, "os": os}[module], name, broken)
    (tmp_path / "keep.json").write_text("old")
    with pytest.raises(OSError, match="No space"):
        vmm_torch.dump_stats(tmp_path / "keep.json")
    monkeypatch.setattr({"json": json, "os": os}[module], name, real)
    assert _names(tmp_path) == ["keep.json"] and (tmp_path / "keep.json").read_text() == "old"


def test_dump_stats_path_types(tmp_path):
    vmm_torch.dump_stats(os.fsencode(tmp_path / "bytes.json"))
    vmm_torch.dump_stats(tmp_path / "pathlike.json")
    vmm_torch.dump_stats(str(tmp_path / "str.json"))
    assert _names(tmp_path) == ["bytes.json", "pathlike.json", "str.json"]
    for bad in (3, None, 1.5, ["x"], True):
        with pytest.raises(TypeError, match="path"):
            vmm_torch.dump_stats(bad)
    assert _names(tmp_path) == ["bytes.json", "pathlike.json", "str.json"]
