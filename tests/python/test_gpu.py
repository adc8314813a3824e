"""GPU tests of vmm_torch (skipped where torch sees no CUDA device).

enable() runs in fresh spawned processes: PyTorch's allocator can only be swapped before CUDA
is initialised, and the pytest process uses CUDA for the explicit-pool tests.
"""

import gc
import math
import pickle
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp

import vmm_torch
import vmm_test_workers as workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TIMEOUT = 300
MIB = 1 << 20


def run_in_spawned_process(target, *args):
    """`target(results, *args)` in a fresh process: its one reply. A process that dies first
    (an uncaught error, a crash) fails the test at once with its exit status."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(results,) + args)
    proc.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            alive = proc.is_alive()  # before the get: a reply sent before dying is read
            try:
                result = results.get(timeout=1)
                break
            except queue.Empty:
                assert alive, f"{target.__name__} died with {proc.exitcode}"
                assert time.monotonic() < deadline, f"{target.__name__} gave no reply"
    finally:
        proc.join(TIMEOUT)
    assert proc.exitcode == 0, f"{target.__name__} exited with {proc.exitcode}"
    return result


def _cuda_pool(handle_type):
    try:
        return vmm_torch.Pool(0, handle_type=handle_type)
    except vmm_torch.VmmError as e:
        if handle_type == "fabric":
            pytest.skip(f"fabric handles unavailable here: {e}")
        raise


def test_enable_and_train():
    result = run_in_spawned_process(workers.gpu_enabled_worker, "auto")
    losses = result["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    stats = result["stats"]
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.peak", "active_bytes.all.current", "segment.all.current",
                "num_device_alloc", "vmm.driver_calls.create", "vmm.fragmentation"):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] > 0
    assert stats["reserved_bytes.all.peak"] >= stats["allocated_bytes.all.peak"] > 0
    assert stats["num_device_alloc"] >= 1
    assert result["in_pool"]  # the model's parameters live in vmm's pool
    # vmm's whole CUDA allocator where built, else CUDAPluggableAllocator with its hooks.
    assert (result["hooks"] == ["vmm_cuda_allocator"]) == vmm_torch.full_allocator_available()
    assert "vmm_cuda_allocator" in result["hooks"] or "set_reset_fn" in result["hooks"]
    assert result["reserved_after_empty"] <= stats["reserved_bytes.all.current"]


def test_out_of_memory_in_the_allocator_raises_and_the_process_goes_on():
    result = run_in_spawned_process(workers.gpu_out_of_memory)
    assert result["error"] is not None, "2 GiB allocated under a 1 GiB limit"
    name, text = result["error"]
    assert name == "OutOfMemoryError" and "out of memory" in text, result["error"]
    assert result["after"] == float(1 << 20)
    assert result["allocated"] >= 4 << 20


def test_pools_near_their_limit_serve_what_their_free_memory_holds():
    """The device pool, under a memory limit 1.07 times the most its workspaces hold: in
    single chunks for good (pressure_page=0) blocks that reuse part of what a freed one left
    pin chunk after chunk, and some seed runs out of memory; switched to pages past half of
    the limit (the default), none does (pool_options.h pressure_page)."""
    seeds = list(range(8))
    single = run_in_spawned_process(workers.gpu_workspaces_near_the_limit,
                                    {"memory_limit": "300M", "pressure_page": 0}, seeds)
    paged = run_in_spawned_process(workers.gpu_workspaces_near_the_limit,
                                   {"memory_limit": "300M"}, seeds)
    assert single["switches"] == 0
    assert single["failed"], "the workload strands single chunks (else it tests nothing)"
    assert paged["failed"] == [], paged
    assert paged["switches"] == 1
    assert paged["reserved_peak"] <= 300 << 20


def test_enable_after_cuda_init_is_refused():
    message = run_in_spawned_process(workers.gpu_enable_too_late)
    assert "before CUDA is used" in message


def test_enable_is_idempotent():
    message = run_in_spawned_process(workers.gpu_enable_twice)
    assert "already called" in message


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_enabled_allocator_tensor_to_spawned_consumer(handle_type):
    result = run_in_spawned_process(workers.gpu_producer, handle_type, 256)
    if isinstance(result, str):  # the producer could not enable this handle type
        pytest.skip(result)
    name, index, ok, shape, dtype = result["reply"]
    assert ok and shape == (256, 4) and dtype == "torch.float32"
    assert result["written"] == 1.0  # the consumer wrote into the producer's memory
    assert result["exitcode"] == 0


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_cuda_pool_export_and_open(handle_type):
    with _cuda_pool(handle_type) as pool:
        assert pool.device == 0 and pool.handle_type == handle_type
        t = pool.empty((1024, 256), dtype=torch.float16, shareable=True)
        assert t.is_cuda and t.device.index == 0
        t.copy_(torch.randn(1024, 256, device="cuda").half())
        shared = pickle.loads(pickle.dumps(vmm_torch.export_tensor(t[8:])))
        assert shared.device_type == "cuda"
        assert shared.descriptor.handle_type == handle_type
        opened = shared.open()
        assert opened.is_cuda and torch.equal(opened, t[8:])
        expected = t.clone()
        del t
        gc.collect()
        torch.cuda.synchronize()
        pool.empty_cache()
        assert torch.equal(opened, expected[8:])  # the importer is independent
        stats = pool.memory_stats()
        assert stats["vmm.num_exports"] >= 1


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_cuda_pool_tensor_through_torch_multiprocessing(handle_type):
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    with _cuda_pool(handle_type) as pool:
        jobs, replies = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=workers.consumer, args=(1, jobs, replies))
        proc.start()
        t = pool.empty((64, 4), shareable=True)
        t.copy_(workers.pattern(256, 5, torch.float32, "cuda").view(64, 4))
        torch.cuda.synchronize()
        jobs.put(("pool", 5, t))
        name, index, ok, shape, dtype = replies.get(timeout=TIMEOUT)
        assert ok and shape == (64, 4)
        torch.cuda.synchronize()
        assert float(t[-1, 1]) == 2.0
        jobs.put(None)
        assert replies.get(timeout=TIMEOUT) == ("done", 1)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


def test_send_steps_of_the_cuda_module():
    result = run_in_spawned_process(workers.gpu_send_steps)
    assert result["module"], "vmm's CUDA module was not built"
    assert result["alone"] == (True, True)
    assert result["waited"] == (True, False)
    assert result["export_waited"] == (True, True)
    assert result["consumer"] == "ready"
    assert result["non_leaf"] == -1 and result["non_leaf_put"] is True
    assert result["shared_chunk"]
    assert result["in_place_exported"] == (True, True, True)
    assert result["isolated_kind"]
    assert result["moved_and_exported"] == (True, True, True, 768.0, 0.0)
    assert result["received"] == [(v, v, 16 << 20) for v in (1.0, 2.0, 3.0)]
    assert result["exitcode"] == 0
