"""Sends through torch.multiprocessing on the host backend: in place or moved (isolate_sends),
what the receiver sees (writes after put, shared storages, tensors made while pickling),
VMM_TORCH_ENABLE's hook, forked senders, errors carried to the receiver."""

import importlib.util
import os
import shutil
import subprocess
import sys
import pickle
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

import vmm_torch
import vmm_test_workers as workers
from vmm_torch import reductions, sharing

TIMEOUT = 60


class Slotted:
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x


class Dropping:
    def __init__(self, kept, dropped):
        self.kept, self.dropped = kept, dropped

    def __getstate__(self):
        return {"kept": self.kept}


@pytest.mark.parametrize("isolate", [False, True])
def test_writes_after_put_reach_the_receiver(isolate):
    """A tensor that shares its chunk is sent where it lies (its address kept) or, where its
    pool isolates sends, moved by Queue.put in the caller: either way writes the owner makes
    after put land in the memory the receiver maps (none is lost to a move made later)."""
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    with vmm_torch.Pool("host", isolate_sends=isolate) as pool:
        t = pool.zeros((256,))
        neighbour = pool.zeros((256,))  # same chunk as t
        before = t.data_ptr()
        q, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=workers.read_after_done, args=(q, results), daemon=True)
        proc.start()
        q.put(t)
        assert (t.data_ptr() != before) == isolate, "moved only where sends are isolated"
        for _ in range(300):
            t.add_(1)
        q.put("done")
        assert results.get(timeout=TIMEOUT) == [300.0] * 256
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        del neighbour


def test_tensors_that_share_a_storage_arrive_sharing_one():
    """Tied weights (two views of one storage) and a slice travel in one message; the
    receiver gets one storage for the tied pair (as PyTorch's receivers do), a separate one
    for a tensor of its own, and the right values; nothing moved in the sender."""
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    with vmm_torch.Pool("host") as pool:
        weight = pool.empty((4, 8))
        weight.copy_(torch.arange(32.0).view(4, 8))
        other = pool.zeros((8,))
        before = weight.data_ptr()
        q, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=workers.storages_of_received, args=(q, results), daemon=True)
        proc.start()
        q.put({"emb": weight.detach(), "head": weight.detach(), "row": weight[2],
               "other": other})
        shared, values = results.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        assert weight.data_ptr() == before
        assert shared[("emb", "head")] and shared[("emb", "row")]
        assert not shared[("emb", "other")]
        assert values["head"] == weight.tolist() and values["row"] == weight[2].tolist()


class DerivedInPool:
    """Pickles as a new tensor of `pool` made while pickling (in a queue's feeder thread, after
    put: the dry run of Queue.put makes and drops another), twice `base`."""

    def __init__(self, pool, base):
        self.pool, self.base = pool, base

    def __reduce__(self):
        derived = self.pool.empty(tuple(self.base.shape)).copy_(self.base * 2)
        return (torch.Tensor.detach, (derived,))


def test_a_tensor_made_while_pickling_is_sent():
    """__reduce__ returning a new vmm tensor (as ``__getstate__`` returning ``w.half()``):
    Queue.put never prepared it; the feeder thread sends it in place and the receiver gets
    its values (isolating sends, it would arrive as an error: it would have to move there)."""
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    with vmm_torch.Pool("host") as pool:
        base = pool.zeros((64,)).fill_(3)
        neighbour = pool.zeros((64,))
        q, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=workers.read_after_done, args=(q, results), daemon=True)
        proc.start()
        q.put(DerivedInPool(pool, base))
        q.put("done")
        assert results.get(timeout=TIMEOUT) == [6.0] * 64
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        del neighbour


def received_here(data, held):
    """Unpickles a message of one tensor in this process (its receiver) and returns the
    tensor's values once this process's sends are back to `held` (the import acknowledged)."""
    received = pickle.loads(data)
    sharing.flush_acks(10)
    deadline = time.monotonic() + 10
    while vmm_torch.send_stats()["held"] > held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert vmm_torch.send_stats()["held"] == held
    return received[0].tolist()


