"""Tests of bench/traces.py: the format, the IDs, determinism, the documented sizes, and the
training trace against bench/training_trace.py.

    bazel test //bench:traces_test
    python3 -m pytest bench/traces_test.py      (from a checkout)
"""
import io
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import traces  # noqa: E402

NAMES = list(traces.WORKLOADS)
SMALL = 0.05  # the --scale of the quick checks
LINE = re.compile(r"a (0|[1-9]\d*) ([1-9]\d*)|f (0|[1-9]\d*)")


def text(name, seed=0, scale=SMALL, overrides=None):
    out = io.StringIO()
    traces.write(name, out, seed, scale, overrides)
    return out.getvalue()


def script(*args):
    """stdout of a script of this folder, run with this interpreter."""
    return subprocess.run([sys.executable, *args], cwd=HERE, check=True, capture_output=True,
                          text=True).stdout


def check_trace(data):
    """Checks a trace's text line by line, independently of traces.Stats; returns the number
    of events and the peak live bytes."""
    assert data.endswith("\n")
    live = {}
    allocated = set()
    live_bytes = peak = 0
    lines = data.split("\n")[:-1]
    for n, line in enumerate(lines, 1):
        m = LINE.fullmatch(line)
        assert m, f"line {n}: {line!r}"
        if line[0] == "a":
            ident, nbytes = int(m[1]), int(m[2])
            assert ident not in allocated, f"line {n}: ID {ident} allocated again"
            allocated.add(ident)
            live[ident] = nbytes
            live_bytes += nbytes
            peak = max(peak, live_bytes)
        else:
            ident = int(m[3])
            assert ident in live, f"line {n}: free of ID {ident}, not live"
            live_bytes -= live.pop(ident)
    return len(lines), peak


def test_list_names_every_workload():
    listed = [line.split()[0] for line in script("traces.py", "--list").splitlines()]
    assert listed == NAMES
    assert set(NAMES) >= {"training", "kv_serving", "churn", "inference_varying", "rl_phases",
                          "long_prefill"}


@pytest.mark.parametrize("name", NAMES)
def test_format_and_ids(name):
    events, peak = check_trace(text(name))
    assert events > 0 and peak > 0


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_a_seed(name):
    first = text(name, seed=3)
    assert text(name, seed=3) == first
    assert text(name, seed=4) != first


def test_command_line_writes_the_same_bytes():
    assert script("traces.py", "churn", "--seed", "7", "--scale", str(SMALL)) == \
        text("churn", seed=7)
    small = script("traces.py", "long_prefill", "--scale", str(SMALL), "--set",
                   "contexts=8192", "--set", "layers=2")
    assert small == text("long_prefill", overrides={"contexts": (8192,), "layers": 2})
    check_trace(small)


@pytest.mark.parametrize("name", NAMES)
def test_scale_multiplies_the_length(name):
    w = traces.WORKLOADS[name]
    assert w.params(SMALL)[w.length] < w.defaults[w.length]
    assert text(name).count("\n") < w.events


def test_unknown_parameter_is_refused():
    with pytest.raises(ValueError, match="no parameter"):
        traces.events("churn", overrides={"no_such": 1})
    r = subprocess.run([sys.executable, "traces.py", "churn", "--set", "no_such=1"], cwd=HERE,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "parameters are" in r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_default_scale_matches_its_documentation(name):
    """At the default scale: the events and the peak live bytes the docstring gives for seed
    0, at most 100,000 events, and the documented range of peak live bytes for other seeds
    (computed by streaming through traces.Stats)."""
    w = traces.WORKLOADS[name]
    lo, hi = w.peak_gib_range
    for seed in (0, 1, 2):
        s = traces.Stats()
        traces.run(name, s, seed)
        peak_gib = s.peak_live_bytes / traces.GIB
        assert s.events <= 100_000
        assert lo <= peak_gib <= hi, f"seed {seed}: peak {peak_gib:.3f} GiB"
        if seed == 0:
            assert s.events == w.events
            assert round(peak_gib, 3) == w.peak_gib_seed0
    assert 2 <= lo and hi <= 20


def test_readme_table_matches():
    """bench/README.md's table of the suite gives each workload's default figures."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name, w in traces.WORKLOADS.items():
        row = re.search(r"^\| `" + name + r"` \|.*$", readme, re.M)
        assert row, f"no row for {name}"
        cells = [c.strip() for c in row[0].strip("|").split("|")]
        assert cells[-2] == f"{w.events:,}", cells
        assert cells[-1] == f"{w.peak_gib_seed0:.3f} GiB", cells


@pytest.mark.parametrize("seed,args", [
    (0, []),                                   # the default trace, 20,160 events
    (1, ["--steps", "3"]),
    (9, ["--steps", "6", "--layers", "4", "--hidden", "1024"]),
])
def test_training_is_training_trace_exactly(seed, args):
    expected = script("training_trace.py", "--seed", str(seed), *args)
    flags = dict(zip(args[::2], args[1::2]))
    ours = ["traces.py", "training", "--seed", str(seed)]
    if "--steps" in flags:
        ours += ["--scale", str(int(flags["--steps"]) / 60)]
    for key in ("--layers", "--hidden"):
        if key in flags:
            ours += ["--set", f"{key[2:]}={flags[key]}"]
    assert script(*ours) == expected
    check_trace(expected)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    # Keep pytest's cache out of the (read-only) runfiles tree.
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", __file__] + sys.argv[1:]))
