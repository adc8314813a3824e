"""Parity of torch.multiprocessing sharing: the cases of mp_parity_cases, under PyTorch's own
sharing and under vmm, each mode in a fresh interpreter (and its spawned children) so that
the allocator is chosen per process tree.

Modes: native-cpu and vmm-host run everywhere; native, vmm-fabric and vmm-fd need CUDA and
report "n/a" without it (vmm-fabric also without fabric handles, e.g. no IMEX channel). One
pytest test per (mode, case); select with -k, e.g. ``-k native-cpu`` or ``-k chain3``.

vmm modes set VMM_TORCH_ENABLE, which the package's vmm_torch_autoenable.pth applies at every
interpreter start. Where that .pth is not in a site folder already (a source tree, a package
installed with ``pip --target``), it is made one for the mode's processes: a user site
(PYTHONUSERBASE) holding the .pth and its module, or, where the interpreter has no user site
(a virtual environment), a sitecustomize that adds a folder holding them as a site folder.

VMM_PARITY_MODES (comma-separated) runs only those modes; VMM_PARITY_PARALLEL=1 runs them at
once. With VMM_PARITY_TABLE set to a path,
the module writes a Markdown table of every (case, mode) there at the end: "pass" (with the
case's notes), "fail: reason", "n/a: reason", or "not run".
"""

import concurrent.futures
import importlib.util
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time

import pytest
import torch

import mp_parity_cases as cases

#: The modes to run (VMM_PARITY_MODES, comma-separated; default all); the others are skipped.
SELECTED = [m for m in os.environ.get("VMM_PARITY_MODES", "").split(",") if m] or cases.MODES
#: Longest run of one mode (all its cases); each case has its own, shorter, alarm.
MODE_LIMIT = float(os.environ.get("VMM_PARITY_MODE_LIMIT", "600"))
#: VMM_PARITY_PARALLEL=1 runs the selected modes at once (each in its own process tree), for
#: a machine where the time of one run is short: the cases' waits overlap.
PARALLEL = os.environ.get("VMM_PARITY_PARALLEL") == "1"
PTH_NAME = "vmm_torch_autoenable.pth"
HOOK_MODULE = "_vmm_torch_autoenable"

_results = {}  # mode -> {case: result dict}


# --- The environment of a mode -----------------------------------------------------------------


def _module_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"cannot find the module {name}")
    origin = os.path.dirname(os.path.abspath(spec.origin))
    return os.path.dirname(origin) if os.path.basename(spec.origin) == "__init__.py" else origin


def _site_dirs():
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def _pth_installed():
    return any(os.path.exists(os.path.join(d, PTH_NAME)) for d in _site_dirs())


def _hook_runs(env):
    """Whether the autoenable module is loaded at the start of an interpreter with `env`."""
    code = f"import sys; print({HOOK_MODULE!r} in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)
    return result.stdout.strip() == "True"