def test_a_message_that_fails_to_pickle_withdraws_its_sends():
    """A tensor sent beside an object that cannot be pickled: ForkingPickler.dumps raises, the
    payload goes nowhere, and the send's hold ends at once instead of at its lease; a message
    that pickles keeps its hold until its receiver (here this process) imports it."""
    from multiprocessing.reduction import ForkingPickler

    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((256,)).fill_(2)
        held = vmm_torch.send_stats()["held"]
        with pytest.raises(TypeError):
            ForkingPickler.dumps([t, threading.Lock()])
        assert vmm_torch.send_stats()["held"] == held
        with pytest.raises(TypeError):  # inside a pickled container, nested in another
            ForkingPickler.dumps({"outer": [t, {"inner": (t, threading.Lock())}]})
        assert vmm_torch.send_stats()["held"] == held
        data = ForkingPickler.dumps([t])
        assert vmm_torch.send_stats()["held"] == held + 1
        assert received_here(data, held) == [2.0] * 256


class SendsOnItsOwn:
    """Pickling it sends `tensor` in a message of its own (a reducer that sends something
    itself), then pickles as nothing."""

    def __init__(self, tensor, out):
        self.tensor, self.out = tensor, out

    def __reduce__(self):
        from multiprocessing.reduction import ForkingPickler

        self.out.append(bytes(ForkingPickler.dumps([self.tensor])))
        return (int, ())


def test_a_message_pickled_inside_a_failing_one_keeps_its_send():
    """Its payload may have left (here: it is kept and received later), so only the outer
    message's own sends are withdrawn."""
    from multiprocessing.reduction import ForkingPickler

    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        own, inner = pool.zeros((64,)).fill_(1), pool.zeros((64,)).fill_(7)
        held = vmm_torch.send_stats()["held"]
        sent = []
        with pytest.raises(TypeError):
            ForkingPickler.dumps([own, SendsOnItsOwn(inner, sent), threading.Lock()])
        assert len(sent) == 1
        assert vmm_torch.send_stats()["held"] == held + 1, "the inner message's send is held"
        assert received_here(sent[0], held) == [7.0] * 64


