"""Test helpers shared by the sharing tests: host pools of each handle type, filled tensors,
and hand-made payloads."""
import time

import pytest
import torch

import vmm_torch

HANDLE_TYPES = ["posix_fd", "fabric"]


@pytest.fixture(params=HANDLE_TYPES)
def pool(request):
    """A host pool, once per handle type (tests take it by naming the fixture `pool`)."""
    with vmm_torch.Pool("host", handle_type=request.param) as p:
        yield p


def filled(pool, shape, dtype=torch.float32):
    """A shareable tensor of `pool` holding 0, 1, 2, ... in `shape`."""
    t = pool.empty(shape, dtype=dtype, shareable=True)
    t.copy_(torch.arange(t.numel()).to(dtype).view(shape))
    return t


class Reduced:
    """Pickles as the given (rebuild, args) pair: a payload as another process would send."""

    def __init__(self, rebuild, args):
        self.reduced = (rebuild, args)

    def __reduce__(self):
        return self.reduced


def next_id():
    """The id the next import (or pool) of this process will get (they share one counter)."""
    with vmm_torch.Pool("host") as probe:
        return probe.id + 1


def eventually(condition, timeout=10.0):
    """Whether `condition()` became true within `timeout` seconds (polled every 10 ms): for
    what background threads (acknowledgements, releases, closes) do soon after a call."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
