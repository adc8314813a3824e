"""vmm_torch.distributed: broadcast and all_gather between three spawned ranks (gloo, host pools).

Each test starts WORLD processes that join one gloo process group and run a scenario
function of this module; every rank reports ("ok", None) or ("failed", traceback) on a queue.
"""

import datetime
import gc
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vmm_torch
import vmm_torch.distributed as vdist

WORLD = 3
TIMEOUT = 90


# --- Running a scenario on WORLD ranks -----------------------------------------------------

def _rank_main(rank, scenario, store_path, handle_type, results):
    """Body of each spawned rank: join the group, run `scenario`, report."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        scenario(rank, handle_type)
        dist.barrier()  # no rank exits (taking its fds along) while others still import
        dist.destroy_process_group()
        results.put((rank, "ok", None))
    except BaseException:
        results.put((rank, "failed", traceback.format_exc()))


def _run(tmp_path, scenario, handle_type="posix_fd"):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / f"store_{scenario.__name__}_{handle_type}")
    procs = [ctx.Process(target=_rank_main, args=(r, scenario, store, handle_type, results),
                         daemon=True) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        reports = sorted(results.get(timeout=TIMEOUT) for _ in procs)
    finally:
        for proc in procs:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.terminate()
    failed = [f"rank {rank}:\n{text}" for rank, state, text in reports if state != "ok"]
    assert not failed, "\n".join(failed)
    assert [proc.exitcode for proc in procs] == [0] * WORLD


def _pattern(n, seed, dtype=torch.float32):
    return ((torch.arange(n, dtype=torch.float64) * 7 + seed) % 1009).to(dtype)


def _agreed(value):
    """The list of `value` from every rank."""
    out = [None] * WORLD
    dist.all_gather_object(out, value)
    return out


# --- Scenarios (run in every rank) ---------------------------------------------------------

def scenario_broadcast(rank, handle_type):
    """broadcast from a non-zero src: same bytes everywhere, one memory, exporter may free."""
    pool = vmm_torch.Pool("host", handle_type=handle_type)
    src = 1
    source = None
    if rank == src:
        source = pool.empty((64, 33), dtype=torch.float64, shareable=True)
        source.copy_(_pattern(source.numel(), 5, torch.float64).view(64, 33))
    out = vdist.broadcast(source, src=src)
    if rank == src:
        assert out is source
        assert vmm_torch.export_tensor(out).descriptor.handle_type == handle_type
    assert out.shape == (64, 33) and out.dtype == torch.float64 and out.device.type == "cpu"
    assert torch.equal(out, _pattern(64 * 33, 5, torch.float64).view(64, 33))

    # A write by rank 2 is seen by every rank: it is the same memory.
    dist.barrier()  # everyone has checked the data
    if rank == 2:
        out[0, 0] = -42.0
    dist.barrier()
    assert float(out[0, 0]) == -42.0

    # The exporter frees its tensor and its pool once broadcast has returned everywhere.
    if rank == src:
        del source, out
        gc.collect()
        pool.empty_cache()
        pool.close()
    dist.barrier()
    if rank != src:
        expected = _pattern(64 * 33, 5, torch.float64).view(64, 33)
        expected[0, 0] = -42.0
        assert torch.equal(out, expected)


def scenario_broadcast_view(rank, handle_type):
    """A non-contiguous view keeps its strides and storage offset."""
    pool = vmm_torch.Pool("host", handle_type=handle_type)
    base = None
    if rank == 0:
        base = pool.empty((8, 16), dtype=torch.int32)
        base.copy_(torch.arange(128, dtype=torch.int32).view(8, 16))
    view = vdist.broadcast(base[2:, 3] if base is not None else None, src=0)
    assert view.shape == (6,) and view.stride() == (16,) and view.storage_offset() == 35
    assert view.tolist() == [16 * i + 3 for i in range(2, 8)]


def scenario_all_gather(rank, handle_type):
    """all_gather: every rank reads every buffer and writes into its neighbour's."""
    pool = vmm_torch.Pool("host", handle_type=handle_type)
    mine = pool.empty((100 + rank,), dtype=torch.float32)  # sizes may differ between ranks
    mine.copy_(_pattern(mine.numel(), rank))
    gathered = vdist.all_gather(mine)
    assert len(gathered) == WORLD and gathered[rank] is mine
    for r, t in enumerate(gathered):
        assert t.shape == (100 + r,)
        assert torch.equal(t, _pattern(100 + r, r)), r
    dist.barrier()  # everyone has checked the data
    gathered[(rank + 1) % WORLD][0] = 1000 + rank
    dist.barrier()
    assert float(mine[0]) == 1000 + (rank - 1) % WORLD

    # Every rank frees its own tensor; the others' copies of the mapping stay intact.
    del mine
    gathered[rank] = None
    gc.collect()
    pool.empty_cache()
    dist.barrier()
    for r, t in enumerate(gathered):
        if r != rank:
            assert float(t[0]) == 1000 + (r - 1) % WORLD
            assert torch.equal(t[1:], _pattern(100 + r, r)[1:])