class ReducedByTorch:
    """An object whose own reducer calls torch.multiprocessing's reduce_tensor (vmm's)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce__(self):
        from torch.multiprocessing import reductions as torch_reductions

        return torch_reductions.reduce_tensor(self.tensor)


def test_queue_puts_dry_run_leaves_no_send_behind():
    """Queue.put's dry run pickles to nowhere; a send an object's own reducer makes there is
    withdrawn (it held the memory until the lease, and the sender's exit waited for it)."""
    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((64,))
        held = vmm_torch.send_stats()["held"]
        assert reductions.prepare_send({"kept": ReducedByTorch(t)}) is True  # vmm memory
        assert vmm_torch.send_stats()["held"] == held


def test_queue_puts_dry_run_withdraws_the_sends_of_messages_pickled_inside_it():
    """An object whose reducer pickles a message of its own (SendsOnItsOwn): in the dry run
    that message goes nowhere too, and its send is withdrawn; each put would otherwise leave
    one send held until its lease."""
    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((64,))
        held = vmm_torch.send_stats()["held"]
        sent = []
        assert reductions.prepare_send({"inner": SendsOnItsOwn(t, sent)}) is True
        assert len(sent) == 1, "the reducer ran in the dry run"
        assert vmm_torch.send_stats()["held"] == held


class DumpsToFile:
    """Pickling it pickles `tensor` into a file of its own (whose bytes may have left), then
    pickles as nothing."""

    def __init__(self, tensor, file):
        self.tensor, self.file = tensor, file

    def __reduce__(self):
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler(self.file, pickle.HIGHEST_PROTOCOL).dump([self.tensor])
        return (int, ())


def test_a_dump_into_a_file_inside_a_dry_run_keeps_its_send(tmp_path):
    """A send written into a file may have left: not even the dry run it is nested in
    withdraws it."""
    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((64,)).fill_(4)
        held = vmm_torch.send_stats()["held"]
        with open(tmp_path / "message", "wb") as file:
            reductions.prepare_send({"inner": DumpsToFile(t, file)})
        assert vmm_torch.send_stats()["held"] == held + 1, "the file's send is held"
        data = (tmp_path / "message").read_bytes()
        assert received_here(data, held) == [4.0] * 64


def test_torch_connections_withdraw_the_sends_of_a_message_that_fails_to_pickle():
    """torch.multiprocessing's connections (its Queue's and Pool's) pickle with
    ForkingPickler(buffer).dump, not ForkingPickler.dumps: the same withdrawal there."""
    import multiprocessing

    from torch.multiprocessing.queue import ConnectionWrapper

    vmm_torch.install_reducers()
    reader, writer = multiprocessing.Pipe(duplex=False)
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((64,)).fill_(5)
        held = vmm_torch.send_stats()["held"]
        with pytest.raises(TypeError):
            ConnectionWrapper(writer).send((t, threading.Lock()))
        assert vmm_torch.send_stats()["held"] == held
        ConnectionWrapper(writer).send([t])
        assert vmm_torch.send_stats()["held"] == held + 1, "a message that pickles keeps it"
        assert received_here(reader.recv_bytes(), held) == [5.0] * 64
    reader.close()
    writer.close()


def test_sends_after_an_error_payload_are_withdrawn():
    """In a queue's feeder thread a tensor that cannot go becomes an error payload, where the
    receiver's unpickling stops: the sends after it in that message are withdrawn, those
    before it stay for the receiver."""
    from multiprocessing.reduction import ForkingPickler

    vmm_torch.install_reducers()
    with vmm_torch.Pool("host", isolate_sends=True) as isolating, \
            vmm_torch.Pool("host") as plain:
        bad = isolating.zeros((16,))
        neighbour = isolating.zeros((16,))  # shares bad's chunk: bad would have to move
        first, last = plain.zeros((16,)).fill_(1), plain.zeros((16,)).fill_(3)
        held = vmm_torch.send_stats()["held"]
        out = {}
        thread = threading.Thread(
            target=lambda: out.update(data=ForkingPickler.dumps([first, bad, last])),
            name=reductions._FEEDER_THREAD)
        thread.start()
        thread.join()
        assert vmm_torch.send_stats()["held"] == held + 1, "first's send stays, last's goes"
        with pytest.raises(vmm_torch.VmmError):
            pickle.loads(out["data"])
        sharing.flush_acks(10)
        deadline = time.monotonic() + 10
        while vmm_torch.send_stats()["held"] > held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert vmm_torch.send_stats()["held"] == held, "first was imported and acknowledged"
        del neighbour


def test_process_arguments_that_fail_to_pickle_withdraw_their_sends():
    """multiprocessing.reduction.dump into memory (a spawned Process's arguments)."""
    import io
    import multiprocessing.reduction

    vmm_torch.install_reducers()
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((64,))
        held = vmm_torch.send_stats()["held"]
        with pytest.raises(TypeError):
            multiprocessing.reduction.dump((t, threading.Lock()), io.BytesIO())
        assert vmm_torch.send_stats()["held"] == held


def test_a_queued_message_that_fails_to_pickle_withdraws_its_sends():
    """The same in a queue's feeder thread, which prints the error and drops the message."""
    vmm_torch.install_reducers()
    q = mp.get_context("spawn").Queue()
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((256,))
        before = vmm_torch.send_stats()
        q.put([t, threading.Lock()])
        deadline = time.monotonic() + 10
        withdrawn = False
        while not withdrawn and time.monotonic() < deadline:
            stats = vmm_torch.send_stats()
            # The feeder made the send (one more hold) and withdrew it (none held).
            withdrawn = stats["holds"] > before["holds"] and stats["held"] == before["held"]
            time.sleep(0.05)
        assert withdrawn, vmm_torch.send_stats()
    q.close()
    q.join_thread()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_sender_that_exits_at_once_is_still_received(method):
    """A child that puts and returns: its exit waits for the receiver (also in a forked child,
    where multiprocessing drops the finalizers registered before the fork)."""
    vmm_torch.install_reducers()
    ctx = mp.get_context(method)
    q = ctx.Queue()
    proc = ctx.Process(target=workers.put_and_exit, args=(q, "posix_fd"))
    proc.start()
    received = q.get(timeout=TIMEOUT)
    assert received.tolist() == [5.0] * 1024
    proc.join(TIMEOUT)
    assert proc.exitcode == 0


@pytest.mark.parametrize("round_", range(3))
def test_a_loader_that_stops_early_does_not_wait_for_its_workers_unread_batches(monkeypatch,
                                                                               round_):
    """A DataLoader whose workers send vmm tensors, left after two batches (its prefetched
    batches never read): each worker cancels its queue's join at shutdown (its data may be
    lost), so its exit does not wait for their receiver (which never comes: the loader joins
    each worker for 5 s, then terminates it). Once it waited the whole exit wait. Three
    rounds: a worker whose exit went on while its feeder freed the batch it had just pickled
    aborted in about 1 exit in 15 (docs/DESIGN.md §3b)."""
    monkeypatch.setenv("VMM_SEND_EXIT_WAIT_S", "120")
    vmm_torch.install_reducers()
    loader = torch.utils.data.DataLoader(
        workers.HostPoolItems(), batch_size=4, num_workers=2, prefetch_factor=4,
        collate_fn=workers.as_list, multiprocessing_context="spawn")
    it = iter(loader)
    for i in range(2):
        batch = next(it)
        assert [float(t[0]) for t in batch] == [float(4 * i + j) for j in range(4)]
        del batch
    processes = list(it._workers)
    start = time.monotonic()
    it._shutdown_workers()
    took = time.monotonic() - start
    assert [p.exitcode for p in processes] == [0, 0], f"terminated after {took:.1f} s"
    del it


def test_the_feeder_thread_never_moves_a_tensor_and_the_receiver_gets_the_error():
    """A tensor the sending thread did not prepare (put bypassed), sharing its chunk: the
    feeder of a pool that isolates sends sends an error the receiver raises, with its type
    and code; by default it sends the tensor where it lies."""
    with vmm_torch.Pool("host", isolate_sends=True) as pool:
        t = pool.zeros((16,))
        neighbour = pool.zeros((16,))
        assert sharing.send_kind(sharing.storage_address(t)) == sharing.SEND_RELOCATE
        before = t.data_ptr()
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=reductions.reduce_tensor(t)),
                                  name=reductions._FEEDER_THREAD)
        thread.start()
        thread.join()
        assert t.data_ptr() == before, "not moved in the feeder thread"
        rebuild, args = out["r"]
        assert rebuild is sharing.raise_send_error
        with pytest.raises(vmm_torch.VmmError) as info:
            rebuild(*args)
        assert info.value.code == "FAILED_PRECONDITION" and "clone" in str(info.value)
        del neighbour
    with vmm_torch.Pool("host") as pool:
        t = pool.zeros((16,)).fill_(2)
        neighbour = pool.zeros((16,))
        assert sharing.send_kind(sharing.storage_address(t)) == sharing.SEND_IN_PLACE
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=reductions.reduce_tensor(t)),
                                  name=reductions._FEEDER_THREAD)
        thread.start()
        thread.join()
        rebuild, args = out["r"]
        assert rebuild is sharing.rebuild_tensor
        received = rebuild(*args)
        assert received.data_ptr() != t.data_ptr() and received.tolist() == [2.0] * 16
        del received, neighbour


