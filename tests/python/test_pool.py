"""vmm_torch.Pool on the host backend: tensors, stats, options, errors; device-pool stats."""

import gc

import pytest
import torch

import vmm_torch

MIB = 1 << 20


@pytest.fixture
def pool():
    with vmm_torch.Pool("host", handle_type="posix_fd") as p:
        yield p


def test_pool_attributes(pool):
    assert pool.device == "host"
    assert pool.handle_type == "posix_fd"
    assert not pool.closed
    assert "host" in repr(pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.uint8,
                                   torch.bfloat16, torch.bool, torch.complex64])
def test_empty_is_a_cpu_tensor_in_the_pool(pool, dtype):
    t = pool.empty((3, 4, 5), dtype=dtype)
    assert t.device.type == "cpu"
    assert t.dtype == dtype
    assert t.shape == (3, 4, 5)
    assert t.stride() == (20, 5, 1)
    assert t.is_contiguous()
    assert vmm_torch.in_vmm_pool(t)


def test_write_and_read(pool):
    t = pool.empty((1000,), dtype=torch.float32)
    t.copy_(torch.arange(1000, dtype=torch.float32))
    assert torch.equal(t * 2, torch.arange(1000, dtype=torch.float32) * 2)
    z = pool.zeros((7, 7), dtype=torch.int32)
    assert int(z.sum()) == 0
    z += 3
    assert int(z.sum()) == 147


def test_shapes(pool):
    assert pool.empty(5).shape == (5,)
    assert pool.empty(()).shape == ()
    assert pool.empty((0, 3)).numel() == 0
    assert pool.empty(torch.Size([2, 3])).shape == (2, 3)
    assert pool.empty((torch.tensor(3), 2)).shape == (3, 2)  # ints by __index__, as torch
    with pytest.raises(ValueError):
        pool.empty((-1, 3))
    with pytest.raises(TypeError):
        pool.empty((2.5,))


# Extents that are not ints are TypeErrors, as in PyTorch.
NOT_INT_SHAPES = [(2.5,), (True,), (None,), ("3",), None, "abc", 2.5, (1, [2])]


@pytest.mark.parametrize("shape", NOT_INT_SHAPES, ids=repr)
def test_shapes_that_are_not_ints_are_type_errors(pool, shape):
    with pytest.raises(TypeError):
        torch.empty(shape)  # PyTorch's kind of error for the same shape
    with pytest.raises(TypeError, match="shape"):
        pool.empty(shape)


# Shapes whose byte size (or a stride) overflows 64 bits: ValueError, never a wrapped size
# reaching the library nor torch's "Expected int ... found int".
OVERFLOWING_SHAPES = [(2**62, 2**62), (10**30,), (2**64,), (2**63,), (2**61,), (2**32, 2**31),
                      (0, 2**40, 2**40), (2**63 - 1, 2), (0, 2**64)]


@pytest.mark.parametrize("shape", OVERFLOWING_SHAPES, ids=repr)
def test_shapes_whose_size_overflows_are_value_errors(pool, shape):
    before = pool.memory_stats()["num_ooms"]
    with pytest.raises(ValueError, match=r"shape .*(bits|more than 2\*\*63 - 1)"):
        pool.empty(shape)
    assert pool.memory_stats()["num_ooms"] == before  # refused before the library


@pytest.mark.parametrize("shape,dtype", [((-1, 3), torch.float32), ((3, -2), torch.uint8),
                                         ((-(2**70),), torch.uint8)], ids=repr)
def test_negative_extents_are_value_errors(pool, shape, dtype):
    with pytest.raises(ValueError, match="non-negative"):
        pool.empty(shape, dtype=dtype)


