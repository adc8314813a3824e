"""Tensors of host pools shared with spawned processes (torch.multiprocessing, plain pickle)."""

import gc
import pickle
import queue
import subprocess
import sys
import textwrap

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
        assert rebuild is vmm_torch.reductions.rebuild_tensor_from_bytes
        again = rebuild(*args)
        assert isinstance(again, torch.nn.Parameter) and again.requires_grad
        assert torch.equal(again.detach(), weight.detach())


class _Reduced:
    """Pickles as the given (rebuild, args) pair: a payload as a hostile sender would make."""

    def __init__(self, rebuild, args):
        self.reduced = (rebuild, args)

    def __reduce__(self):
        return self.reduced


@pytest.mark.parametrize("handle_type", ["posix_fd", "fabric"])
def test_compact_payload_in_a_spawned_process(ctx, handle_type):
    """Views, parameters and requires_grad arrive as sent; truncated or garbled payloads give
    the receiver a clean error, and it goes on receiving."""
    vmm_torch.install_reducers()
    rebuild = vmm_torch.reductions.rebuild_tensor_from_bytes
    with vmm_torch.Pool("host", handle_type=handle_type) as pool:
        t = pool.empty((6, 8), dtype=torch.float64, shareable=True)
        t.copy_(torch.arange(48, dtype=torch.float64).view(6, 8))
        view = t[2:, 1::2]
        weight = torch.nn.Parameter(pool.empty((4,)).fill_(0.5))
        leaf = pool.zeros((3,)).requires_grad_()
        assert all(vmm_torch.in_vmm_pool(x) for x in (view, weight, leaf))
        args = list(vmm_torch.reductions.reduce_tensor(t)[1])
        truncated = list(args)
        truncated[0] = args[0][: len(args[0]) - 9]
        garbled = list(args)
        garbled[0] = bytes(b ^ 0x5A for b in args[0])
        bad_dtype = list(args)
        bad_dtype[1] = 1000
        too_big = list(args)
        too_big[2] = (7, 8)
        jobs, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=workers.describe_received, args=(jobs, results), daemon=True)
        proc.start()
        for item in (view, weight, leaf) + tuple(
                _Reduced(rebuild, tuple(a)) for a in (truncated, garbled, bad_dtype, too_big)):
            jobs.put(item)
        jobs.put(t)  # still fine after the errors
        jobs.put(None)
        replies = []
        try:
            for _ in range(9):
                replies.append(results.get(timeout=TIMEOUT))
        except queue.Empty:
            pytest.fail(f"the receiver stopped answering after {replies} "
                        f"(alive: {proc.is_alive()}, exit code: {proc.exitcode})")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        assert replies[0] == ("tensor", "Tensor", (4, 4), (8, 2), 17, "torch.float64", False,
                              float(view.sum()))
        assert replies[1] == ("tensor", "Parameter", (4,), (1,), 0, "torch.float32", True, 2.0)
        assert replies[2] == ("tensor", "Tensor", (3,), (1,), 0, "torch.float32", True, 0.0)
        assert replies[3][:2] == ("error", "ValueError") and "descriptor is" in replies[3][2]
        assert replies[4][:2] == ("error", "ValueError") and "magic" in replies[4][2]
        assert replies[5][:2] == ("error", "ValueError") and "dtype" in replies[5][2]
        assert replies[6][:2] == ("error", "ValueError") and "needs" in replies[6][2]
        assert replies[7] == ("tensor", "Tensor", (6, 8), (8, 1), 0, "torch.float64", False,
                              float(sum(range(48))))
        assert replies[8] == ("done",)


def test_storages_and_share_memory_keep_receivers_on_the_senders_memory(ctx):
    """A storage of vmm memory travels as a vmm send, like a tensor (PyTorch's reducer would
    copy it into new shared memory), and share_memory_() on a received tensor leaves it where
    it is (PyTorch's: a no-op for shared memory): the receiver's writes reach the sender."""
    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        tensors = [pool.zeros((4,)) for _ in range(3)]
        untyped = (tensors[1].untyped_storage() if hasattr(torch.Tensor, "untyped_storage")
                   else tensors[1].storage().untyped())
        items = [("share_memory_", tensors[0]), ("storage", untyped),
                 ("storage", tensors[2].storage())]  # a TypedStorage in this torch
        q, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=workers.write_into_received, args=(q, results), daemon=True)
        proc.start()
        kinds = []
        for item in items:
            q.put(item)
            kinds.append(results.get(timeout=TIMEOUT)[1])
        q.put(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        assert kinds[1] == "UntypedStorage" and kinds[2] == type(items[2][1]).__name__
        assert tensors[0].tolist() == [1.0] * 4
        assert tensors[1].tolist() == [0.0, 100.0, 0.0, 0.0]
        assert tensors[2].tolist() == [0.0, 100.0, 0.0, 0.0]
        assert all(vmm_torch.in_vmm_pool(t) for t in tensors)


def test_a_receiver_prints_nothing_at_exit(tmp_path):
    """A process that received a vmm tensor exits without a word (torch 1.13 warned "Failed
    to initialize NumPy" when the receiver's storage cache was torn down with the
    interpreter)."""
    script = tmp_path / "receiver_exit.py"
    script.write_text(textwrap.dedent("""
        import torch.multiprocessing as mp
        import vmm_torch

        vmm_torch.install_reducers()


        def child(q):
            print("child got", float(q.get(timeout=60).sum()), flush=True)


        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            pool = vmm_torch.Pool("host")
            q.put(pool.empty((10,)).fill_(1))
            p.join(60)
            assert p.exitcode == 0
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "child got 10.0\n"
    assert done.stderr == ""