def test_put_prepares_every_tensor_pickle_reaches():
    """Deep nesting, many items, slots, __getstate__: what pickle reaches, put prepares; what
    pickle skips, put leaves alone (a non-leaf tensor dropped by __getstate__ is no error).
    (A pool that isolates sends, where a prepared tensor that shares its chunk moves.)"""
    with vmm_torch.Pool("host", isolate_sends=True) as pool:
        tensors = [pool.zeros((16,)) for _ in range(6)]
        neighbours = [pool.zeros((16,)) for _ in range(6)]
        deep = tensors[0]
        for _ in range(10):
            deep = [deep]
        many = [object() for _ in range(20_000)] + [tensors[1]]
        model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2))))
        obj = {"deep": deep, "many": many, "slotted": Slotted(tensors[2]),
               "dropping": Dropping(tensors[3], torch.ones(2, requires_grad=True) * 2),
               "model": model}
        before = [t.data_ptr() for t in tensors]
        reductions.prepare_send(obj)
        for i in range(4):
            assert tensors[i].data_ptr() != before[i], f"tensor {i} was not prepared"
            assert sharing.send_kind(sharing.storage_address(tensors[i])) == \
                sharing.SEND_IN_PLACE
        assert tensors[4].data_ptr() == before[4], "not reached: left alone"
        del neighbours


