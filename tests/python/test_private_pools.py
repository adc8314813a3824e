"""The C interface's private pools and its statistics and snapshot structs through the ctypes
declarations (vmm_torch._signatures), on the host backend: the calls a C++ allocator adapter
makes for CUDA graph pools, MemPools, memory_stats() and memory_snapshot()."""

import ctypes
import json

import pytest

from vmm_torch import _lib, _signatures

MIB = 1 << 20
NEW_FUNCTIONS = (
    "vmm_device_torch_stats", "vmm_pool_torch_stats", "vmm_snapshot_get",
    "vmm_snapshot_entries_release", "vmm_private_pool_use", "vmm_private_pool_release",
    "vmm_private_pool_use_count", "vmm_private_pool_find", "vmm_pool_live_blocks",
    "vmm_pool_alloc_at",
)


@pytest.fixture(scope="module", autouse=True)
def host_is_the_default_backend():
    """Device 0's pools on the host backend for this module's tests only (vmm reads
    VMM_BACKEND at each call). Set for the whole test process, it would reach every later test
    and the processes they spawn, and on a GPU machine turn their CUDA pools into host ones."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VMM_BACKEND", "host")
        yield


@pytest.fixture(scope="module")
def vmm():
    return _lib.vmm()


def _json(vmm, pointer):
    assert pointer, _lib.last_error()
    try:
        return json.loads(ctypes.string_at(pointer).decode())
    finally:
        vmm.vmm_release_buffer(pointer)


def _pool_stats(vmm, pool):
    stats = _signatures.TorchStats()
    assert vmm.vmm_pool_torch_stats(pool, ctypes.byref(stats)) == 0, _lib.last_error()
    return stats


def test_the_functions_are_declared_and_exported(vmm):
    for name in NEW_FUNCTIONS:
        assert name in _signatures.SIGNATURES, name
        function = getattr(vmm, name)
        assert function.argtypes == _signatures.SIGNATURES[name][1], name


def test_a_private_pool_through_ctypes(vmm):
    host = _signatures.BACKEND_HOST
    pool = vmm.vmm_private_pool_use(host, 0, 42, 1, None)
    assert pool > 0, _lib.last_error()
    assert vmm.vmm_private_pool_use(host, 0, 42, 1, b"") == pool
    assert vmm.vmm_private_pool_use_count(0, 42, 1) == 2
    assert vmm.vmm_private_pool_find(0, 42, 1) == pool
    a = vmm.vmm_pool_alloc(pool, 4 * MIB, None, 0)
    b = vmm.vmm_pool_alloc(pool, 4 * MIB, None, 0)
    assert a and b, _lib.last_error()

    entries = (_signatures.BlockEntry * 4)()
    assert vmm.vmm_pool_live_blocks(pool, entries, 4) == 2
    assert [e.address for e in entries[:2]] == sorted([a, b])
    assert all(e.state == _signatures.BLOCK_ACTIVE_ALLOCATED for e in entries[:2])
    assert vmm.vmm_pool_live_blocks(pool, None, 0) == 2

    stats = _pool_stats(vmm, pool)
    torch_keys = _json(vmm, vmm.vmm_pool_stats_json(pool))["torch"]
    for name in _signatures.TORCH_STAT_NAMES:
        stat = getattr(stats, name)[_signatures.STAT_ALL]
        assert stat.current == torch_keys[f"{name}.all.current"], name
        assert stat.peak == torch_keys[f"{name}.all.peak"], name
    for name in _signatures.TORCH_COUNTER_NAMES:
        assert getattr(stats, name) == torch_keys[name], name
    assert stats.allocated_bytes[_signatures.STAT_ALL].current == 8 * MIB
    assert stats.max_split_size == -1

    device = _signatures.TorchStats()
    assert vmm.vmm_device_torch_stats(0, ctypes.byref(device)) == 0
    assert device.allocated_bytes[_signatures.STAT_ALL].current >= 8 * MIB

    # A freed block's range, taken back exactly; a misaligned one refused.
    vmm.vmm_block_free(a)
    assert vmm.vmm_pool_alloc_at(pool, a, 4 * MIB, None) == a, _lib.last_error()
    assert vmm.vmm_pool_alloc_at(pool, a + 1, 4 * MIB, None) is None
    assert _lib.last_error_code() == _signatures.INVALID_ARGUMENT
    assert vmm.vmm_pool_alloc_at(pool, b, 4 * MIB, None) is None
    assert _lib.last_error_code() == _signatures.FAILED_PRECONDITION

    snapshot = ctypes.POINTER(_signatures.SnapshotEntries)()
    assert vmm.vmm_snapshot_get(ctypes.byref(snapshot)) == 0, _lib.last_error()
    try:
        mine = [snapshot.contents.segments[i]
                for i in range(snapshot.contents.num_segments)
                if snapshot.contents.segments[i].pool == pool]
        allocated = sorted(
            s.blocks[k].address for s in mine for k in range(s.num_blocks)
            if s.blocks[k].state == _signatures.BLOCK_ACTIVE_ALLOCATED)
        assert allocated == sorted([a, b])
        assert all(s.is_large == 1 for s in mine)
    finally:
        vmm.vmm_snapshot_entries_release(snapshot)

    vmm.vmm_block_free(a)
    vmm.vmm_block_free(b)
    assert vmm.vmm_private_pool_release(0, 42, 1) == 1
    assert vmm.vmm_private_pool_release(0, 42, 1) == 0
    assert vmm.vmm_private_pool_use_count(0, 42, 1) == 0
    assert vmm.vmm_private_pool_find(0, 42, 1) == -1
    assert _lib.last_error_code() == _signatures.NOT_FOUND
    assert vmm.vmm_private_pool_release(0, 42, 1) == -1


def _device_stats(vmm):
    stats = _signatures.TorchStats()
    assert vmm.vmm_device_torch_stats(0, ctypes.byref(stats)) == 0, _lib.last_error()
    return stats


def test_the_devices_peaks_are_what_its_pools_held_together(vmm):
    """max_memory_allocated / max_memory_reserved with a MemPool: PyTorch keeps one peak over
    all the pools of a device, so 64 MiB freed in the default pool and then 128 MiB taken in a
    private pool peak at 128 MiB more, not 192 (the sum of the two pools' own peaks), and stay
    there once the private pool is gone."""
    assert vmm.vmm_empty_cache(0) == 0, _lib.last_error()
    assert vmm.vmm_reset_peak_stats(0) == 0
    before = _device_stats(vmm)
    base = before.allocated_bytes[_signatures.STAT_ALL].current
    assert before.allocated_bytes[_signatures.STAT_ALL].peak == base

    a = vmm.vmm_alloc(64 * MIB, 0, None)
    assert a, _lib.last_error()
    assert vmm.vmm_free(a, 0) == 0
    assert vmm.vmm_empty_cache(0) == 0, _lib.last_error()  # a's 64 MiB go back
    pool = vmm.vmm_private_pool_use(_signatures.BACKEND_HOST, 0, 77, 3, None)
    assert pool > 0, _lib.last_error()
    b = vmm.vmm_pool_alloc(pool, 128 * MIB, None, 0)
    assert b, _lib.last_error()
    try:
        stats = _device_stats(vmm)
        allocated = stats.allocated_bytes[_signatures.STAT_ALL]
        assert allocated.current == base + 128 * MIB
        assert allocated.peak == base + 128 * MIB  # the sum of the pools' peaks: + 192 MiB
        assert allocated.allocated - before.allocated_bytes[_signatures.STAT_ALL].allocated \
            == 192 * MIB
        # Reserved: a's 64 MiB went back before the private pool grew by 128 MiB, so the
        # GPU's peak is now, below the sum of the pools' peaks (64 + 128 MiB more).
        reserved = stats.reserved_bytes[_signatures.STAT_ALL]
        before_reserved = before.reserved_bytes[_signatures.STAT_ALL].current
        assert reserved.peak == reserved.current >= before_reserved + 128 * MIB
        assert reserved.peak < before_reserved + 192 * MIB
        # The JSON document (memory_stats()'s keys) says the same.
        torch_keys = _json(vmm, vmm.vmm_stats_json(0))["torch"]
        assert torch_keys["allocated_bytes.all.peak"] == allocated.peak
        # Parts peak no higher than the whole: an arena's share, the bytes requested.
        large = _signatures.STAT_LARGE
        assert stats.allocated_bytes[large].peak <= allocated.peak
        assert stats.requested_bytes[_signatures.STAT_ALL].peak <= allocated.peak
        assert stats.reserved_bytes[large].peak <= reserved.peak

        # Emptied, the default pool gives its cache back; the private pool's block stays.
        assert vmm.vmm_empty_cache(0) == 0, _lib.last_error()
        assert vmm.vmm_reset_peak_stats(0) == 0
        after = _device_stats(vmm)
        assert after.allocated_bytes[_signatures.STAT_ALL].peak == base + 128 * MIB
        assert after.reserved_bytes[_signatures.STAT_ALL].peak == \
            after.reserved_bytes[_signatures.STAT_ALL].current
    finally:
        vmm.vmm_block_free(b)
        assert vmm.vmm_private_pool_release(0, 77, 3) == 0
    # The private pool is gone with its block; the GPU's peak is not (PyTorch's never falls
    # but at a reset).
    assert vmm.vmm_private_pool_find(0, 77, 3) == -1
    gone = _device_stats(vmm)
    assert gone.allocated_bytes[_signatures.STAT_ALL].peak == base + 128 * MIB
    assert gone.allocated_bytes[_signatures.STAT_ALL].current == base
    # Nor are its totals: what it allocated stays counted, and freed.
    whole = _signatures.STAT_ALL
    assert gone.allocated_bytes[whole].allocated - before.allocated_bytes[whole].allocated \
        == 192 * MIB
    assert gone.allocated_bytes[whole].freed - before.allocated_bytes[whole].freed == 192 * MIB
    assert gone.allocation[whole].allocated - before.allocation[whole].allocated == 2
    assert gone.segment[whole].freed >= gone.segment[whole].allocated - \
        gone.segment[whole].current
    assert vmm.vmm_reset_accumulated_stats(0) == 0
    cleared = _device_stats(vmm)
    assert cleared.allocated_bytes[whole].allocated == 0
    assert cleared.allocation[whole].freed == 0
    assert vmm.vmm_reset_peak_stats(0) == 0
    assert _device_stats(vmm).allocated_bytes[_signatures.STAT_ALL].peak == base
