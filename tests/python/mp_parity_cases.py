"""The cases of the torch.multiprocessing parity suite (test_mp_parity.py), the workers they
spawn, and the runner that executes them in one mode.

A *mode* is a choice of allocator for a whole process tree, made by the environment the
runner's interpreter starts with (children inherit it):

- ``native-cpu``: plain CPU tensors, shared the way PyTorch shares them (shared memory);
- ``vmm-host``: CPU tensors of a ``vmm_torch.Pool("host")`` in every process, the reducers
  installed at interpreter start by ``VMM_TORCH_ENABLE=1`` (the package's .pth file);
- ``native``: CUDA tensors of PyTorch's allocator, shared through CUDA IPC;
- ``vmm-fabric`` / ``vmm-fd``: CUDA tensors of vmm, enabled in every process by
  ``VMM_TORCH_ENABLE=handle_type=fabric`` / ``handle_type=posix_fd``.

Run one mode (what the test module does, in a fresh interpreter with the mode's
environment)::

    python -c "import mp_parity_cases as c, sys; sys.exit(c.main(sys.argv[1:]))" \\
        --mode native-cpu --out results.jsonl [--cases put_then_delete,chain3]

Each case is a function of a :class:`Case` (the mode's tensor factory, the spawn context and
bookkeeping of the processes and queues it starts). It asserts behaviour; it may add notes
(what the mode does where the modes differ) and may declare itself not applicable. Every wait
has a timeout, each case runs under an alarm, and whatever a case started is killed when it
ends. One JSON line per case goes to ``--out`` as soon as the case ends.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import queue
import signal
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

HOST_MODES = ("native-cpu", "vmm-host")
CUDA_MODES = ("native", "vmm-fabric", "vmm-fd")
MODES = HOST_MODES + CUDA_MODES
VMM_MODES = ("vmm-host", "vmm-fabric", "vmm-fd")
#: What VMM_TORCH_ENABLE is set to in each vmm mode.
ENABLE_TEXT = {"vmm-host": "1", "vmm-fabric": "handle_type=fabric",
               "vmm-fd": "handle_type=posix_fd"}
#: The handle type each vmm CUDA mode must export with.
HANDLE_TYPE = {"vmm-fabric": "fabric", "vmm-fd": "posix_fd"}
#: Tells every process of a run which mode it is in (set by the test module).
MODE_VARIABLE = "VMM_PARITY_MODE"

GIB = 1 << 30


def current_mode() -> str:
    mode = os.environ.get(MODE_VARIABLE, "")
    if mode not in MODES:
        raise RuntimeError(f"{MODE_VARIABLE}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def is_cuda(mode: str) -> bool:
    return mode in CUDA_MODES


def is_vmm(mode: str) -> bool:
    return mode in VMM_MODES


def wait_step(mode: str) -> float:
    """Longest single wait (a queue item, an event) before a case gives up."""
    return 60.0 if is_cuda(mode) else 30.0


# --- Tensors of the mode -----------------------------------------------------------------------

_host_pool = None


def host_pool():
    """This process's host pool (vmm-host), made on first use and kept."""
    global _host_pool
    if _host_pool is None:
        import vmm_torch

        _host_pool = vmm_torch.Pool("host")
    return _host_pool


class Factory:
    """Tensors of the mode: pool tensors for vmm-host, CPU tensors for native-cpu, CUDA tensors
    (of whichever allocator the process runs) for the CUDA modes."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.cuda = is_cuda(mode)
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")

    def empty(self, shape, dtype=torch.float32) -> torch.Tensor:
        if self.mode == "vmm-host":
            return host_pool().empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def full(self, shape, value, dtype=torch.float32) -> torch.Tensor:
        return self.empty(shape, dtype).fill_(value)

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` made by this factory (into the pool for vmm-host)."""
        return self.empty(tuple(t.shape), t.dtype).copy_(t)

    def sync(self) -> None:
        """Makes this process's device work visible to other processes."""
        if self.cuda:
            torch.cuda.synchronize()

    def in_pool(self, t: torch.Tensor) -> bool:
        import vmm_torch

        return vmm_torch.in_vmm_pool(t)


# --- Worker processes --------------------------------------------------------------------------


class Failure(AssertionError):
    """A case failed, with a reason for the table."""


class CaseTimeout(Exception):
    """The case ran past its alarm."""


class NotApplicable(Exception):
    """The case does not apply to this mode (the reason goes to the table)."""


def check_process_setup(mode: str) -> None:
    """What VMM_TORCH_ENABLE must have done in every process of a vmm mode by the time torch
    is imported: reducers installed and, on CUDA, vmm enabled."""
    if not is_vmm(mode):
        return
    from vmm_torch import allocator, reductions

    if not reductions.reducers_installed():
        raise RuntimeError("VMM_TORCH_ENABLE is set but the reducers are not installed in "
                           "this process (the vmm_torch_autoenable.pth file did not run)")
    if is_cuda(mode) and not allocator.is_enabled():
        raise RuntimeError("VMM_TORCH_ENABLE is set but vmm is not this process's CUDA "
                           "allocator")