def test_representable_but_too_large_for_any_device_is_a_value_error(pool):
    # 2**62 bytes fit in 64 bits but no device holds them: a bad request, not out of memory.
    with pytest.raises(ValueError, match="more than any device holds"):
        pool.empty((2**60,), dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        pool.empty((4,), dtype="float32")


def test_more_than_the_pool_may_hold_is_out_of_memory():
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    with vmm_torch.Pool("host", memory_limit="8M") as small:
        with pytest.raises(oom, match="out of memory"):
            small.empty((64 * MIB,), dtype=torch.uint8)
        assert vmm_torch.in_vmm_pool(small.empty((MIB,), dtype=torch.uint8))


def test_tensor_frees_its_block(pool):
    before = pool.memory_stats()["allocated_bytes.all.current"]
    t = pool.empty((MIB,), dtype=torch.uint8)
    assert pool.memory_stats()["allocated_bytes.all.current"] >= before + MIB
    view = t[10:]
    del t
    gc.collect()
    assert pool.memory_stats()["allocated_bytes.all.current"] >= before + MIB  # the view
    del view
    gc.collect()
    assert pool.memory_stats()["allocated_bytes.all.current"] == before


def test_memory_stats_keys(pool):
    t = pool.empty((3 * MIB,), dtype=torch.uint8)
    stats = pool.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "reserved_bytes.all.peak",
                "active_bytes.all.current", "requested_bytes.all.current",
                "allocation.all.current", "segment.all.current", "num_device_alloc",
                "num_device_free", "num_alloc_retries", "num_ooms",
                "vmm.driver_calls.create", "vmm.driver_calls.map", "vmm.fragmentation",
                "vmm.largest_free_block", "vmm.exported_bytes.current"):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] >= 3 * MIB
    assert stats["requested_bytes.all.current"] == 3 * MIB
    assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
    assert stats["num_device_alloc"] >= 1
    assert all(isinstance(v, (int, float)) for v in stats.values())
    del t


def test_empty_cache_returns_memory(pool):
    t = pool.empty((8 * MIB,), dtype=torch.uint8)
    del t
    gc.collect()
    assert pool.memory_stats()["reserved_bytes.all.current"] > 0
    pool.empty_cache()
    stats = pool.memory_stats()
    assert stats["reserved_bytes.all.current"] == 0
    assert stats["num_device_free"] >= 1


def _chunks_of(address):
    """vmm's snapshot entries of the chunks holding `address`."""
    found = []
    for pool in vmm_torch.memory_snapshot()["vmm_pools"]:
        for seg in pool["segments"]:
            for chunk in seg["chunks"]:
                if chunk["address"] <= address < chunk["address"] + chunk["size"]:
                    found.append(chunk)
    return found


def test_shareable_blocks_get_chunks_of_their_own(pool):
    a = pool.empty((100,), shareable=True)
    b = pool.empty((100,), shareable=True)
    plain = pool.empty((100,))
    (chunk_a,), (chunk_b,), (chunk_plain,) = (_chunks_of(t.data_ptr()) for t in (a, b, plain))
    assert chunk_a["dedicated"] and chunk_b["dedicated"] and not chunk_plain["dedicated"]
    assert chunk_a["address"] != chunk_b["address"]
    vmm_torch.export_tensor(a)
    assert _chunks_of(a.data_ptr())[0]["exported"]


def test_close_keeps_tensors_valid():
    p = vmm_torch.Pool("host")
    t = p.empty((1000,))
    t.fill_(2.0)
    p.close()
    p.close()  # idempotent
    assert p.closed
    assert float(t.sum()) == 2000.0
    with pytest.raises(ValueError, match="closed"):
        p.empty((3,))
    with pytest.raises(ValueError, match="closed"):
        p.memory_stats()
    del t


def test_options_are_passed_and_checked():
    with vmm_torch.Pool("host", handle_type="none", small_size="64K", memory_limit=64 * MIB,
                        growth_fraction=0.25) as p:
        assert p.handle_type == "none"
        p.empty((10,))
    with pytest.raises(ValueError, match="unknown option 'no_such_option'"):
        vmm_torch.Pool("host", no_such_option=1)
    with pytest.raises(ValueError, match="handle_type"):
        vmm_torch.Pool("host", handle_type="carrier-pigeon")
    with pytest.raises(ValueError, match="memory_limit"):
        vmm_torch.Pool("host", memory_limit="lots")
    with pytest.raises(ValueError, match="bool"):
        vmm_torch.Pool("host", memory_limit=True)


