"""dump_stats and `python -m vmm_torch.stats` (summarize, render, torch-viz) on a real dump,
on hostile dumps (escaped output, one-line failures), and dump_stats' file handling;
`timeline` on synthetic memory snapshots (pickle and JSON) and on hostile ones."""

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


@pytest.mark.parametrize("command", ["summarize", "render", "torch-viz", "timeline"])
@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_hostile_files_fail_in_one_line(tmp_path, capsys, command, name):
    path = tmp_path / f"{name}.json"
    path.write_bytes(HOSTILE_FILES[name])
    out = tmp_path / "out.html"
    code, _, err = run_main(capsys, command, path, "-o", out) if command != "summarize" else \
        run_main(capsys, command, path)
    assert_one_line_failure(code, err, path)
    assert not out.exists()


@pytest.mark.parametrize("command", ["summarize", "render", "torch-viz", "timeline"])
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


def test_dump_stats_and_the_command_line_write_names_of_the_longest_length(dump, tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for length in (limit - 13, limit):  # was: the temporary name, 14 bytes longer, did not fit
        target = tmp_path / ("s" * (length - 5) + ".json")
        target.write_text("old")  # the file system takes the name
        vmm_torch.dump_stats(target)
        assert "snapshot" in json.loads(target.read_text())
    page = tmp_path / ("p" * (limit - 5) + ".html")
    result = run_cli("render", dump[0], "-o", page)
    assert result.returncode == 0, result.stderr
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert len(_names(tmp_path)) == 3  # no temporary file left


# --- timeline: memory snapshots (torch.cuda.memory._dump_snapshot) ------------------------------

KIB = 1 << 10


def frame(name, filename, line=0):
    return {"name": name, "filename": filename, "line": line}


CAPTURE = [frame("torch::unwind::unwind()", "??"),
           frame("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp")]
USER_FRAMES = CAPTURE + [
    frame("forward", "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 125),
    frame("train_step", "/home/u/train.py", 42),
    frame("<module>", "/home/u/main.py", 7)]
TORCH_ONLY = CAPTURE + [frame("forward", "/venv/site-packages/torch/nn/modules/linear.py", 125)]
BACKWARD = CAPTURE + [
    frame("torch::autograd::generated::MulBackward0::apply(std::vector<at::Tensor>&&)", "??"),
    frame("torch::autograd::Engine::thread_main()", "??")]
# Addresses of the trace's allocations, and of two alive before it began.
A1, A2, A3, A4, A5, X, Y = (0x7f0000000000 + i * 0x1000000 for i in range(7))


def entry(action, addr, size, frames=None, time_us=None):
    e = {"action": action, "addr": addr, "size": size, "stream": 0}
    if frames is not None:
        e["frames"] = frames
    if time_us is not None:
        e["time_us"] = time_us
    return e


def synthetic_snapshot():
    """A known trace of device 0. Events (allocs and the frees that end allocations), with the
    bytes alive in each (X: 4 MiB alive throughout, Y: 1 MiB freed at event 4):
    0 alloc A1 1 MiB (6), 1 alloc A2 2 MiB (8), 2 alloc A3 512 KiB (8.5), 3 free A1 (8.5),
    4 free Y (7.5), 5 alloc A4 3 MiB (9.5: the peak), 6 free A2 requested, never completed
    (9.5), 7 alloc A5 512 B, 8 free A4; A3 and A5 alive at the end."""
    trace = [
        entry("alloc", A1, MIB, BACKWARD, 1000),
        entry("alloc", A2, 2 * MIB, TORCH_ONLY, 1001),
        entry("alloc", A3, 512 * KIB, USER_FRAMES, 1002),
        entry("free_requested", A1, MIB, BACKWARD, 1003),
        entry("free_completed", A1, MIB, None, 1004),
        entry("free_requested", Y, MIB, USER_FRAMES, 1005),
        entry("free_completed", Y, MIB, None, 1006),
        entry("alloc", A4, 3 * MIB, USER_FRAMES, 1007),
        entry("free_requested", A2, 2 * MIB, TORCH_ONLY, 1008),
        entry("alloc", A5, 512, [], 1009),
        entry("segment_map", 0x7e0000000000, 2 * MIB, [], 1010),
        entry("free_requested", A4, 3 * MIB, USER_FRAMES),
        entry("free_completed", A4, 3 * MIB),
    ]
    blocks = [{"address": X, "size": 4 * MIB, "requested_size": 4 * MIB,
               "state": "active_allocated", "frames": []},
              {"address": A3, "size": 512 * KIB, "requested_size": 512 * KIB,
               "state": "active_allocated", "frames": USER_FRAMES},
              {"address": A5, "size": 512, "requested_size": 512, "state": "active_allocated",
               "frames": []},
              {"address": A4, "size": 3 * MIB, "requested_size": 0, "state": "inactive",
               "frames": []}]
    segments = [{"device": 0, "address": X, "total_size": 16 * MIB, "allocated_size": 5 * MIB,
                 "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                 "blocks": blocks},
                {"device": 1, "address": 0x1000, "total_size": 2 * MIB, "allocated_size": MIB,
                 "blocks": [{"address": 0x1000, "size": MIB, "state": "active_allocated"}]}]
    return copy.deepcopy({"segments": segments, "device_traces": [trace, []],
                          "allocator_settings": {"expandable_segments": True},
                          "external_annotations": []})  # frames shared with nothing else


SVG = "{http://www.w3.org/2000/svg}"
PEAK = "peak 9.5 MiB at event 5"


def write_snapshot(path, snapshot, fmt):
    if fmt == "pickle":
        path.write_bytes(pickle.dumps(snapshot))
    else:
        path.write_text(json.dumps(snapshot))
    return path


def parse_svg(path):
    import xml.etree.ElementTree as ET

    return ET.parse(path).getroot()


def svg_texts(root):
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def polygons(root, cls):
    return [p for p in root.iter(f"{SVG}polygon") if p.get("class") == cls]


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_timeline_draws_a_snapshot(tmp_path, fmt):
    path = write_snapshot(tmp_path / f"snap.{fmt}", synthetic_snapshot(), fmt)
    out = tmp_path / "timeline.svg"
    result = run_cli("timeline", path, "-o", out)  # the real command line
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {out}\n"
    root = parse_svg(out)
    assert root.tag == f"{SVG}svg" and root.get("width") == "1200"
    assert len(polygons(root, "band")) == 7 and not polygons(root, "other")
    fills = {p.get("fill") for p in polygons(root, "band")}
    assert len(fills) == 7 and "#b0b0b0" not in fills
    legend = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "legend")
    entries = [t for t in svg_texts(legend) if "MiB" in t or " B," in t or "KiB" in t]
    assert len(entries) == 7 and len(list(legend.iter(f"{SVG}rect"))) == 7
    assert entries[0] == "4.0 MiB, no stack recorded, from before the trace to the end"
    assert entries[1] == "3.0 MiB, train_step .../u/train.py:42, from event 5 to event 8"
    assert entries[2] == ("2.0 MiB, forward .../modules/linear.py:125, from event 1 to "
                          "event 6")  # free requested at 6, never completed
    assert entries[3] == "1.0 MiB, backward: MulBackward0, from event 0 to event 3"
    assert entries[4] == "1.0 MiB, train_step .../u/train.py:42, from before the trace to event 4"
    assert PEAK in svg_texts(root)
    page = out.read_text()
    assert "<script" not in page and "href" not in page and "http" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


def test_timeline_top_k_and_the_grey_rest(tmp_path, capsys):
    path = write_snapshot(tmp_path / "snap.pickle", synthetic_snapshot(), "pickle")
    out = tmp_path / "t.svg"
    code, _, err = run_main(capsys, "timeline", path, "-o", out, "--top", "3", "--width", "800",
                            "--height", "500")
    assert code == 0, err
    root = parse_svg(out)
    assert root.get("width") == "800" and root.get("height") == "500"
    assert len(polygons(root, "band")) == 3 and len(polygons(root, "other")) == 1
    assert polygons(root, "other")[0].get("fill") == "#b0b0b0"
    texts = svg_texts(root)
    assert "4 other allocations (up to 1.0 MiB each), summed" in texts
    assert PEAK in texts  # the peak counts the grey ones too
    code, _, err = run_main(capsys, "timeline", path, "-o", out, "--top", "0")
    assert code == 0, err
    root = parse_svg(out)
    assert not polygons(root, "band") and len(polygons(root, "other")) == 1


def test_timeline_peak_and_columns():
    snapshot = synthetic_snapshot()
    line = stats_cli.timeline(snapshot, 0)
    assert line.events == 9
    spans = sorted((a.first, a.last, a.size, a.before_trace) for a in line.allocations)
    assert spans == sorted([(0, 8, 4 * MIB, True), (0, 4, MIB, True), (0, 3, MIB, False),
                            (1, 6, 2 * MIB, False), (2, 8, 512 * KIB, False),
                            (5, 8, 3 * MIB, False), (7, 8, 512, False)])
    assert line.allocations[0].size == 4 * MIB  # alive throughout: at the bottom
    # Device 1 has no trace entries: its block alive throughout makes the one column.
    other = stats_cli.timeline(snapshot, 1)
    assert other.events == 1 and [(a.first, a.last, a.size) for a in other.allocations] == [
        (0, 0, MIB)]
    svg = stats_cli.timeline_svg(snapshot, 1)
    assert "peak 1.0 MiB at event 0" in svg


def test_user_frame_rule():
    assert stats_cli.user_frame(USER_FRAMES) == "train_step .../u/train.py:42"
    assert stats_cli.user_frame(TORCH_ONLY) == "forward .../modules/linear.py:125"
    assert stats_cli.user_frame(BACKWARD) == "backward: MulBackward0"
    assert stats_cli.user_frame(CAPTURE) == "no Python frame"
    assert stats_cli.user_frame([]) == "no stack recorded"
    generated = [frame("call", "/tmp/torchinductor_u/ab/cab12.py", 80),
                 frame("run", "/usr/lib/python3.12/site-packages/torch/_inductor/utils.py", 9),
                 frame("step", "train.py", 3)]
    assert stats_cli.user_frame(generated) == "step train.py:3"


def test_timeline_samples_down_beyond_the_event_cap(tmp_path, capsys):
    # 30,000 events: a ramp of 15,000 allocations of 1 KiB, then all freed; one big one.
    trace = [entry("alloc", 0x1000 + i * 1024, KIB) for i in range(15000)]
    trace += [entry("free_completed", 0x1000 + i * 1024, KIB) for i in range(15000)]
    trace.insert(100, entry("alloc", 1 << 40, 64 * MIB, USER_FRAMES))
    path = write_snapshot(tmp_path / "big.pickle", {"segments": [], "device_traces": [trace]},
                          "pickle")
    out = tmp_path / "big.svg"
    code, _, err = run_main(capsys, "timeline", path, "-o", out)
    assert code == 0, err
    root = parse_svg(out)
    texts = svg_texts(root)
    assert any(t.startswith("30001 events sampled down to 20000 columns") for t in texts)
    peak = 64 * MIB + 15000 * KIB
    assert f"peak {stats_cli.format_bytes(peak)} at event 15000" in texts
    points = polygons(root, "other")[0].get("points").split()
    assert len(points) <= 4 * 20000
    assert out.stat().st_size < 1_000_000
    small = stats_cli.timeline_svg(parse_snapshot_file(path), max_events=100)
    assert "30001 events sampled down to 100 columns" in small


def parse_snapshot_file(path):
    return stats_cli.load_snapshot(str(path))


class Thing:
    pass


def _reduce_pickle(tmp_path):
    """A protocol-0 pickle that would run os.system("touch MARKER") when loaded."""
    marker = tmp_path / "MARKER"
    return (b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."), marker


@pytest.mark.parametrize("name", ["function", "instance", "nested", "reduce", "protocol0"])
def test_timeline_refuses_pickles_that_need_a_global(tmp_path, capsys, name):
    snapshot = synthetic_snapshot()
    marker = tmp_path / "MARKER"
    if name == "function":
        data = pickle.dumps(os.system)
    elif name == "instance":
        data = pickle.dumps(Thing())
    elif name == "nested":  # a global deep inside an otherwise good snapshot
        snapshot["device_traces"][0][0]["frames"] = [os.system]
        data = pickle.dumps(snapshot)
    elif name == "reduce":
        data, marker = _reduce_pickle(tmp_path)
    else:
        data = pickle.dumps({"segments": [], "device_traces": [[]], "x": os.getcwd}, protocol=0)
    path = tmp_path / "evil.pickle"
    path.write_bytes(data)
    out = tmp_path / "out.svg"
    code, _, err = run_main(capsys, "timeline", path, "-o", out)
    assert_one_line_failure(code, err, path)
    assert "the pickle needs the global " in err and "only builtin containers and scalars" in err
    assert not out.exists() and not marker.exists()


def test_timeline_refusal_in_the_real_command_line(tmp_path):
    data, marker = _reduce_pickle(tmp_path)
    path = tmp_path / "evil.pickle"
    path.write_bytes(data)
    result = run_cli("timeline", path, "-o", tmp_path / "o.svg")
    assert result.returncode == 1 and not marker.exists() and not (tmp_path / "o.svg").exists()
    assert result.stderr == (f"vmm-stats: {path}: the pickle needs the global os.system; only "
                             f"builtin containers and scalars are accepted\n")


def _nested_tuple_key(depth):
    # {((...()...),): 1}: hashing a key nested this deep recurses in C once per level.
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"K\x01s."


HOSTILE_PICKLES = {
    # A million nested tuples as a dict key: plain pickle.loads overflows the C stack.
    "deep_tuple_key": _nested_tuple_key(1_000_000),
    "deep_tuple_via_memo": b"\x80\x04)\x94" + b"".join(
        b"h" + bytes([i]) + b"\x85\x94" for i in range(200)) + b"}h\xc8K\x01s.",
    "huge_memo_index": b"\x80\x04]r\xff\xff\xff\x7f.",  # the unpickler would size its memo
    "truncated": pickle.dumps(synthetic_snapshot())[:-40],
    "no_stop": pickle.dumps(synthetic_snapshot())[:-1],
    "unknown_opcode": b"\x80\x04\xff.",
    "persistent_id": b"\x80\x04K\x01Q.",
    "extension_code": b"\x80\x04\x82\x01.",
    "out_of_band_buffer": b"\x80\x05\x97.",
    "stack_underflow": b"\x80\x04e.",
    "bad_length": b"\x80\x04X\xff\xff\xff\x7f.",
    "not_a_pickle": b"hello, world",
    "empty": b"",
    "json_array": b"[1, 2]",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_PICKLES))
def test_timeline_refuses_hostile_pickles(tmp_path, capsys, name):
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(HOSTILE_PICKLES[name])
    out = tmp_path / "out.svg"
    if name.startswith("deep_tuple"):  # in a process of its own: a crash would show there
        result = run_cli("timeline", path, "-o", out)
        code, err = result.returncode, result.stderr
        assert "nests tuples more than 64 deep" in err
    else:
        code, _, err = run_main(capsys, "timeline", path, "-o", out)
    assert_one_line_failure(code, err, path)
    assert not out.exists()


def test_nested_tuples_within_the_limit_load():
    from vmm_torch import _pickles

    ok = ()
    for _ in range(_pickles.MAX_TUPLE_DEPTH - 1):
        ok = (ok,)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert _pickles.load_builtins(pickle.dumps({ok: [ok]}, protocol=protocol)) == {ok: [ok]}
        with pytest.raises(_pickles.PickleRefused, match="nests tuples"):
            _pickles.load_builtins(pickle.dumps({(ok,): 1}, protocol=protocol))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_builtin_pickles_of_every_protocol_load(protocol):
    from vmm_torch import _pickles

    value = {"a": [1, -2, 2**100, 2.5, None, True, "é\n", (1, (2, 3))], "b": {"c": ()},
             "d": [[]] * 3, "e": ((1,),) * 4}
    if protocol >= 4:  # earlier protocols write these through globals (refused)
        value.update(f=b"\x00\xff", g={1, 2}, h=frozenset({(1,)}))
    assert _pickles.load_builtins(pickle.dumps(value, protocol=protocol)) == value
    snapshot = synthetic_snapshot()
    assert _pickles.load_builtins(pickle.dumps(snapshot, protocol=protocol)) == snapshot


def test_timeline_refuses_oversized_files(tmp_path, capsys, monkeypatch):
    path = write_snapshot(tmp_path / "snap.pickle", synthetic_snapshot(), "pickle")
    monkeypatch.setattr(stats_cli, "SNAPSHOT_LIMIT", 100)
    code, _, err = run_main(capsys, "timeline", path, "-o", tmp_path / "o.svg")
    assert_one_line_failure(code, err, path)
    assert "larger than 100 B" in err and not (tmp_path / "o.svg").exists()


def _shared_snapshot(level, n):
    """A snapshot pickle in which one list is referred to n times at each of three levels:
    about 6n bytes that hold n**3 references (a pickle refers to an object again in 2 bytes)."""
    frames = [frame("f", "a.py", 1)] * n
    if level == "traces":
        snapshot = {"device_traces": [[entry("alloc", A1, KIB, frames)] * n] * n,
                    "segments": []}
    else:  # segments sharing one list of blocks, which share one list of frames
        block = {"address": X, "size": KIB, "requested_size": KIB,
                 "state": "active_allocated", "frames": frames}
        segment = {"device": 0, "address": X, "total_size": 2 * MIB, "blocks": [block] * n}
        snapshot = {"device_traces": [[]], "segments": [segment] * n}
    return pickle.dumps(snapshot)


@pytest.mark.parametrize("level", ["traces", "segments"])
def test_timeline_of_a_pickle_that_shares_its_lists_takes_time_linear_in_its_size(tmp_path,
                                                                                    level):
    n = 2000
    data = _shared_snapshot(level, n)
    assert len(data) < 20 * KIB
    path = tmp_path / "shared.pickle"
    path.write_bytes(data)
    out = tmp_path / "out.svg"
    result = run_cli("timeline", path, "-o", out)  # was n**3 checks: about 45 minutes
    assert result.returncode == 0, result.stderr
    summary = svg_texts(parse_svg(out))
    assert any(f"shared.pickle: {n} allocations" in text for text in summary), summary


def test_a_list_shared_as_a_trace_and_as_frames_is_checked_as_both():
    # Checked once per kind of part it stands for, not once in all: as frames it lacks
    # "filename", which the timeline would read.
    entry = {"action": "alloc", "addr": 0, "size": 1}
    trace = [entry]
    entry["frames"] = trace
    with pytest.raises(stats_cli.DumpError, match="filename"):
        stats_cli.parse_snapshot(pickle.dumps({"device_traces": [trace], "segments": []}))


def _malformed(change):
    snapshot = synthetic_snapshot()
    return change(snapshot) or snapshot


def _set(path, value):
    def change(snapshot):
        target = snapshot
        for part in path[:-1]:
            target = target[part]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return change


MALFORMED = {
    "list": (lambda s: [s], "not a memory snapshot of torch.cuda.memory._snapshot() (the "
                            "document is an array)"),
    "no_device_traces": (_set(["device_traces"], KeyError), "no \"device_traces\""),
    "no_segments": (_set(["segments"], KeyError), "the document has no \"segments\""),
    "device_traces_dict": (_set(["device_traces"], {}), "device_traces is an object, expected "
                                                        "an array"),
    "trace_string": (_set(["device_traces", 0], "x"), "device_traces[0] is \"x\", expected an "
                                                      "array"),
    "entry_int": (_set(["device_traces", 0, 2], 7), "device_traces[0][2] is 7, expected an "
                                                    "object"),
    "no_action": (_set(["device_traces", 0, 1, "action"], KeyError),
                  "device_traces[0][1] has no \"action\""),
    "action_int": (_set(["device_traces", 0, 1, "action"], 3),
                   "device_traces[0][1].action is 3, expected a string"),
    "no_addr": (_set(["device_traces", 0, 0, "addr"], KeyError),
                "device_traces[0][0] has no \"addr\""),
    "addr_string": (_set(["device_traces", 0, 0, "addr"], "0x10"),
                    "device_traces[0][0].addr is \"0x10\", expected an integer in [0, 2**64)"),
    "size_negative": (_set(["device_traces", 0, 0, "size"], -1),
                      "device_traces[0][0].size is -1, expected an integer in [0, 2**64)"),
    "size_float": (_set(["device_traces", 0, 0, "size"], 1.5),
                   "device_traces[0][0].size is 1.5, expected an integer in [0, 2**64)"),
    "size_huge": (_set(["device_traces", 0, 0, "size"], 2**80),
                  "device_traces[0][0].size is an integer of 81 bits, expected an integer in "
                  "[0, 2**64)"),
    "size_bool": (_set(["device_traces", 0, 0, "size"], True),
                  "device_traces[0][0].size is true, expected an integer in [0, 2**64)"),
    "time_string": (_set(["device_traces", 0, 0, "time_us"], "now"),
                    "device_traces[0][0].time_us is \"now\", expected a number"),
    "frames_dict": (_set(["device_traces", 0, 0, "frames"], {}),
                    "device_traces[0][0].frames is an object, expected an array"),
    "frame_string": (_set(["device_traces", 0, 0, "frames", 1], "f"),
                     "device_traces[0][0].frames[1] is \"f\", expected an object"),
    "frame_no_filename": (_set(["device_traces", 0, 0, "frames", 0, "filename"], KeyError),
                          "device_traces[0][0].frames[0] has no \"filename\""),
    "frame_line_string": (_set(["device_traces", 0, 0, "frames", 0, "line"], "1"),
                          "device_traces[0][0].frames[0].line is \"1\", expected an integer"),
    "segments_dict": (_set(["segments"], {}), "segments is an object, expected an array"),
    "block_size_string": (_set(["segments", 0, "blocks", 0, "size"], "4"),
                          "segments[0].blocks[0].size is \"4\", expected an integer"),
    "block_frames_int": (_set(["segments", 0, "blocks", 1, "frames"], 5),
                         "segments[0].blocks[1].frames is 5, expected an array"),
}


@pytest.mark.parametrize("fmt", ["pickle", "json"])
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_timeline_refuses_malformed_snapshots(tmp_path, capsys, fmt, name):
    change, message = MALFORMED[name]
    snapshot = _malformed(change)
    path = write_snapshot(tmp_path / f"snap.{fmt}", snapshot, fmt)
    out = tmp_path / "out.svg"
    code, _, err = run_main(capsys, "timeline", path, "-o", out)
    assert_one_line_failure(code, err, path)
    assert message in err, err
    assert not out.exists()


def test_timeline_device_and_size_arguments(tmp_path, capsys):
    path = write_snapshot(tmp_path / "snap.json", synthetic_snapshot(), "json")
    out = tmp_path / "o.svg"
    code, _, err = run_main(capsys, "timeline", path, "-o", out, "--device", "2")
    assert_one_line_failure(code, err, path)
    assert "no trace of device 2 (the snapshot has devices 0 to 1)" in err
    code, _, err = run_main(capsys, "timeline", path, "-o", out, "--height", "300")
    assert_one_line_failure(code, err, out)
    assert "leaves no room" in err and not out.exists()
    for bad in (["--top", "101"], ["--width", "10"], ["--device", "-1"], ["--top", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            stats_cli.main(["timeline", str(path), "-o", str(out)] + bad)
        assert exit_info.value.code == 2
    capsys.readouterr()
    assert not out.exists()


TAGS = {"svg", "title", "rect", "text", "polygon", "g", "line", "circle"}
ATTRS = {"xmlns", "width", "height", "viewBox", "font-family", "font-size", "role", "x", "y",
         "fill", "font-weight", "class", "points", "stroke", "stroke-width", "x1", "y1", "x2",
         "y2", "text-anchor", "stroke-dasharray", "cx", "cy", "r"}


@pytest.mark.parametrize("text", HOSTILE_TEXT + ["\x00nul\x7f", "\ud800", "\ufffe&amp;"])
@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_timeline_escapes_frame_text(tmp_path, capsys, text, fmt):
    snapshot = synthetic_snapshot()
    hostile = [frame(text, text + ".py", 1), frame(text, "/home/" + text + "/x.py", 2)]
    for e in snapshot["device_traces"][0]:
        if "frames" in e:
            e["frames"] = hostile
    for block in snapshot["segments"][0]["blocks"]:
        block["frames"] = hostile
    path = tmp_path / f"snap.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(snapshot))  # lone surrogates as \ud800 escapes
    else:
        path.write_bytes(pickle.dumps(snapshot))
    out = tmp_path / "o.svg"
    code, _, err = run_main(capsys, "timeline", path, "-o", out)
    assert code == 0, err
    raw = out.read_bytes()
    raw.decode("utf-8")  # strict: no lone surrogate written
    page = raw.decode()
    root = parse_svg(out)  # well-formed XML: no control character, every < and & escaped
    for element in root.iter():
        assert element.tag.startswith(SVG) and element.tag[len(SVG):] in TAGS, element.tag
        assert set(element.attrib) <= ATTRS, element.attrib
    for bad in ("<script", "<img", "<svg onload", "\x1b", "\u202e", "\x00", "\x07"):
        assert bad not in page
    assert any(text[:5] in t or repr(text)[1:6] in t for t in svg_texts(root))


def _mutations():
    return st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]),
                              st.integers(min_value=0, max_value=10**6),
                              st.integers(min_value=0, max_value=255)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(changes=_mutations(), protocol=st.sampled_from([0, 2, 4, 5]))
def test_timeline_on_mutated_pickles_never_raises(tmp_path_factory, changes, protocol):
    snapshot = synthetic_snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][:6]
    data = bytearray(pickle.dumps(snapshot, protocol=protocol))
    for kind, where, byte in changes:
        where %= len(data) + 1
        if kind == "flip" and where < len(data):
            data[where] = byte
        elif kind == "insert":
            data[where:where] = bytes([byte])
        elif where < len(data):
            del data[where]
    where = tmp_path_factory.mktemp("fuzz")
    path = where / "s.pickle"
    path.write_bytes(bytes(data))
    code = stats_cli.main(["timeline", str(path), "-o", str(where / "o.svg")])
    assert code in (0, 1)
    if code == 0:
        parse_svg(where / "o.svg")