_SITECUSTOMIZE = '''\
"""Makes {folder!r} a site folder (its .pth files run), then runs the sitecustomize module
that this one hides, if there is one."""
import importlib.machinery
import importlib.util
import os
import site
import sys

site.addsitedir({folder!r})
_here = os.path.dirname(os.path.abspath(__file__))
_path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _path)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def _activate_pth(env, workdir):
    """Makes the .pth run in the mode's processes; returns how (for the log)."""
    if _pth_installed():
        return "site-packages"
    source = _module_dir(HOOK_MODULE)
    files = [os.path.join(source, PTH_NAME), os.path.join(source, HOOK_MODULE + ".py")]
    base = os.path.join(workdir, "userbase")
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    user_site = os.path.join(base, "lib", version, "site-packages")
    os.makedirs(user_site, exist_ok=True)
    for path in files:
        shutil.copy(path, user_site)
    env["PYTHONUSERBASE"] = base
    if _hook_runs(env):
        return "user site"
    del env["PYTHONUSERBASE"]
    folder = os.path.join(workdir, "pth")
    customize = os.path.join(workdir, "customize")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(customize, exist_ok=True)
    for path in files:
        shutil.copy(path, folder)
    with open(os.path.join(customize, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(folder=folder))
    env["PYTHONPATH"] = os.pathsep.join([customize, env["PYTHONPATH"]])
    if _hook_runs(env):
        return "sitecustomize"
    raise RuntimeError("could not make vmm_torch_autoenable.pth run in the mode's processes")


def mode_env(mode, workdir):
    """(environment, how the .pth was made active) of `mode`'s runner and its children."""
    env = dict(os.environ)
    for name in ("VMM_TORCH_ENABLE", "PYTHONNOUSERSITE", "VMM_SEND_LEASE_S", "PYTHONUSERBASE"):
        env.pop(name, None)
    env[cases.MODE_VARIABLE] = mode
    paths = [_module_dir("mp_parity_cases"), _module_dir("vmm_torch")]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        paths.append(site.getusersitepackages())  # hidden by PYTHONUSERBASE otherwise
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    how = "not needed"
    if cases.is_vmm(mode):
        env["VMM_TORCH_ENABLE"] = cases.ENABLE_TEXT[mode]
        how = _activate_pth(env, workdir)
    return env, how


# --- Running a mode ----------------------------------------------------------------------------

_RUNNER = "import sys, mp_parity_cases as c; sys.exit(c.main(sys.argv[1:]))"


def _tail(path, lines=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _run_mode(mode, workdir):
    """Runs every case of `mode` in a fresh interpreter; {case: result}."""
    if cases.is_cuda(mode) and torch.version.cuda is None:
        return {name: {"status": "n/a", "reason": "this PyTorch has no CUDA", "notes": []}
                for name in cases.CASE_NAMES}
    os.makedirs(workdir, exist_ok=True)
    try:
        env, how = mode_env(mode, workdir)
    except Exception as error:
        return {name: {"status": "fail", "reason": f"mode setup: {error}", "notes": []}
                for name in cases.CASE_NAMES}
    out = os.path.join(workdir, "results.jsonl")
    log = os.path.join(workdir, "runner.log")
    started = time.monotonic()
    with open(log, "w") as log_file:
        log_file.write(f"mode {mode}; vmm_torch_autoenable.pth: {how}\n")
        log_file.flush()
        proc = subprocess.Popen([sys.executable, "-c", _RUNNER, "--mode", mode, "--out", out],
                                env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(MODE_LIMIT)
            ended = f"the runner exited with {code}"
        except subprocess.TimeoutExpired:
            ended = f"the runner ran past {MODE_LIMIT:.0f} s"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and anything it left behind
    except ProcessLookupError:
        pass
    proc.wait()
    results = {}
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                item = json.loads(line)
                results[item["case"]] = item
    for name in cases.CASE_NAMES:
        results.setdefault(name, {"status": "fail", "notes": [],
                                  "reason": f"no result: {ended}; log {log}:\n{_tail(log)}"})
    sys.stderr.write(f"parity mode {mode}: {time.monotonic() - started:.1f} s, .pth: {how}\n")
    return results


@pytest.fixture(scope="module")
def mode_results(tmp_path_factory):
    def get(mode):
        if PARALLEL and not _results:
            folders = {m: str(tmp_path_factory.mktemp(m)) for m in SELECTED}
            with concurrent.futures.ThreadPoolExecutor(len(SELECTED)) as pool:
                done = pool.map(lambda m: _run_mode(m, folders[m]), SELECTED)
                _results.update(zip(SELECTED, done))
        if mode not in _results:
            _results[mode] = _run_mode(mode, str(tmp_path_factory.mktemp(mode)))
        return _results[mode]

    yield get
    table = os.environ.get("VMM_PARITY_TABLE")
    if table:
        write_table(table)


@pytest.mark.parametrize("case", cases.CASE_NAMES)
@pytest.mark.parametrize("mode", cases.MODES)
def test_parity(mode_results, mode, case):
    if mode not in SELECTED:
        pytest.skip(f"{mode}: not in VMM_PARITY_MODES")
    result = mode_results(mode)[case]
    if result["status"] == "n/a":
        pytest.skip(f"{mode}: {result['reason']}")
    if result["status"] != "pass":
        pytest.fail(f"{mode} / {case}: {result['reason']}", pytrace=False)


# --- The table ---------------------------------------------------------------------------------


def _cell(result):
    if result is None:
        return "not run"
    notes = "; ".join(result.get("notes") or [])
    if result["status"] == "pass":
        text = f"pass ({notes})" if notes else "pass"
    else:
        reason = result["reason"].strip().splitlines()[0] if result["reason"].strip() else ""
        text = f"{result['status']}: {reason}"
    # Absolute paths: their file names only.
    text = re.sub(r"(?<![\w.])(?:/[^\s/:'\"]+)+/([^\s/:'\"]+)", r"\1", text)
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= 160 else text[:157] + "..."


def write_table(path):
    """Markdown: one row per case, one column per mode."""
    lines = ["| case | " + " | ".join(cases.MODES) + " |",
             "|---|" + "---|" * len(cases.MODES)]
    for name in cases.CASE_NAMES:
        cells = [_cell(_results.get(mode, {}).get(name)) for mode in cases.MODES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