@pytest.mark.parametrize("bad", ["tpu", -1, 1.5, 0.0, "cuda:x", True, False, "cuda:-1",
                                 "host:99", "host:0", "cuda:1:2", "", None, 2**31, [0],
                                 torch.device("meta"), torch.device("cpu", 1), "cpu:3",
                                 b"cuda", "cuda:99999999999", "meta"])
def test_bad_devices_are_value_errors(bad):
    # Checked in Python before any library call.
    with pytest.raises(ValueError, match="device"):
        vmm_torch.Pool(bad)


def test_device_spellings():
    from vmm_torch.pool import pool_device

    assert pool_device("host") == pool_device(" HOST ") == pool_device("cpu") == ("host", 2, 0)
    assert pool_device(torch.device("cpu")) == ("host", 2, 0)
    assert pool_device(3) == pool_device("cuda:3") == pool_device(torch.device("cuda", 3)) \
        == (3, 1, 3)
    assert pool_device("cuda") == pool_device(torch.device("cuda")) == (0, 1, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_pool_without_a_gpu_is_a_clean_error():
    with pytest.raises(vmm_torch.VmmError, match="CUDA"):
        vmm_torch.Pool(0)


def test_out_of_memory_is_a_clean_error():
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    with vmm_torch.Pool("host", memory_limit="4M") as p:
        keep = p.empty((2 * MIB,), dtype=torch.uint8)
        with pytest.raises(oom, match="out of memory"):
            p.empty((8 * MIB,), dtype=torch.uint8)
        # The pool stays usable.
        again = p.empty((MIB,), dtype=torch.uint8)
        again.fill_(1)
        assert p.memory_stats()["num_ooms"] >= 1
        del keep, again


def test_device_pool_stats_and_helpers():
    stats = vmm_torch.memory_stats()
    assert "allocated_bytes.all.current" in stats and "vmm.fragmentation" in stats
    assert vmm_torch.memory_stats(0) == stats or stats.keys() == vmm_torch.memory_stats(0).keys()
    assert vmm_torch.memory_allocated(0) >= 0
    assert vmm_torch.memory_reserved("cuda:0") >= 0
    vmm_torch.reset_peak_memory_stats()
    vmm_torch.reset_accumulated_memory_stats(0)
    vmm_torch.empty_cache()
    with pytest.raises(ValueError):
        vmm_torch.memory_stats("cpu")
    with pytest.raises(ValueError):
        vmm_torch.memory_stats(-3)


@pytest.mark.parametrize("fraction", [-0.5, 1.5, float("nan"), float("inf"), 10**400])
def test_memory_fractions_outside_zero_to_one_are_value_errors(fraction):
    with pytest.raises(ValueError, match="fraction"):  # was: OverflowError for 10**400
        vmm_torch.set_per_process_memory_fraction(fraction)


def test_a_memory_fraction_of_zero_is_taken():
    # As PyTorch takes it (torch.cuda.set_per_process_memory_fraction's range is [0, 1]); what
    # it does to the device pool: c_api_test's AMemoryFractionOfZeroLetsOnlyCachedMemoryServe.
    try:
        vmm_torch.set_per_process_memory_fraction(0)
        vmm_torch.set_per_process_memory_fraction(0.0)
    finally:
        vmm_torch.set_per_process_memory_fraction(1.0)


def test_snapshot_structure():
    with vmm_torch.Pool("host") as p:
        t = p.empty((MIB,), dtype=torch.uint8)
        snap = vmm_torch.memory_snapshot()
        assert {"segments", "device_traces", "vmm_pools"} <= snap.keys()
        seg = next(s for s in snap["segments"]
                   if s["address"] <= t.data_ptr() < s["address"] + s["total_size"])
        for key in ("device", "address", "total_size", "allocated_size", "active_size",
                    "requested_size", "stream", "segment_type", "blocks"):
            assert key in seg, key
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        block = next(b for b in seg["blocks"] if b["address"] == t.data_ptr())
        assert block["state"] == "active_allocated" and block["requested_size"] == MIB
        del t
