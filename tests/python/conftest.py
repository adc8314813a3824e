"""Checks for the whole Python suite: no test module changes the process environment when it
is imported, no test or module (its fixtures included) leaves it changed, and no module leaves
sends of this process held.

The suite runs one file per process under Bazel but all files in one pytest process on the GPU
machine, where a variable set at a module's import (VMM_BACKEND=host, once) reached every later
test and the processes they spawned, and turned their CUDA pools into host ones; and sends that
one module never received (payloads it tampered with) held chunks against the send budget of
the next module's tests. A test that needs a variable sets it with monkeypatch, which puts it
back; a module whose sends are not all received gives them a short lease (set_send_lease).

A test that fills most of the GPU (marked fills_gpu) runs alone: the GPU machine's suite runs
several tests at once (pytest-xdist), and one that filled the GPU made another's first
allocation fail with out of memory."""

import fcntl
import os
import sys
import tempfile
import time

import pytest

# Set by pytest itself while a test runs, and by PyTorch when CUDA starts (before 2.9 it sets
# CUDA_MODULE_LOADING=LAZY where the variable is unset).
_SET_BY_OTHERS = frozenset({"PYTEST_CURRENT_TEST", "CUDA_MODULE_LOADING"})
_at_start: dict[str, str] = {}
# How long a module's sends may take to be acknowledged or to reach the end of their lease
# once the module is done.
SENDS_SETTLE_S = 30


def _changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    names = (before.keys() | after.keys()) - _SET_BY_OTHERS
    return sorted(f"{n}: {before.get(n)!r} -> {after.get(n)!r}"
                  for n in names if before.get(n) != after.get(n))


# Every test holds a shared lock on the first file while it runs, a fills_gpu test an
# exclusive one (flock: the xdist workers are processes). A test passes through the second
# file first, which a fills_gpu test holds while it waits: no new test starts meanwhile, so
# it waits only for the tests under way (Linux grants shared locks past a waiting exclusive
# one).
_GPU_LOCK = os.path.join(os.environ.get("VMM_TEST_TMPDIR") or tempfile.gettempdir(),
                         "vmm_python_suite_gpu.lock")
_GPU_TURNSTILE = _GPU_LOCK + ".turnstile"


def _open_shared(path):
    """The lock file at `path`, made readable and writable by every user."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    return os.fdopen(fd, "r+")


def pytest_configure(config):
    _at_start.clear()
    _at_start.update(os.environ)
    config.addinivalue_line(
        "markers", "fills_gpu: the test fills most of the GPU, so it runs with no other test")


@pytest.fixture(autouse=True)
def _gpu_filling_tests_run_alone(request):
    exclusive = request.node.get_closest_marker("fills_gpu") is not None
    with _open_shared(_GPU_TURNSTILE) as turnstile, _open_shared(_GPU_LOCK) as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_finish(session):
    changed = _changes(_at_start, dict(os.environ))
    if changed:
        raise pytest.UsageError(
            "importing the test modules changed the environment of the test process (set "
            "variables in a fixture with monkeypatch instead): " + "; ".join(changed))


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    before = dict(os.environ)
    yield
    changed = _changes(before, dict(os.environ))
    assert not changed, "the test left the environment changed: " + "; ".join(changed)


def _vmm_loaded() -> bool:
    """Whether a test loaded libvmm in this process (the checks never load it themselves)."""
    lib = sys.modules.get("vmm_torch._lib")
    return lib is not None and getattr(lib, "_loaded", None) is not None


def _sends_held() -> int:
    import vmm_torch

    return vmm_torch.send_stats()["held"]


def _sends_held_once_at_most(limit: int, wait_s: float) -> int:
    """This process's sends held, once their acknowledgements are sent and at most `limit`
    are held or `wait_s` has passed."""
    from vmm_torch import sharing

    deadline = time.monotonic() + wait_s
    sharing.flush_acks(wait_s)
    while (held := _sends_held()) > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_state():
    """Set up before a module's own module fixtures and torn down after them, so it sees what
    the module leaves, its fixtures included."""
    environment = dict(os.environ)
    # Sends an earlier module left are that module's failure, not this one's; waiting only
    # until the count is back to them keeps one leak from costing every later module the wait.
    before = _sends_held() if _vmm_loaded() else 0
    yield
    problems = []
    changed = _changes(environment, dict(os.environ))
    if changed:
        problems.append("the module left the environment changed: " + "; ".join(changed))
    if _vmm_loaded():
        held = _sends_held_once_at_most(before, SENDS_SETTLE_S)
        if held > before:
            problems.append(
                f"the module left {held - before} send(s) held {SENDS_SETTLE_S} s after it "
                f"ended (receive them, or give sends nobody receives a short lease: "
                f"set_send_lease)")
    assert not problems, "\n".join(problems)
