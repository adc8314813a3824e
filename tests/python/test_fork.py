"""fork() and vmm_torch on the host backend: a forked child (DataLoader workers and
multiprocessing fork by default on Linux) never allocates from its parent's pool, so it can
never overwrite the parent's tensors; it gets a clear error there and can make pools of its
own. Tensors made before the fork stay readable in the child.

The scenario runs in a fresh interpreter: forking the test runner itself, which may have
initialised CUDA and started threads (a fork of such a process may hang), would test the
runner rather than vmm. Its parent runs CPU ops on two threads, as on any machine with several
cores, and its child sets one thread first, as PyTorch's DataLoader workers do: PyTorch's
OpenMP runtime is not fork-safe, and a child's first multi-threaded op after a parent's hangs
(PyTorch alone shows it; the scenario without the child's line hung on the 16-core GPU machine
and, with the parent's, hangs here too)."""

import subprocess
import sys
import textwrap

SCENARIO = textwrap.dedent(r'''
    import os
    import torch
    import vmm_torch

    MIB = 1 << 20
    torch.set_num_threads(2)  # the parent's CPU ops start OpenMP threads, as with many cores


    def in_child(check):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)  # OpenMP threads do not survive fork (DataLoader's rule)
                check()
                code = 0
            except BaseException as e:
                os.write(2, f"child: {type(e).__name__}: {e}\n".encode())
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)


    with vmm_torch.Pool("host", handle_type="posix_fd") as pool:
        parent = pool.empty((MIB,), dtype=torch.uint8)
        parent.fill_(0xAA)
        spare = pool.empty((4 * MIB,), dtype=torch.uint8)
        del spare  # cached free space the child must not take

        def child():
            try:
                pool.empty((4 * MIB,), dtype=torch.uint8)
                raise AssertionError("the child allocated from its parent's pool")
            except vmm_torch.VmmError as e:
                assert e.code == "FAILED_PRECONDITION", e.code
                assert "fork" in str(e), str(e)
            try:
                vmm_torch.export_tensor(parent)
                raise AssertionError("the child exported its parent's memory")
            except vmm_torch.VmmError:
                pass
            assert int(parent[-1]) == 0xAA  # made before the fork: still readable
            with vmm_torch.Pool("host") as own:  # a pool of its own works
                mine = own.empty((4 * MIB,), dtype=torch.uint8)
                mine.fill_(0x55)
                assert int(mine.sum()) == 0x55 * 4 * MIB

        assert in_child(child) == 0, "the child's checks failed"
        assert bool((parent == 0xAA).all()), "the child overwrote the parent's tensor"
        again = pool.empty((4 * MIB,), dtype=torch.uint8)  # the parent goes on as before
        assert vmm_torch.in_vmm_pool(again)
    print("fork scenario: ok")
''')


def test_a_forked_child_cannot_allocate_from_its_parents_pool():
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fork scenario: ok" in done.stdout
