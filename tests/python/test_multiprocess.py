"""Tensors of host pools shared with spawned processes (torch.multiprocessing, plain pickle)."""

import gc
import pickle

import pytest
import torch
import torch.multiprocessing as mp

import vmm_torch
import vmm_test_workers as workers

TIMEOUT = 60


@pytest.fixture(scope="module")
def ctx():
    return mp.get_context("spawn")


def _start_consumers(ctx, count):
    jobs = [ctx.Queue() for _ in range(count)]
    replies = ctx.Queue()
    procs = [ctx.Process(target=workers.consumer, args=(i, jobs[i], replies), daemon=True)
             for i in range(count)]
    for proc in procs:
        proc.start()
    return jobs, replies, procs


def _stop(jobs, replies, procs):
    for q in jobs:
        q.put(None)
    done = sorted(replies.get(timeout=TIMEOUT) for _ in procs)
    for proc in procs:
        proc.join(TIMEOUT)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)
    return done


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_queue_carries_pool_tensors_to_two_consumers(ctx, handle_type):
    vmm_torch.install_reducers()
    with vmm_torch.Pool("host", handle_type=handle_type) as pool:
        jobs, replies, procs = _start_consumers(ctx, 2)
        sent = {}
        for name, shape, dtype, shareable in (("small", (4, 8), torch.float32, True),
                                              ("wide", (64, 1024), torch.float64, True),
                                              ("ints", (16, 16), torch.int32, False)):
            t = pool.empty(shape, dtype=dtype, shareable=shareable)
            seed = len(sent) + 1
            t.copy_(workers.pattern(t.numel(), seed, dtype).view(shape))
            t[-1].zero_()
            sent[name] = t  # keep alive until every consumer has it
            for q in jobs:
                q.put((name, seed, t))
        results = [replies.get(timeout=TIMEOUT) for _ in range(2 * len(sent))]
        for name, index, ok, shape, dtype in results:
            assert ok, (name, index)
            assert shape == tuple(sent[name].shape) and dtype == str(sent[name].dtype)
        # Both consumers wrote into the producer's memory: they mapped it, not a copy.
        for name, t in sent.items():
            assert float(t[-1, 0]) == 1 and float(t[-1, 1]) == 2, name
        assert _stop(jobs, replies, procs) == [("done", 0), ("done", 1)]
        assert pool.memory_stats()["vmm.num_exports"] >= len(sent)


def test_plain_pickle_between_processes(ctx):
    with vmm_torch.Pool("host", handle_type="posix_fd") as pool:
        t = pool.empty((1000,), dtype=torch.float64)
        t.copy_(torch.arange(1000, dtype=torch.float64))
        payload = pickle.dumps(vmm_torch.export_tensor(t))
        results = ctx.Queue()
        proc = ctx.Process(target=workers.open_and_sum, args=(payload, results))
        proc.start()
        assert results.get(timeout=TIMEOUT) == float(sum(range(1000)))
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


def test_other_tensors_still_use_torch_reducers(ctx):
    vmm_torch.install_reducers()
    jobs, replies, procs = _start_consumers(ctx, 1)
    t = workers.pattern(32, 9).view(4, 8).clone()
    t[-1].zero_()
    jobs[0].put(("plain", 9, t))
    name, _, ok, shape, _ = replies.get(timeout=TIMEOUT)
    assert name == "plain" and ok and shape == (4, 8)
    _stop(jobs, replies, procs)


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_stale_descriptor_in_another_process(ctx, handle_type):
    with vmm_torch.Pool("host", handle_type=handle_type) as pool:
        t = pool.empty((1 << 20,), dtype=torch.uint8, shareable=True)
        payload = pickle.dumps(vmm_torch.export_tensor(t))
        del t
        gc.collect()
        pool.empty_cache()
        results = ctx.Queue()
        proc = ctx.Process(target=workers.try_import, args=(payload, results))
        proc.start()
        kind, message = results.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0  # a clean error, not a crash
        assert kind in ("VmmError", "ValueError"), (kind, message)
        assert "HOST-" in message


def test_parameters_travel_as_parameters(ctx):
    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        weight = torch.nn.Parameter(pool.zeros((3, 3)))
        reduced = vmm_torch.reductions.reduce_tensor(weight)
        rebuild, args = reduced
        assert rebuild is vmm_torch.reductions.rebuild_tensor
        again = rebuild(*args)
        assert isinstance(again, torch.nn.Parameter) and again.requires_grad
        assert torch.equal(again.detach(), weight.detach())
