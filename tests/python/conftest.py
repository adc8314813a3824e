"""Checks for the whole Python suite: no test module changes the process environment when it
is imported, no test leaves it changed, and no module leaves sends of this process held.

The suite runs one file per process under Bazel but all files in one pytest process on the GPU
machine, where a variable set at a module's import (VMM_BACKEND=host, once) reached every later
test and the processes they spawned, and turned their CUDA pools into host ones; and sends that
one module never received (payloads it tampered with) held chunks against the send budget of
the next module's tests. A test that needs a variable sets it with monkeypatch, which puts it
back; a module whose sends are not all received gives them a short lease (set_send_lease)."""

import os
import sys

import pytest

# Set by pytest itself while a test runs.
_PYTEST_OWN = frozenset({"PYTEST_CURRENT_TEST"})
_at_start: dict[str, str] = {}
# How long a module's sends may take to be acknowledged or to reach the end of their lease
# once the module is done.
SENDS_SETTLE_S = 30


def _changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    names = (before.keys() | after.keys()) - _PYTEST_OWN
    return sorted(f"{n}: {before.get(n)!r} -> {after.get(n)!r}"
                  for n in names if before.get(n) != after.get(n))


def pytest_configure(config):
    _at_start.clear()
    _at_start.update(os.environ)


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


def _sends_held(wait_s: float) -> int:
    """This process's sends still held after waiting at most `wait_s` for them to end."""
    import vmm_torch
    from vmm_torch import sharing

    sharing.flush_acks(wait_s)
    return vmm_torch.wait_for_sends(wait_s)


@pytest.fixture(scope="module", autouse=True)
def _no_sends_left_held():
    # Sends an earlier module left are that module's failure, not this one's.
    before = _sends_held(0) if _vmm_loaded() else 0
    yield
    if not _vmm_loaded():
        return
    held = _sends_held(SENDS_SETTLE_S)
    assert held <= before, (
        f"the module left {held - before} send(s) held {SENDS_SETTLE_S} s after it ended "
        f"(receive them, or give sends nobody receives a short lease: set_send_lease)")
