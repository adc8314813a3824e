"""Test helpers shared by the sharing tests: host pools of each handle type, filled tensors."""
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