def _expect_error(call, operation):
    """Runs `call`, which must raise DistributedSharingError; returns it after checking that
    every rank got the same message."""
    with pytest.raises(vdist.DistributedSharingError) as info:
        call()
    error = info.value
    assert error.operation == operation
    assert len(set(_agreed(str(error)))) == 1, "ranks disagree on the error"
    return error


def scenario_errors(rank, handle_type):
    """Failures raise the same clear error on every rank, and the group stays usable."""
    pool = vmm_torch.Pool("host", handle_type=handle_type)

    # 1. The source tensor is not in a vmm pool: export fails on rank 0, all ranks raise.
    plain = torch.zeros(4) if rank == 0 else None
    error = _expect_error(lambda: vdist.broadcast(plain, src=0), "broadcast")
    assert list(error.failures) == [0]
    assert "cannot export the tensor of rank 0" in str(error)

    # 1b. The source passed no tensor.
    error = _expect_error(lambda: vdist.broadcast(None, src=1), "broadcast")
    assert "rank 1: the tensor of rank 1 is None" in str(error)

    # 2. Rank 2 pretends to be on another machine: the fd descriptor may not go there.
    if rank == 2:
        vdist.node_identity = lambda: vdist.NodeIdentity("other-host", "0badb007-0000")
    source = pool.empty((16,), dtype=torch.int64) if rank == 0 else None
    if source is not None:
        source.copy_(torch.arange(16))
    error = _expect_error(lambda: vdist.broadcast(source, src=0), "broadcast")
    assert list(error.failures) == [2]
    text = str(error)
    assert "cannot cross nodes: rank 0 is on host" in text
    assert "rank 2 on host other-host" in text and "fabric" in text
    kind = "POSIX fd descriptors" if handle_type == "posix_fd" else "host-backend descriptors"
    assert kind in text

    # 3. all_gather with rank 2 apart: ranks 0 and 1 cannot import rank 2's buffer, rank 2
    #    cannot import theirs.
    mine = pool.empty((8,), dtype=torch.float32).fill_(rank)
    error = _expect_error(lambda: vdist.all_gather(mine), "all_gather")
    assert list(error.failures) == [0, 1, 2]
    assert len(error.failures[2]) == 2 and len(error.failures[0]) == 1
    assert "failed on ranks 0, 1 and 2" in str(error)

    # 4. Back on one machine, the same group works again.
    if rank == 2:
        vdist.node_identity = vdist._read_node_identity
    out = vdist.broadcast(source, src=0)
    assert out.tolist() == list(range(16))


# --- Tests ---------------------------------------------------------------------------------

def scenario_sharing(rank, handle_type):
    """The sharing scenarios one after the other, in one process group (fewer launches)."""
    scenario_broadcast(rank, handle_type)
    scenario_broadcast_view(rank, handle_type)
    scenario_all_gather(rank, handle_type)


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_broadcast_and_all_gather(tmp_path, handle_type):
    _run(tmp_path, scenario_sharing, handle_type)


def scenario_errors_both_types(rank, _):
    for handle_type in ("posix_fd", "fabric"):
        scenario_errors(rank, handle_type)


def test_errors_reach_every_rank(tmp_path):
    _run(tmp_path, scenario_errors_both_types)


# --- In-process checks of the node rules ---------------------------------------------------

class _FakeShared:
    def __init__(self, device_type, handle_type):
        self.device_type = device_type
        self.descriptor = type("Descriptor", (), {"handle_type": handle_type})()


A = vdist.NodeIdentity("node-a", "11111111-aaaa")
B = vdist.NodeIdentity("node-b", "22222222-bbbb")


def test_fabric_cuda_descriptors_may_cross_nodes():
    assert vdist.crossing_error(_FakeShared("cuda", "fabric"), 0, A, 1, B) is None


def test_posix_fd_and_host_descriptors_may_not_cross_nodes():
    text = vdist.crossing_error(_FakeShared("cuda", "posix_fd"), 0, A, 2, B)
    assert text.startswith("POSIX fd descriptors cannot cross nodes: rank 0 is on host node-a "
                           "(boot id 11111111), rank 2 on host node-b (boot id 22222222); "
                           "use fabric handles")
    assert "host-backend" in vdist.crossing_error(_FakeShared("cpu", "fabric"), 0, A, 1, B)
    assert vdist.crossing_error(_FakeShared("cuda", "posix_fd"), 0, A, 1, A) is None


def test_same_machine_is_decided_by_boot_id():
    container = vdist.NodeIdentity("other-name", A.boot_id)
    assert A.same_machine(container)
    assert not A.same_machine(vdist.NodeIdentity("node-a", "33333333"))
    assert A._replace(boot_id=None).same_machine(vdist.NodeIdentity("node-a", None))
    node = vdist.node_identity()
    assert node.hostname and node.same_machine(node)


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        vdist.broadcast(None)


def test_error_message_lists_every_failure():
    error = vdist.DistributedSharingError("all_gather", {2: ["b"], 0: ["a1", "a2"]})
    assert str(error) == ("vmm_torch.distributed.all_gather failed on ranks 0 and 2:\n"
                          "  rank 0: a1\n  rank 0: a2\n  rank 2: b")
    assert list(error.failures) == [0, 2]
    assert os.path.exists(vdist.BOOT_ID_PATH) == bool(vdist.node_identity().boot_id)
