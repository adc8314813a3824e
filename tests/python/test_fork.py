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


LOADER_SCENARIO = textwrap.dedent(r'''
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    import vmm_torch

    vmm_torch.install_reducers()
    torch.set_num_threads(2)  # DataLoader's workers set one thread themselves


    class Rows(Dataset):
        """Rows of a tensor the parent holds in a vmm host pool, returned as views (a
        DataLoader without automatic batching), or as the storage of a row's clone."""

        def __init__(self, pool, storages):
            self.data = pool.empty((16, 4))
            self.data.copy_(torch.arange(64.0).view(16, 4))
            self.storages = storages

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return self.data[i].storage() if self.storages else self.data[i]


    for handle_type in ("posix_fd", "fabric"):
        for isolate in (False, True):
            for storages in (False, True):
                pool = vmm_torch.Pool("host", handle_type=handle_type, isolate_sends=isolate)
                rows = Rows(pool, storages)
                loader = DataLoader(rows, batch_size=None, num_workers=2,
                                    multiprocessing_context="fork")
                if storages:  # each item: the whole dataset's storage, as PyTorch sends it
                    total = sum(float(torch.tensor(s.tolist()).sum()) for s in loader)
                    expected = 16 * 2016.0
                else:
                    total = sum(float(row.sum()) for row in loader)
                    expected = 2016.0
                assert total == expected, (handle_type, isolate, storages, total)
                assert vmm_torch.in_vmm_pool(rows.data)  # the parent's tensor stays in vmm
                assert rows.data.sum() == 2016.0
    print("loader scenario: ok")
''')


def test_forked_dataloader_workers_send_views_of_the_parents_pool_as_pytorch_does():
    """A forked worker cannot export memory of its parent's pool (it is the parent's): it
    sends such a tensor as PyTorch sends a CPU tensor (its reducer copies it into shared
    memory) rather than fail, so that a DataLoader over a dataset in a vmm host pool works."""
    done = subprocess.run([sys.executable, "-c", LOADER_SCENARIO], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loader scenario: ok" in done.stdout
    assert "[vmm]" not in done.stderr, done.stderr