def _worker(fn: Callable[..., Any], errors: Any, limit: float, args: Tuple[Any, ...]) -> None:
    """Runs a worker function in a spawned process; its failure goes to `errors`."""
    faulthandler.dump_traceback_later(limit, exit=True)  # never outlive the case by much
    try:
        check_process_setup(current_mode())
        fn(*args)
    except BaseException as error:
        errors.put((fn.__name__, f"{type(error).__name__}: {error}",
                    traceback.format_exc(limit=6)))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _wait(event: Any, what: str) -> None:
    if not event.wait(wait_step(current_mode())):
        raise TimeoutError(f"waited too long for {what}")


def _get(q: Any, what: str) -> Any:
    try:
        return q.get(timeout=wait_step(current_mode()))
    except queue.Empty:
        raise TimeoutError(f"waited too long for {what}") from None


def _check_all(t: torch.Tensor, value: float, what: str) -> None:
    actual = t.detach().double()
    if actual.numel() and not bool((actual == value).all()):
        wrong = actual[actual != value]
        raise AssertionError(f"{what}: expected every element {value}, found "
                             f"{wrong[:4].tolist()} ({wrong.numel()} of {actual.numel()} wrong)")


# --- The case context --------------------------------------------------------------------------


class Case:
    """What a case works with: ``mode``, ``f`` (the mode's Factory), ``ctx`` (spawn context),
    helpers that start processes and wait with timeouts (failing at once when a worker
    reports an error), and ``notes`` for the table."""

    def __init__(self, mode: str, ctx: Any, limit: float) -> None:
        self.mode = mode
        self.ctx = ctx
        self.f = Factory(mode)
        self.cuda = is_cuda(mode)
        self.vmm = is_vmm(mode)
        self.step = wait_step(mode)
        self.limit = limit
        self.notes: List[str] = []
        self.procs: List[Any] = []
        self.queues: List[Any] = []
        self.errors = self.queue()

    # Setup.

    def queue(self, maxsize: int = 0) -> Any:
        q = self.ctx.Queue(maxsize)
        self.queues.append(q)
        return q

    def event(self) -> Any:
        return self.ctx.Event()

    def start(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Starts `fn(*args)` in a spawned (daemon) process; its errors fail the case."""
        proc = self.ctx.Process(target=_worker, args=(fn, self.errors, self.limit + 30, args),
                                name=fn.__name__, daemon=True)
        self.procs.append(proc)
        proc.start()
        return proc

    def note(self, text: str) -> None:
        self.notes.append(text)

    # Waiting.

    def check_workers(self) -> None:
        """Fails with the first error a worker reported, or for a worker that died."""
        try:
            name, message, trace = self.errors.get_nowait()
        except queue.Empty:
            pass
        else:
            raise Failure(f"in {name}: {message}\n{trace}")
        for proc in self.procs:
            if proc.exitcode not in (None, 0):
                time.sleep(0.2)  # its error report, if any, may still be on the way
                try:
                    name, message, trace = self.errors.get_nowait()
                except queue.Empty:
                    raise Failure(f"{proc.name} died (exit code {proc.exitcode})") from None
                raise Failure(f"in {name}: {message}\n{trace}")

    def _until(self, attempt: Callable[[float], Tuple[bool, Any]], what: str,
               timeout: Optional[float]) -> Any:
        deadline = time.monotonic() + (timeout or self.step)
        while True:
            self.check_workers()
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"timed out waiting for {what}")
            done, value = attempt(min(0.25, left))
            if done:
                return value

    def get(self, q: Any, what: str, timeout: Optional[float] = None) -> Any:
        def attempt(seconds: float) -> Tuple[bool, Any]:
            try:
                return True, q.get(timeout=seconds)
            except queue.Empty:
                return False, None

        return self._until(attempt, what, timeout)

    def put(self, q: Any, item: Any, what: str, timeout: Optional[float] = None) -> None:
        """put() on a bounded queue, failing early when its consumer has failed."""
        def attempt(seconds: float) -> Tuple[bool, Any]:
            try:
                q.put(item, timeout=seconds)
                return True, None
            except queue.Full:
                return False, None

        self._until(attempt, what, timeout)

    def wait(self, event: Any, what: str, timeout: Optional[float] = None) -> None:
        self._until(lambda seconds: (event.wait(seconds), None), what, timeout)

    def join(self, proc: Any, timeout: Optional[float] = None) -> None:
        """Waits for `proc` to exit cleanly."""
        self._until(lambda seconds: (proc.join(seconds) or proc.exitcode is not None, None),
                    f"{proc.name} to exit", timeout)
        self.check_workers()

    def finish(self, *events: Any) -> None:
        """Sets `events` (the workers' signal to end) and waits for every worker to exit."""
        for event in events:
            event.set()
        for proc in self.procs:
            self.join(proc)

    def cleanup(self) -> None:
        """Kills what is still running and lets go of the queues (never blocks long)."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for q in self.queues:
            q.cancel_join_thread()
            q.close()


# --- Cases -------------------------------------------------------------------------------------
# Each case_NAME(h) asserts; workers are w_NAME(...) functions of this module.


def w_both_ways(mode, data, back, child_wrote, parent_wrote, parent_wrote_back, child_wrote_back,
                done):
    f = Factory(mode)
    a = _get(data, "the parent's tensor")
    _check_all(a, 1.0, "the parent's tensor as received")
    a[0] = 2.0
    f.sync()
    child_wrote.set()
    _wait(parent_wrote, "the parent's write")
    if float(a[1]) != 3.0:
        raise AssertionError(f"the parent's write is not visible here: {float(a[1])}")
    mine = f.full((16,), 5.0)
    back.put(mine)
    _wait(parent_wrote_back, "the parent's write into this process's tensor")
    if float(mine[0]) != 6.0:
        raise AssertionError(f"the parent's write into this process's tensor is not visible "
                             f"here: {float(mine[0])}")
    mine[1] = 7.0
    f.sync()
    child_wrote_back.set()
    _wait(done, "the end")


def case_writes_both_ways(h: Case) -> None:
    """Writes are visible both ways: the parent's tensor in the child and the child's tensor
    in the parent."""
    data, back = h.queue(), h.queue()
    events = [h.event() for _ in range(5)]
    child_wrote, parent_wrote, parent_wrote_back, child_wrote_back, done = events
    h.start(w_both_ways, h.mode, data, back, *events)
    t = h.f.full((16,), 1.0)
    data.put(t)
    h.wait(child_wrote, "the child's write")
    if float(t[0]) != 2.0:
        raise Failure(f"the child's write into the parent's tensor is not visible: "
                      f"{float(t[0])}")
    t[1] = 3.0
    h.f.sync()
    parent_wrote.set()
    theirs = h.get(back, "the child's tensor")
    _check_all(theirs[2:], 5.0, "the child's tensor as received")
    theirs[0] = 6.0
    h.f.sync()
    parent_wrote_back.set()
    h.wait(child_wrote_back, "the child's second write")
    if float(theirs[1]) != 7.0:
        raise Failure(f"the child's write into its own tensor is not visible here: "
                      f"{float(theirs[1])}")
    del theirs
    h.finish(done)


def w_receive_twice(data, reply, done):
    a = _get(data, "the first copy")
    b = _get(data, "the second copy")
    reply.put((a.data_ptr(), b.data_ptr(), float(a.double().sum()), float(b.double().sum())))
    _wait(done, "the end")


def case_received_twice(h: Case) -> None:
    """A tensor sent twice arrives as two tensors over one mapping (the same data_ptr)."""
    data, reply, done = h.queue(), h.queue(), h.event()
    h.start(w_receive_twice, data, reply, done)
    t = h.f.full((64,), 4.0)
    data.put(t)
    data.put(t)
    ptr_a, ptr_b, sum_a, sum_b = h.get(reply, "the receiver's answer")
    if (sum_a, sum_b) != (256.0, 256.0):
        raise Failure(f"wrong contents received: sums {sum_a}, {sum_b} (expected 256)")
    if ptr_a != ptr_b:
        raise Failure(f"mapped twice: data_ptr {ptr_a:#x} and {ptr_b:#x}")
    h.finish(done)


def w_put_then_delete(mode, data, count, put_done, done):
    f = Factory(mode)
    for i in range(count):
        t = f.full((32,), float(i))
        data.put(t)
        del t
    put_done.set()
    _wait(done, "the consumer")


def case_put_then_delete(h: Case) -> None:
    """A producer puts and drops its tensors at once; the consumer reads them only after the
    producer has finished putting, and finds every value."""
    count = 1000
    data, put_done, done = h.queue(), h.event(), h.event()
    h.start(w_put_then_delete, h.mode, data, count, put_done, done)
    h.wait(put_done, "the producer's puts")
    for i in range(count):
        t = h.get(data, f"tensor {i}")
        _check_all(t, float(i), f"tensor {i}")
        del t
    h.finish(done)
    h.note(f"{count} tensors")


def w_mixed_dtypes(mode, data, count, done):
    f = Factory(mode)
    for i in range(count):
        data.put((f.full((8,), i + 0.5), f.full((8,), i % 256, torch.uint8)))
    _wait(done, "the consumer")


def case_mixed_dtypes(h: Case) -> None:
    """float32 and uint8 tensors alternate on one queue."""
    count = 100 if h.cuda else 50
    data, done = h.queue(), h.event()
    h.start(w_mixed_dtypes, h.mode, data, count, done)
    for i in range(count):
        floats, bytes_ = h.get(data, f"pair {i}")
        if floats.dtype != torch.float32 or bytes_.dtype != torch.uint8:
            raise Failure(f"pair {i}: dtypes {floats.dtype}, {bytes_.dtype}")
        _check_all(floats, i + 0.5, f"pair {i} (float32)")
        _check_all(bytes_, i % 256, f"pair {i} (uint8)")
    h.finish(done)


def w_chain_middle(mode, inbox, outbox, count, done):
    f = Factory(mode)
    for _ in range(count):
        received = _get(inbox, "a tensor from the first process")
        copy_ = f.clone(received)
        del received
        outbox.put(copy_)
        del copy_
    _wait(done, "the end")


def w_chain_last(inbox, count, reply):
    total = 0.0
    for _ in range(count):
        total += float(_get(inbox, "a tensor from the middle process").double().sum())
    reply.put(total)


def case_chain3(h: Case) -> None:
    """Three processes: the first sends N small tensors and drops them, the middle one clones
    and forwards each, the last sums them all."""
    count = 2000
    first, second, reply, done = h.queue(), h.queue(), h.queue(), h.event()
    h.start(w_chain_middle, h.mode, first, second, count, done)
    h.start(w_chain_last, second, count, reply)
    started = time.monotonic()
    for i in range(count):
        t = h.f.full((4,), float(i))
        first.put(t)
        del t
    total = h.get(reply, "the last process's sum", timeout=h.limit)
    expected = 4.0 * count * (count - 1) / 2
    if total != expected:
        raise Failure(f"sum {total}, expected {expected}")
    h.note(f"N={count}, {time.monotonic() - started:.1f} s")
    h.finish(done)


def _model_values(round_: int, index: int) -> float:
    return round_ + 0.125 * index


def w_actor(mode, inbox, rounds, reply):
    for r in range(rounds):
        state = _get(inbox, f"state dict {r}")
        for index, (name, value) in enumerate(state.items()):
            _check_all(value, _model_values(r, index), f"round {r}, {name}")
        reply.put((r, len(state)))
        del state


def case_state_dict_queue(h: Case) -> None:
    """A learner sends copy.deepcopy(model.state_dict()) through Queue(maxsize=2) each round
    and changes its model right after; the actor checks every round's values."""
    rounds = 8
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.to(h.f.device)
    if h.mode == "vmm-host":
        for param in model.parameters():
            param.data = h.f.clone(param.data)
    inbox, reply = h.queue(maxsize=2), h.queue()
    h.start(w_actor, h.mode, inbox, rounds, reply)
    for r in range(rounds):
        with torch.no_grad():
            for index, value in enumerate(model.state_dict().values()):
                value.fill_(_model_values(r, index))
        state = copy.deepcopy(model.state_dict())
        if h.mode == "vmm-host":
            # deepcopy allocates with the CPU allocator, which is not vmm's on the host:
            # the copies go into the pool, as a CUDA deepcopy under vmm would be.
            state = {name: h.f.clone(value) for name, value in state.items()}
        h.put(inbox, state, f"room in the queue for round {r}")
        del state
    for r in range(rounds):
        got, entries = h.get(reply, f"the actor's check of round {r}")
        if got != r or entries != 4:
            raise Failure(f"round {r}: the actor answered for round {got} ({entries} entries)")
    h.finish()


def w_cuda_events(data, back, done):
    t, event = _get(data, "the tensor and its event")
    event.wait(torch.cuda.current_stream())
    if not bool((t == 2.0).all()):
        raise AssertionError("the parent's kernel had not finished when its event fired")
    t.add_(1.0)
    mine = torch.cuda.Event(interprocess=True)
    mine.record()
    back.put(mine)
    _wait(done, "the end")


def case_cuda_events(h: Case) -> None:
    """Interprocess CUDA events order work across processes, both ways."""
    if not h.cuda:
        raise NotApplicable("CUDA events (CUDA modes only)")
    data, back, done = h.queue(), h.queue(), h.event()
    h.start(w_cuda_events, data, back, done)
    t = h.f.full((1 << 22,), 1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(20):  # long enough that a missing wait would show
            t.mul_(1.0)
        t.add_(1.0)
        event = torch.cuda.Event(interprocess=True)
        event.record(stream)
    data.put((t, event))
    theirs = h.get(back, "the child's event")
    theirs.synchronize()
    if not bool((t == 3.0).all()):
        raise Failure("the child's write is not visible after its event")
    h.finish(done)


_EMPTY_SHAPES = [((0,), torch.float32), ((0, 3), torch.int64), ((2, 0, 4), torch.uint8),
                 ((3, 0), torch.float64)]


def _describe(tensors):
    return [(tuple(t.shape), str(t.dtype), t.device.type) for t in tensors]


def w_empty(mode, data, back, done):
    f = Factory(mode)
    received = _get(data, "the empty tensors")
    back.put((_describe(received), [f.empty(shape, dtype) for shape, dtype in _EMPTY_SHAPES]))
    _wait(done, "the end")


def case_empty_tensors(h: Case) -> None:
    """Tensors without elements keep their shape and dtype, both ways."""
    data, back, done = h.queue(), h.queue(), h.event()
    h.start(w_empty, h.mode, data, back, done)
    data.put([h.f.empty(shape, dtype) for shape, dtype in _EMPTY_SHAPES])
    seen_there, from_child = h.get(back, "the child's answer")
    expected = [(shape, str(dtype), h.f.device.type) for shape, dtype in _EMPTY_SHAPES]
    if seen_there != expected:
        raise Failure(f"received by the child as {seen_there}, sent {expected}")
    if _describe(from_child) != expected:
        raise Failure(f"received from the child as {_describe(from_child)}, sent {expected}")
    del from_child
    h.finish(done)


def w_parameters(mode, data, reply, wrote, done):
    f = Factory(mode)
    param, leaf = _get(data, "the parameter and the leaf")
    reply.put((type(param).__name__, param.requires_grad, param.grad is None,
               type(leaf).__name__, leaf.requires_grad, leaf.is_leaf, leaf.grad is None))
    with torch.no_grad():
        param[0] = 7.0
        leaf[0] = 8.0
    param._grad = f.full(tuple(param.shape), 3.0)
    (leaf * 2).sum().backward()  # the receiver's own gradient
    f.sync()
    if float(leaf.grad[0]) != 2.0:
        raise AssertionError(f"the receiver's backward gave {leaf.grad.tolist()}")
    wrote.set()
    _wait(done, "the end")


def case_parameters_grad(h: Case) -> None:
    """Parameter and requires_grad arrive; grad does not travel (None there); the receiver's
    writes to the data are visible to the sender, its gradients are its own."""
    data, reply, wrote, done = h.queue(), h.queue(), h.event(), h.event()
    h.start(w_parameters, h.mode, data, reply, wrote, done)
    param = torch.nn.Parameter(h.f.full((6,), 1.0))
    param.grad = h.f.full((6,), 0.5)
    leaf = h.f.full((3,), 2.0).requires_grad_()
    data.put((param, leaf))
    seen = h.get(reply, "what the child received")
    expected = ("Parameter", True, True, "Tensor", True, True, True)
    if seen != expected:
        raise Failure(f"received as (type, requires_grad, grad is None) x2 + is_leaf: {seen}, "
                      f"expected {expected}")
    h.wait(wrote, "the child's writes")
    if float(param[0]) != 7.0 or float(leaf[0]) != 8.0:
        raise Failure(f"the child's writes are not visible: {float(param[0])}, "
                      f"{float(leaf[0])}")
    if not bool((param.grad == 0.5).all()) or leaf.grad is not None:
        raise Failure("the child's gradients reached the sender")
    h.finish(done)


def case_non_leaf_refused(h: Case) -> None:
    """A non-leaf tensor that requires grad cannot be pickled for another process:
    ForkingPickler.dumps and SimpleQueue.put raise RuntimeError in every mode; Queue.put
    raises in the caller in vmm modes (natively the feeder thread reports it and drops the
    item)."""
    leaf = h.f.full((8,), 1.0).requires_grad_()
    non_leaves = {"view": leaf[2:], "product": leaf * 2}
    simple = h.ctx.SimpleQueue()
    plain = h.queue()
    try:
        for name, tensor in non_leaves.items():
            for how, send in (("ForkingPickler.dumps", ForkingPickler.dumps),
                              ("SimpleQueue.put", simple.put)):
                try:
                    send(tensor)
                except RuntimeError:
                    continue
                raise Failure(f"{how} of a non-leaf ({name}) did not raise RuntimeError")
        raised = []
        for name, tensor in non_leaves.items():
            try:
                plain.put(tensor)
                raised.append(False)
            except RuntimeError:
                raised.append(True)
        if h.vmm:
            if not all(raised):
                raise Failure(f"Queue.put of a non-leaf did not raise in the caller "
                              f"(view, product): {raised}")
            try:
                plain.put({"nested": [leaf[1:]]})
                raise Failure("Queue.put of a dict holding a non-leaf did not raise")
            except RuntimeError:
                pass
            h.note("Queue.put raises in the caller")
        else:
            plain.put("after")
            first = h.get(plain, "the item after the refused ones")
            if any(raised) or first != "after":
                raise Failure(f"natively Queue.put was expected to return and the feeder to "
                              f"drop the tensor: raised {raised}, first item {first!r}")
            h.note("Queue.put returns; the feeder thread prints the error and drops the item")
    finally:
        simple.close()


def w_process_args(mode, t, reply, done):
    enabled = None
    if is_vmm(mode) and is_cuda(mode):
        import vmm_torch

        vmm_torch.enable()  # what a worker's own code would do first: must not raise
        enabled = vmm_torch.is_enabled()
    f = Factory(mode)
    _check_all(t, 3.0, "the argument tensor")
    t[0] = 7.0
    f.sync()
    reply.put(enabled)
    _wait(done, "the end")


def case_process_args(h: Case) -> None:
    """Tensors passed as Process(target, args=(t,)): the child reads and writes them (in vmm
    CUDA modes its own vmm_torch.enable() still succeeds)."""
    reply, done = h.queue(), h.event()
    t = h.f.full((8,), 3.0)
    h.start(w_process_args, h.mode, t, reply, done)
    enabled = h.get(reply, "the child's answer")
    if h.vmm and h.cuda and enabled is not True:
        raise Failure(f"vmm_torch.enable() in the child left is_enabled() {enabled}")
    if float(t[0]) != 7.0:
        raise Failure(f"the child's write is not visible: {float(t[0])}")
    h.finish(done)


def w_is_shared(data, reply, done):
    t = _get(data, "the tensor")
    reply.put(t.is_shared())
    _wait(done, "the end")


#: is_shared() of (the sender's tensor before sending, after, the received tensor).
#: PyTorch moves a CPU tensor's storage into shared memory when it is sent, so is_shared()
#: turns True; CUDA storages always report True. vmm's host pool memory is shareable as it
#: is (memfd) and is never moved, and is_shared() only recognises PyTorch's own
#: shared-memory allocators: it stays False for pool tensors, sent or received.
IS_SHARED = {"native-cpu": (False, True, True), "vmm-host": (False, False, False),
             "native": (True, True, True), "vmm-fabric": (True, True, True),
             "vmm-fd": (True, True, True)}


def case_is_shared(h: Case) -> None:
    """is_shared() of a sent and a received tensor (see IS_SHARED)."""
    data, reply, done = h.queue(), h.queue(), h.event()
    h.start(w_is_shared, data, reply, done)
    t = h.f.full((8,), 1.0)
    before = t.is_shared()
    data.put(t)
    received = h.get(reply, "the receiver's is_shared()")
    seen = (before, t.is_shared(), received)
    h.note(f"sender before/after, receiver: {seen}")
    if seen != IS_SHARED[h.mode]:
        raise Failure(f"is_shared() (sender before, after, receiver) {seen}, expected "
                      f"{IS_SHARED[h.mode]}")
    h.finish(done)


_BIG_SLICES = (0, GIB // 3, GIB // 2 + 12345, GIB - 4096)


def _slice_sums(t: torch.Tensor) -> List[int]:
    return [int(t[start:start + 4096].sum(dtype=torch.int64)) for start in _BIG_SLICES]


def w_big(mode, data, reply, done):
    f = Factory(mode)
    t = _get(data, "the 1 GiB tensor")
    sums = _slice_sums(t)
    t[-1] = 123
    f.sync()
    reply.put((t.numel(), sums))
    _wait(done, "the end")


def case_big_1gib(h: Case) -> None:
    """A 1 GiB tensor arrives whole: checksums of slices across it match; a write at its end
    comes back."""
    data, reply, done = h.queue(), h.queue(), h.event()
    h.start(w_big, h.mode, data, reply, done)
    t = h.f.full((GIB,), 1, torch.uint8)
    pattern = (torch.arange(4096) % 251).to(torch.uint8).to(h.f.device)
    for k, start in enumerate(_BIG_SLICES):
        t[start:start + 4096] = pattern + k
    expected = _slice_sums(t)
    h.f.sync()
    started = time.monotonic()
    data.put(t)
    numel, sums = h.get(reply, "the receiver's checksums", timeout=h.limit)
    if numel != GIB or sums != expected:
        raise Failure(f"received {numel} elements with slice sums {sums}, expected {GIB} and "
                      f"{expected}")
    if int(t[-1]) != 123:
        raise Failure(f"the receiver's write is not visible: {int(t[-1])}")
    h.note(f"{time.monotonic() - started:.1f} s")
    del t
    h.finish(done)


def w_exporter(mode, data, ack):
    f = Factory(mode)
    t = f.full((1024,), 42.0)
    f.sync()
    data.put(t)
    del t
    _wait(ack, "the receiver's ack")


def w_outlive_exporter(mode, data, ack, exporter_gone, reply):
    f = Factory(mode)
    t = _get(data, "the tensor")
    ack.set()
    _wait(exporter_gone, "the exporter's exit")
    time.sleep(0.2)
    try:
        _check_all(t, 42.0, "the tensor after its exporter exited")
        t[0] = 1.0
        f.sync()
        total = float(t.double().sum())
        if total != 42.0 * 1023 + 1:
            raise AssertionError(f"a write after the exporter exited read back as sum {total}")
    except Exception as error:  # reported, not raised: natively nothing is promised here
        reply.put(("failed", f"{type(error).__name__}: {error}"))
    else:
        reply.put(("ok", ""))


def case_exporter_exits(h: Case) -> None:
    """The exporting process exits once the receiver has the tensor; the receiver reads and
    writes it afterwards. (Both ends are workers, so that a broken mapping cannot spoil this
    process's CUDA context for the next cases.)"""
    data, ack, exporter_gone, reply = h.queue(), h.event(), h.event(), h.queue()
    exporter = h.start(w_exporter, h.mode, data, ack)
    h.start(w_outlive_exporter, h.mode, data, ack, exporter_gone, reply)
    h.join(exporter)
    exporter_gone.set()
    outcome, detail = h.get(reply, "the receiver's reads after the exporter exited")
    if outcome != "ok":
        if h.mode == "native":
            # PyTorch asks producers to outlive their consumers: nothing is promised here.
            raise NotApplicable(f"not promised natively (the producer must stay alive); "
                                f"observed: {detail}")
        raise Failure(detail)
    h.finish()


def w_forward_middle(mode, inbox, outbox, reply, done):
    t = _get(inbox, "the first process's tensor")
    if mode == "native":
        try:
            ForkingPickler.dumps(t)
        except RuntimeError as error:
            reply.put(("refused", str(error).splitlines()[0]))
        else:
            reply.put(("pickled",))
    else:
        outbox.put(t)  # no clone
        reply.put(("forwarded",))
    _wait(done, "the end")


def w_forward_last(mode, inbox, reply, done):
    f = Factory(mode)
    t = _get(inbox, "the forwarded tensor")
    _check_all(t, 5.0, "the forwarded tensor")
    t[0] = 99.0
    f.sync()
    reply.put("wrote")
    _wait(done, "the end")


def case_forward_no_clone(h: Case) -> None:
    """A received tensor is sent on without a copy (A -> B -> C): C's write shows in A.
    PyTorch refuses to forward a received CUDA tensor (B gets RuntimeError); CPU tensors
    forward through their shared memory."""
    first, second, reply_b, reply_c, done = (h.queue(), h.queue(), h.queue(), h.queue(),
                                             h.event())
    h.start(w_forward_middle, h.mode, first, second, reply_b, done)
    if h.mode != "native":
        h.start(w_forward_last, h.mode, second, reply_c, done)
    t = h.f.full((32,), 5.0)
    first.put(t)
    answer = h.get(reply_b, "the middle process's answer")
    if h.mode == "native":
        if answer[0] != "refused":
            raise Failure("PyTorch was expected to refuse forwarding a received CUDA tensor")
        h.note(f"refused natively ({answer[1][:60]})")
    else:
        h.get(reply_c, "the last process's write")
        if float(t[0]) != 99.0:
            raise Failure(f"the last process's write is not visible to the first: "
                          f"{float(t[0])}")
    h.finish(done)


def case_unshareable_pool(h: Case) -> None:
    """No silent loss: Queue.put of a tensor of a pool made with handle_type="none" raises
    VmmError in the caller (alone or inside a container), and the queue stays usable."""
    if not h.vmm:
        raise NotApplicable("vmm pools only")
    import vmm_torch

    with vmm_torch.Pool("host" if not h.cuda else torch.cuda.current_device(),
                        handle_type="none") as pool:
        t = pool.empty((16,)).fill_(1.0)
        q = h.queue()
        for item in (t, [t], {"weights": (t,)}):
            try:
                q.put(item)
            except vmm_torch.VmmError:
                continue
            raise Failure(f"Queue.put of {type(item).__name__} with an unshareable tensor did "
                          f"not raise VmmError")
        q.put("next")
        if h.get(q, "the next item") != "next":
            raise Failure("the queue carried something of the refused puts")
        del t


def w_never_reads(inbox, done):
    del inbox  # held, never read
    _wait(done, "the end")


def case_unread_lease(h: Case) -> None:
    """A send whose receiver never reads is held only for its lease: with a 1 s lease,
    send_stats() shows held bytes after the put and none a few seconds later (expired)."""
    if not h.vmm:
        raise NotApplicable("vmm send leases only")
    from vmm_torch import sharing

    sharing.wait_for_sends(10)
    before = sharing.send_stats()
    lease = before["lease_seconds"]
    inbox, done = h.queue(), h.event()
    h.start(w_never_reads, inbox, done)
    sharing.set_send_lease(1)
    try:
        t = h.f.full((1 << 16,), 1.0)
        inbox.put(t)
        del t
        deadline = time.monotonic() + 5
        held = 0
        while time.monotonic() < deadline and held <= before["held_bytes"]:
            held = sharing.send_stats()["held_bytes"]
            time.sleep(0.02)
        if held <= before["held_bytes"]:
            raise Failure(f"held_bytes {held} after the put (before: {before['held_bytes']})")
        deadline = time.monotonic() + 10
        stats = sharing.send_stats()
        while time.monotonic() < deadline and stats["held_bytes"] > before["held_bytes"]:
            time.sleep(0.1)
            stats = sharing.send_stats()
        if stats["held_bytes"] > before["held_bytes"]:
            raise Failure(f"still held after 10 s with a 1 s lease: {stats}")
        if stats["expired"] <= before["expired"]:
            raise Failure(f"the hold ended without counting as expired: {stats}")
        h.note(f"held {held} bytes, released by the lease")
    finally:
        sharing.set_send_lease(lease)
    h.finish(done)


#: (name, function, alarm seconds on the host, on CUDA), in table order.
CASES: List[Tuple[str, Callable[[Case], None], float, float]] = [
    ("writes_both_ways", case_writes_both_ways, 60, 90),
    ("received_twice", case_received_twice, 60, 90),
    ("put_then_delete", case_put_then_delete, 90, 120),
    ("mixed_dtypes", case_mixed_dtypes, 60, 90),
    ("chain3", case_chain3, 120, 180),
    ("state_dict_queue", case_state_dict_queue, 60, 90),
    ("cuda_events", case_cuda_events, 60, 90),
    ("empty_tensors", case_empty_tensors, 60, 90),
    ("parameters_grad", case_parameters_grad, 60, 90),
    ("non_leaf_refused", case_non_leaf_refused, 60, 90),
    ("process_args", case_process_args, 60, 90),
    ("is_shared", case_is_shared, 60, 90),
    ("big_1gib", case_big_1gib, 120, 120),
    ("exporter_exits", case_exporter_exits, 60, 90),
    ("forward_no_clone", case_forward_no_clone, 60, 90),
    ("unshareable_pool", case_unshareable_pool, 60, 90),
    ("unread_lease", case_unread_lease, 60, 90),
]
CASE_NAMES = [name for name, *_ in CASES]


# --- The runner (one mode, one interpreter) ----------------------------------------------------


def _on_alarm(signum, frame):
    raise CaseTimeout()


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def mode_check(mode: str) -> Optional[Tuple[str, str]]:
    """None where the mode can run in this process, else ("n/a" or "fail", reason)."""
    if os.environ.get(MODE_VARIABLE) != mode:
        return "fail", f"{MODE_VARIABLE} is not {mode} in the runner"
    enable_variable = os.environ.get("VMM_TORCH_ENABLE")
    if not is_vmm(mode) and enable_variable not in (None, "", "0"):
        return "fail", f"VMM_TORCH_ENABLE={enable_variable!r} in a native mode"
    if is_cuda(mode) and not torch.cuda.is_available():
        return "n/a", "no CUDA device"
    if not is_vmm(mode):
        return None
    if "_vmm_torch_autoenable" not in sys.modules:
        return "fail", "the vmm_torch_autoenable.pth file did not run at interpreter start"
    try:
        import vmm_torch

        vmm_torch.load()
        check_process_setup(mode)
    except Exception as error:
        return "fail", f"vmm_torch is not usable: {type(error).__name__}: {error}"
    if mode == "vmm-host":
        try:
            in_pool = Factory(mode).in_pool(Factory(mode).full((4,), 1.0))
        except Exception as error:
            return "fail", f"a host pool tensor: {type(error).__name__}: {error}"
        return None if in_pool else ("fail", "the factory's tensors are not pool tensors")
    try:  # the handle type works here (fabric needs an IMEX channel)
        probe = torch.empty(1 << 20, device="cuda")
        handle_type = vmm_torch.export_tensor(probe).descriptor.handle_type
    except Exception as error:
        reason = f"{HANDLE_TYPE[mode]} handles: {type(error).__name__}: {error}"
        return ("n/a" if mode == "vmm-fabric" else "fail"), _short(reason)
    if handle_type != HANDLE_TYPE[mode]:
        return ("n/a" if mode == "vmm-fabric" else "fail",
                f"vmm exports {handle_type} handles, not {HANDLE_TYPE[mode]}")
    return None


def run_case(mode: str, name: str, fn: Callable[[Case], None], limit: float,
             ctx: Any) -> Dict[str, Any]:
    h = Case(mode, ctx, limit)
    started = time.monotonic()
    status, reason = "pass", ""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        try:
            fn(h)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except NotApplicable as error:
        status, reason = "n/a", str(error)
    except CaseTimeout:
        status, reason = "fail", f"timed out after {limit:.0f} s"
    except Failure as error:
        status, reason = "fail", str(error)
    except Exception as error:
        status = "fail"
        reason = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            h.cleanup()
        except Exception as error:  # never lose the case's result
            h.note(f"cleanup: {type(error).__name__}: {error}")
    return {"case": name, "mode": mode, "status": status, "reason": reason, "notes": h.notes,
            "seconds": round(time.monotonic() - started, 2)}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description="Runs the parity cases in one mode.")
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--out", required=True, help="JSON lines, one per case")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    args = parser.parse_args(argv)
    wanted = [c for c in args.cases.split(",") if c] or CASE_NAMES
    unknown = sorted(set(wanted) - set(CASE_NAMES))
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}")
    faulthandler.enable()
    problem = mode_check(args.mode)
    ctx = mp.get_context("spawn")
    with open(args.out, "a") as out:
        for name, fn, host_limit, cuda_limit in CASES:
            if name not in wanted:
                continue
            if problem is not None:
                result = {"case": name, "mode": args.mode, "status": problem[0],
                          "reason": problem[1], "notes": [], "seconds": 0}
            else:
                limit = cuda_limit if is_cuda(args.mode) else host_limit
                result = run_case(args.mode, name, fn, limit, ctx)
            out.write(json.dumps(result) + "\n")
            out.flush()
            print(f"{args.mode} {name}: {result['status']} ({result['seconds']} s) "
                  f"{_short(result['reason'], 2000)} {'; '.join(result['notes'])}", flush=True)
    return 0
