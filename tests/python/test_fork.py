"""fork() and vmm_torch on the host backend: a forked child (DataLoader workers and
multiprocessing fork by default on Linux) never allocates from its parent's pool, so it can
never overwrite the parent's tensors; it gets a clear error there and can make pools of its
own. Tensors made before the fork stay readable in the child."""

import os

import pytest
import torch

import vmm_torch

MIB = 1 << 20


def _in_child(check):
    """Runs check() in a forked child; returns its exit code (0: every assertion held)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            check()
            code = 0
        except BaseException as e:  # report through the exit code, never into pytest
            os.write(2, f"child: {type(e).__name__}: {e}\n".encode())
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_cannot_allocate_from_its_parents_pool():
    with vmm_torch.Pool("host", handle_type="posix_fd") as pool:
        parent = pool.empty((MIB,), dtype=torch.uint8)
        parent.fill_(0xAA)
        spare = pool.empty((4 * MIB,), dtype=torch.uint8)
        del spare  # cached free space the child must not take

        def child():
            with pytest.raises(vmm_torch.VmmError) as error:
                pool.empty((4 * MIB,), dtype=torch.uint8)
            assert error.value.code == "FAILED_PRECONDITION"
            assert "fork" in str(error.value)
            with pytest.raises(vmm_torch.VmmError):
                vmm_torch.export_tensor(parent)
            assert int(parent[-1]) == 0xAA  # made before the fork: still readable
            with vmm_torch.Pool("host") as own:  # a pool of its own works
                mine = own.empty((4 * MIB,), dtype=torch.uint8)
                mine.fill_(0x55)
                assert int(mine.sum()) == 0x55 * 4 * MIB

        assert _in_child(child) == 0
        assert bool((parent == 0xAA).all()), "the child overwrote the parent's tensor"
        again = pool.empty((4 * MIB,), dtype=torch.uint8)  # the parent goes on as before
        assert vmm_torch.in_vmm_pool(again)
