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


# --- Hostile dumps ---------------------------------------------------------------------------
# A dump is untrusted input: every value that reaches a page is escaped, and every command
# fails in one line on stderr ("vmm-stats: FILE: what"), exit code 1, never a traceback.

HOSTILE_TEXT = ['<script>alert(1)</script>', '"><img src=x onerror=alert(1)>',
                "'><svg onload=alert(1)>", "</title><script>x()</script>", "\x1b[2J\x1b]0;pwn\x07",
                "line\nbreak", "\u202eevil"]
# Tags and attributes the page itself writes; nothing else may appear.
PAGE_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "table", "tr",
             "th", "td", "br", "div", "span", "svg", "rect"}
PAGE_ATTRS = {"charset", "class", "style", "xmlns", "width", "height", "role", "x", "y", "fill",
              "stroke", "stroke-width"}


class TagCollector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs = set(), set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)


def assert_page_is_inert(page):
    parser = TagCollector()
    parser.feed(page)
    assert parser.tags <= PAGE_TAGS, parser.tags - PAGE_TAGS
    assert parser.attrs <= PAGE_ATTRS, parser.attrs - PAGE_ATTRS
    for text in HOSTILE_TEXT:
        assert text not in page


def hostile_strings_document(document, text):
    """The dump with `text` in every place that holds a string (and as keys)."""
    doc = copy.deepcopy(document)
    doc["backend"] = doc["torch_version"] = text
    doc["stats"][text] = doc["stats"]["0"]
    for pool in doc["pools"].values():
        pool["device"] = pool["handle_type"] = text
    for seg in doc["snapshot"]["segments"]:
        seg["device"] = text
        for block in seg["blocks"]:
            block["state"] = text
            block["vmm_state"] = text
    return doc


def run_main(capsys, *args):
    """stats.main in this process: (exit code, stdout, stderr); no exception may escape."""
    code = stats_cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def write_json(path, document):
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_render_escapes_everything_from_the_document(dump, tmp_path, capsys, text):
    doc = write_json(tmp_path / "hostile.json", hostile_strings_document(dump[1], text))
    out = tmp_path / "page.html"
    code, _, err = run_main(capsys, "render", doc, "-o", out)
    assert code == 0, err
    assert_page_is_inert(out.read_text())
    code, summary, err = run_main(capsys, "summarize", doc)
    assert code == 0, err
    assert "\x1b" not in summary and "\u202e" not in summary and "line\nbreak" not in summary


def test_values_where_numbers_belong_are_refused_not_rendered(dump, tmp_path, capsys):
    doc = copy.deepcopy(dump[1])
    doc["stats"]["0"]["allocation.all.current"] = "<script>alert(1)</script>"
    out = tmp_path / "page.html"
    code, _, err = run_main(capsys, "render", write_json(tmp_path / "d.json", doc), "-o", out)
    assert code == 1 and not out.exists()
    assert err == (f"vmm-stats: {tmp_path / 'd.json'}: stats.0.allocation.all.current is "
                   f"\"<script>alert(1)</script>\", expected a number\n")