# --- VMM_TORCH_ENABLE's hook ---------------------------------------------------------------

PTH = "vmm_torch_autoenable.pth"
HOOK = "_vmm_torch_autoenable"


def _site_env(tmp_path):
    """An interpreter that runs the package's .pth at startup, and its environment: a fresh
    virtual environment whose site-packages holds the .pth and the hook (a user site would do
    only outside a virtual environment, where Python reads one), seeing this interpreter's
    import path (torch, vmm_torch) through PYTHONPATH."""
    spec = importlib.util.find_spec(HOOK)
    source = os.path.dirname(os.path.abspath(spec.origin))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True, timeout=120)
    python = str(venv / "bin" / "python")
    site_dir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    for name in (PTH, HOOK + ".py"):
        shutil.copy(os.path.join(source, name), site_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(vmm_torch.__file__)))] +
        [p for p in sys.path if p and os.path.isdir(p)])
    return python, env


def _run(python, code, env):
    return subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("value,expected", [("1", "True"), ("0", "False"), ("", "False")])
def test_the_variable_installs_the_reducers_at_import_torch(tmp_path, value, expected):
    python, env = _site_env(tmp_path)
    env["VMM_TORCH_ENABLE"] = value
    code = ("import sys; import torch; "
            "r = sys.modules.get('vmm_torch.reductions'); "
            "print(bool(r and r.reducers_installed()))")
    result = _run(python, code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected, result.stderr


def test_a_lookup_of_torch_before_the_import_does_not_disarm_the_hook(tmp_path):
    python, env = _site_env(tmp_path)
    env["VMM_TORCH_ENABLE"] = "1"
    code = ("import importlib.util, sys; assert importlib.util.find_spec('torch'); "
            "assert 'vmm_torch' not in sys.modules; import torch; "
            "import vmm_torch.reductions as r; print(r.reducers_installed())")
    result = _run(python, code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True", result.stderr


def test_malformed_options_are_said_and_torch_still_imports(tmp_path):
    python, env = _site_env(tmp_path)
    env["VMM_TORCH_ENABLE"] = "colour=blue"
    result = _run(python, "import torch; print('imported')", env)
    assert result.returncode == 0 and result.stdout.strip() == "imported"
    # On a CPU-only torch the options are not applied (nothing to enable) but the reducers
    # are; with CUDA the bad option is reported naming the variable.
    if torch.cuda.is_available():
        assert "VMM_TORCH_ENABLE" in result.stderr and "colour" in result.stderr


@pytest.mark.parametrize("ticket", [b"", b"garbage", bytes(64), "text", None, 12])
def test_withdrawing_a_malformed_ticket_is_a_clear_error(ticket):
    """sharing.cancel_send refuses what is no send ticket of this process, saying why."""
    with pytest.raises((ValueError, TypeError)) as raised:
        sharing.cancel_send(ticket)
    assert "withdrawing a send" in str(raised.value)