def assert_one_line_failure(code, err, path):
    assert code == 1, err
    assert err.startswith(f"vmm-stats: {path}: ") and err.endswith("\n"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


HOSTILE_FILES = {
    "time_1e300": b'{"snapshot": {}, "time": 1e300}',
    "time_negative_huge": b'{"snapshot": {}, "time": -1e18}',
    "nan": b'{"snapshot": {}, "time": NaN}',
    "infinity": b'{"snapshot": {"segments": [{"total_size": Infinity}]}}',
    "float_overflow": b'{"snapshot": {}, "stats": {"0": {"vmm.fragmentation": 1e400}}}',
    "huge_int": b'{"snapshot": {"segments": [{"address": ' + b"9" * 30 + b"}]}}",
    "too_many_digits": b'{"snapshot": {}, "time": ' + b"1" * 5000 + b"}",
    "deep_arrays": b'{"snapshot": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    "deep_objects": b'{"snapshot": ' + b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"}",
    "not_utf8": b'{"snapshot": {}, "backend": "\xff\xfe"}',
    "utf16": '{"snapshot": {}}'.encode("utf-16"),
    "empty": b"",
    "null": b"null",
    "list": b"[1, 2]",
    "string": b'"snapshot"',
    "snapshot_list": b'{"snapshot": []}',
    "segments_object": b'{"snapshot": {"segments": {}}}',
    "segment_int": b'{"snapshot": {"segments": [1]}}',
    "blocks_string": b'{"snapshot": {"segments": [{"blocks": "abc"}]}}',
    "block_size_string": b'{"snapshot": {"segments": [{"blocks": [{"size": "1"}]}]}}',
    "block_size_negative": b'{"snapshot": {"segments": [{"blocks": [{"size": -5}]}]}}',
    "address_float": b'{"snapshot": {"segments": [{"address": 1.5}]}}',
    "stats_list": b'{"snapshot": {}, "stats": []}',
    "stats_value_list": b'{"snapshot": {}, "stats": {"0": []}}',
    "stat_bool": b'{"snapshot": {}, "stats": {"0": {"num_ooms": true}}}',
    "pools_bad_id": b'{"snapshot": {}, "pools": {"x": {}}}',
    "pools_unicode_digit": '{"snapshot": {}, "pools": {"\u0663": {}}}'.encode(),
    "pool_stats_string": b'{"snapshot": {}, "pools": {"1": {"stats": "x"}}}',
    "pool_device_list": b'{"snapshot": {}, "pools": {"1": {"device": []}}}',
    "backend_object": b'{"snapshot": {}, "backend": {}}',
    "truncated": b'{"snapshot": {"segments": [',
}


@pytest.mark.parametrize("command", ["summarize", "render", "torch-viz"])
@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_hostile_files_fail_in_one_line(tmp_path, capsys, command, name):
    path = tmp_path / f"{name}.json"
    path.write_bytes(HOSTILE_FILES[name])
    out = tmp_path / "out.html"
    code, _, err = run_main(capsys, command, path, "-o", out) if command != "summarize" else \
        run_main(capsys, command, path)
    assert_one_line_failure(code, err, path)
    assert not out.exists()


@pytest.mark.parametrize("command", ["summarize", "render", "torch-viz"])
def test_unreadable_paths_fail_in_one_line(tmp_path, capsys, command):
    for path in (tmp_path / "missing.json", tmp_path):
        args = [command, path] + ([] if command == "summarize" else ["-o", tmp_path / "o"])
        code, _, err = run_main(capsys, *args)
        assert_one_line_failure(code, err, path)


def test_torch_viz_on_a_snapshot_torch_rejects_fails_in_one_line(dump, tmp_path, capsys):
    doc = copy.deepcopy(dump[1])
    doc["snapshot"]["segments"][0]["total_size"] += 1  # torch 1.x asserts the block sum
    doc["snapshot"]["segments"][0]["blocks"][0]["history"] = [{"bogus": 1}]
    path = write_json(tmp_path / "d.json", doc)
    code, _, err = run_main(capsys, "torch-viz", path, "-o", tmp_path / "v.html")
    assert code == 0 or (code == 1 and err.count("\n") == 1 and err.startswith("vmm-stats: "))


def test_unwritable_output_fails_in_one_line(dump, tmp_path, capsys):
    code, _, err = run_main(capsys, "render", dump[0], "-o", tmp_path / "no" / "such" / "x")
    assert_one_line_failure(code, err, tmp_path / "no" / "such" / "x")
    code, _, err = run_main(capsys, "render", dump[0], "-o", tmp_path)  # a directory
    assert_one_line_failure(code, err, tmp_path)


def test_the_command_line_prints_no_traceback(tmp_path):
    """The real process (python -m vmm_torch.stats), on a few hostile files."""
    for name in ("time_1e300", "deep_arrays", "not_utf8", "nan", "block_size_string"):
        path = tmp_path / f"{name}.json"
        path.write_bytes(HOSTILE_FILES[name])
        result = run_cli("render", path, "-o", tmp_path / "x.html")
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith(f"vmm-stats: {path}: ") and \
            result.stderr.count("\n") == 1, result.stderr


# Any JSON value, planted anywhere in a real dump.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(HOSTILE_TEXT),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value[:3]):
            yield from _paths(item, prefix + (i,))


@pytest.fixture(scope="module")
def small_dump(dump):
    doc = copy.deepcopy(dump[1])
    keep = sorted(doc["stats"]["0"])[:6]
    doc["stats"]["0"] = {k: doc["stats"]["0"][k] for k in keep}
    for pool in doc["pools"].values():
        pool["stats"] = {k: pool["stats"][k] for k in keep}
    return doc


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_json_anywhere_never_raises(small_dump, tmp_path_factory, data):
    doc = copy.deepcopy(small_dump)
    paths = list(_paths(doc))
    path = data.draw(st.sampled_from(paths))
    value = data.draw(JSON_VALUES)
    if path:
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = value
    else:
        doc = value
    where = tmp_path_factory.mktemp("fuzz")
    dump_path = where / "d.json"
    dump_path.write_text(json.dumps(doc))  # NaN and Infinity as Python writes them
    for command in ("summarize", "render", "torch-viz"):
        args = [command, dump_path] + ([] if command == "summarize" else ["-o", where / "o"])
        code = stats_cli.main([str(a) for a in args])  # raises nothing
        if code != 0:
            assert code == 1
        elif command == "render":
            assert_page_is_inert((where / "o").read_text())


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
