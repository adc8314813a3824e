"""torch.multiprocessing integration: tensors of vmm memory travel as vmm sends.

After :func:`install_reducers`, pickling with ``multiprocessing.reduction.ForkingPickler``
(what ``torch.multiprocessing`` queues, pipes and process arguments use) turns a tensor whose
storage is vmm memory into a *send*: its buffer descriptor, metadata and a ticket (the payload
of :mod:`vmm_torch.sharing`). The receiving process imports the descriptor, mapping the same
memory, and acknowledges the ticket. Other tensors go through PyTorch's own reducer. A storage
of vmm memory (untyped, typed or legacy typed) is a send of all its bytes, unpickled as the
same kind of storage over the memory the receiver maps; other storages go through PyTorch's.

What a send promises (docs/DESIGN.md §3, §4 "send holds"):

- **Lifetime.** The sender holds the memory until the receiver has imported it, so
  ``queue.put(t); del t`` is safe, with either handle type; then the receiver's mapping is its
  own. A receiver that never reads (or dies) holds nothing forever: the send's lease ends
  after 600 s (``vmm_torch.set_send_lease``, or VMM_SEND_LEASE_S), and held sends show in
  ``vmm_torch.send_stats()``. A send whose payload goes nowhere (its message failed to pickle,
  or it came after an error payload, or ``Queue.put``'s dry run made it) is withdrawn at once.
  No ``ipc_collect()`` is needed.
- **In place.** A tensor travels where it lies, as with PyTorch: it keeps its address, and
  its receiver maps the physical chunks its storage spans, with the bytes of any other tensor
  in them (as a receiver of PyTorch's IPC maps a whole ``cudaMalloc`` segment). Free space in
  those chunks is not reused while a receiver maps them; it comes back once every receiver
  has released them. Tensors that share a storage arrive sharing one storage.
- **Isolation, on request.** In a pool made with ``isolate_sends=True`` (``enable()``,
  ``Pool``, ``VMM_TORCH_ENABLE=isolate_sends=1``) a tensor that shares a physical chunk with
  another live tensor is first moved into chunks of its own (copied on the current stream, its
  storage swapped; its views follow, its address changes) so that the receiver sees no other
  tensor's bytes. The move happens in the sending thread: ``Queue.put`` finds every tensor
  pickling will reach (a dry run of pickle) and moves those that need it before handing the
  object to its feeder thread, which never moves one.
- **Ordering.** The receiver reads what was written before the send: ``Queue.put`` records
  an event on the sending thread's current stream, which the feeder thread waits for before
  it exports (the sending thread goes on); where the caller pickles (pipes, ``SimpleQueue``,
  ``Process`` arguments) the current stream is synchronized.
- **Forwarding.** A received vmm tensor can be sent on (A -> B -> C): C maps A's memory through
  B's handles, with the same lifetime guarantee.
- **Forked children.** A forked child (a DataLoader worker) never exports memory of a pool its
  parent made (the library's fork guard): it sends such a CPU tensor or storage as PyTorch
  does (PyTorch's reducer moves the child's storage into shared memory).
- **Exit.** A process waits at exit (after its queues are flushed) up to 10 s
  (VMM_SEND_EXIT_WAIT_S) for the receivers of its sends, since its memory goes with it; not
  for those of a queue whose join was cancelled (``Queue.cancel_join_thread``, as a
  DataLoader worker does when its loader shuts down) nor of a terminated Pool's unread
  tasks: their holds are withdrawn once multiprocessing has joined the process's children.
- **No silent loss.** A tensor that cannot travel (a pool with ``handle_type="none"``, a
  non-leaf tensor that requires grad) fails in ``Queue.put`` with a clear error where the
  object is a tensor or holds tensors in lists, tuples and dicts (``Queue.put`` checks them
  once the reducers are installed); anything else that fails in a queue's feeder thread is
  delivered to the receiver as that error, raised by ``queue.get()``, never dropped.

The receiver needs nothing installed: unpickling imports the rebuild function's module. A
receiving process that has not used CUDA yet enables vmm first (unless VMM_TORCH_ENABLE=0),
so that its own later ``vmm_torch.enable()`` still works.
"""

from __future__ import annotations

import io
import logging
import multiprocessing.pool
import multiprocessing.queues
import multiprocessing.reduction
import multiprocessing.util
import os
import pickle
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from . import _lib, sharing
from ._signatures import (SEND_IMPORT, SEND_IN_PLACE, SEND_NOT_EXPORTABLE, SEND_NOT_VMM,
                          SEND_RELOCATE)

#: The rebuild function of the payload (kept under its former name).
rebuild_tensor_from_bytes = sharing.rebuild_tensor

_installed = False
_install_lock = threading.Lock()

#: The name multiprocessing gives a Queue's feeder thread: what it fails to pickle, it prints
#: and drops.
_FEEDER_THREAD = sharing.FEEDER_THREAD

#: How long a process waits at exit for the receivers of its sends (VMM_SEND_EXIT_WAIT_S).
EXIT_WAIT_VARIABLE = "VMM_SEND_EXIT_WAIT_S"
DEFAULT_EXIT_WAIT_S = 10.0

Reduction = Tuple[Callable[..., Any], Tuple[Any, ...]]
_log = logging.getLogger("vmm_torch")


#: PyTorch's own torch.multiprocessing.reductions.reduce_tensor, kept when install_reducers
#: puts vmm's in its place.
_torch_reducer: Optional[Callable[[torch.Tensor], Reduction]] = None


def _torch_reduce_tensor(tensor: torch.Tensor) -> Reduction:
    if _torch_reducer is not None:
        return _torch_reducer(tensor)
    from torch.multiprocessing import reductions

    return reductions.reduce_tensor(tensor)


def _non_leaf_error(tensor: torch.Tensor) -> RuntimeError:
    """The error PyTorch's reducer raises for a non-leaf tensor that requires grad, word for
    word from the torch installed (programs match its text: RL collectors, trainers that fall
    back to detach()), taken from that reducer, which checks this before it touches memory."""
    try:
        _torch_reduce_tensor(tensor)
    except RuntimeError as e:
        return e
    return RuntimeError(  # a torch whose reducer does not refuse it: vmm's own words
        "cannot send a non-leaf tensor that requires grad to another process (autograd "
        "graphs do not cross processes); send tensor.detach() instead")


def _on_feeder_thread() -> bool:
    return threading.current_thread().name == _FEEDER_THREAD


def _parts(tensor: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """The plain strided tensors that a tensor of another kind is made of (a nested tensor's
    buffer, or a jagged one's inner tensors; a sparse tensor's indices and values), or None
    for a plain strided tensor.
    PyTorch's reducer sends such a tensor as its parts, each through the reducer that
    torch.multiprocessing.reductions names, vmm's once install_reducers ran."""
    if tensor.is_nested:
        if tensor.layout == getattr(torch, "jagged", None) and hasattr(tensor,
                                                                     "__tensor_flatten__"):
            # The NestedTensor subclass pickles itself through its inner tensors (values,
            # offsets, lengths: the tensors themselves, not views of them).
            names, _ = tensor.__tensor_flatten__()
            return [getattr(tensor, name) for name in names]
        return [tensor.values()]
    layout = tensor.layout
    if layout == torch.strided:
        return None
    if layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return []  # no memory of vmm's (a layout of another device)


def _reduce(tensor: torch.Tensor,
            fallback: Callable[[torch.Tensor], Reduction] = _torch_reduce_tensor) -> Reduction:
    """A send of `tensor` if it is vmm memory, else fallback(tensor) (PyTorch's reducer of what
    is being pickled: the tensor, or the storage `tensor` views)."""
    if _parts(tensor) is not None:
        # Nested and sparse tensors: PyTorch's reducer sends their parts through vmm's.
        return fallback(tensor)
    in_feeder = _on_feeder_thread()
    module = sharing.cuda_module() if in_feeder and tensor.is_cuda else None
    if module is not None:
        # The common case in one call: the put's events waited for, the memory exported.
        kind, data, ticket = module.export_send(tensor)
        if data is not None:
            _note_feeder()
            return (sharing.rebuild_tensor,
                    sharing.sent_payload(tensor, data, ticket,
                                         isinstance(tensor, torch.nn.Parameter),
                                         tensor.requires_grad))
        if kind in (SEND_IN_PLACE, SEND_IMPORT):
            _lib.raise_last_error("send")
        if kind == SEND_NOT_VMM:
            return fallback(tensor)
        # Otherwise the steps below, which send it through PyTorch or raise why it cannot go.
    base = sharing.storage_address(tensor)
    kind = sharing.send_kind(base)
    if kind == SEND_NOT_VMM:
        return fallback(tensor)
    requires_grad = tensor.requires_grad
    if requires_grad and not tensor.is_leaf:
        raise _non_leaf_error(tensor)
    if kind == SEND_RELOCATE and in_feeder:
        # A pool that isolates sends. Moving it here would race with its owner, who may still
        # write to it (put returned). Queue.put prepares every tensor pickle reaches, so only
        # a tensor that gained a neighbour otherwise (a put that bypassed the patched method,
        # a tensor made while pickling), or one of a pool that the parent of this forked
        # process made (which put could not move: sent as PyTorch sends it), gets here.
        error = _lib.VmmError(
            "this tensor shares a physical chunk with other tensors and must move to memory of "
            "its own before it is sent (its pool isolates sends), which Queue.put does in the "
            "sending thread; it was not prepared there (was the queue's put bypassed?); send "
            "tensor.clone()",
            "FAILED_PRECONDITION")
        if sharing.refused_after_fork(error, tensor, kind):
            return fallback(tensor)
        raise error
    try:
        payload = sharing.send_payload(tensor, base, kind,
                                       isinstance(tensor, torch.nn.Parameter), requires_grad)
    except _lib.VmmError as error:
        if not sharing.refused_after_fork(error, tensor, kind):
            raise
        # A forked child (a DataLoader worker) sending memory of its parent's pool, which it
        # cannot export: as PyTorch sends it (a copy in shared memory; the parent's is kept).
        return fallback(tensor)
    if in_feeder:
        _note_feeder()
    else:
        _note_pool_task_handler()
    return (sharing.rebuild_tensor, payload)


def _note_feeder() -> None:
    """Notes the queue feeder thread sending now (the exit wait lets it flush)."""
    thread = threading.current_thread()
    if thread not in _vmm_feeders:
        _take_send_token(thread)
        _vmm_feeders.add(thread)


def _note_pool_task_handler() -> None:
    """Notes the send token of a multiprocessing Pool's task handler thread (the one thread
    that pickles a pool's tasks) at its first vmm send (the hold it just made has the same
    token): its sends are given up at exit once it has ended, as a terminated pool's tasks
    are (see _cancelled_tokens_now)."""
    thread = threading.current_thread()
    if (_SEND_TOKEN not in thread.__dict__
            and getattr(thread, "_target", None) is multiprocessing.pool.Pool._handle_tasks):
        _take_send_token(thread)
        _pool_task_tokens[thread.__dict__[_SEND_TOKEN]] = weakref.ref(thread)


def _take_send_token(thread: threading.Thread) -> None:
    """Gives the feeder thread `thread` (the calling thread) its send token, before its first
    message is pickled (what the exit wait withdraws if its queue's join was cancelled, even
    if it held a send and was abandoned before its reducer returned). Noted among the
    cancelled feeders' tokens if the thread is one; _note_if_cancelled does the same the
    other way round (each sets its own mark before it reads the other's)."""
    if _SEND_TOKEN not in thread.__dict__:
        token = sharing.send_thread_token()
        setattr(thread, _SEND_TOKEN, token)
        if thread in _cancelled_feeders:
            _cancelled_tokens.add(token)


def reduce_tensor(tensor: torch.Tensor) -> Reduction:
    """ForkingPickler reducer: a vmm send for vmm memory (pool blocks and imports), else
    PyTorch's reducer. In a queue's feeder thread a CUDA tensor takes one call of vmm's CUDA
    module where it was built (send_steps.h: the put's events waited for and the export; the
    GIL goes only while an event still runs); the other C calls keep the GIL (see
    vmm_torch._lib). There, a
    failure becomes a payload that raises it in the receiver (the feeder would print and drop
    it); elsewhere it raises in the caller."""
    return _reduced(lambda: _reduce(tensor))


def _torch_reduce_storage(storage: Any) -> Reduction:
    """PyTorch's reducer of `storage`'s class, as install_reducers found it registered."""
    reducer = _torch_storage_reducers.get(type(storage))
    if reducer is None:
        from torch.multiprocessing import reductions

        reducer = reductions.reduce_storage
    return reducer(storage)


def reduce_storage(storage: Any) -> Reduction:
    """ForkingPickler reducer of untyped storages: a vmm send of all their bytes where they are
    vmm memory (what a tensor over them would make, with the same hold for the receiver), which
    the receiver unpickles as the untyped storage over the memory it maps; else PyTorch's
    reducer. TypedStorage and the legacy typed storages (torch.FloatStorage) reach it:
    PyTorch's reducers of those pickle the untyped storage they wrap."""
    view = sharing.storage_view(storage)
    if view is None:
        return _torch_reduce_storage(storage)

    def send() -> Reduction:
        function, args = _reduce(view, lambda _: _torch_reduce_storage(storage))
        if function is sharing.rebuild_tensor:
            return sharing.rebuild_storage, args
        return function, args

    return _reduced(send)


#: The rebuild functions of sends (their payload holds the ticket).
_SEND_REBUILDS = (sharing.rebuild_tensor, sharing.rebuild_storage)


def _reduced(reduce: Callable[[], Reduction]) -> Reduction:
    """reduce(), its send noted in the message being pickled; in a queue's feeder thread, a
    failure becomes a payload that raises it in the receiver (see reduce_tensor)."""
    message = getattr(_pickling, "message", None)
    made = len(message.tickets) if message is not None else 0
    try:
        return _note_send(reduce())
    except Exception as error:
        if not _on_feeder_thread():
            raise
        if message is not None:  # sends the failed reduction made (its parts) go nowhere
            _withdraw(message.tickets[made:])
            del message.tickets[made:]
            if message.error_at is not None:  # an error payload among them went too
                message.error_at = min(message.error_at, made)
        _note_error_payload()
        return (sharing.raise_send_error,
                (type(error).__name__, str(error), getattr(error, "code", None)))


# --- A message that fails to pickle withdraws its sends ---------------------------------------

_pickling = threading.local()


class _Message:
    """The sends made while one message is pickled, in pickling order (which is the order the
    receiver unpickles them in), and how many came before its first error payload. A dry
    run's message (Queue.put's, pickled to nowhere) also takes the sends of the messages
    pickled inside it, which go nowhere either."""

    def __init__(self, dry: bool = False) -> None:
        self.tickets: List[bytes] = []
        self.error_at: Optional[int] = None
        self.dry = dry


def _note_send(reduction: Reduction) -> Reduction:
    """Notes the ticket of a send just made while a message is pickled, so that the message's
    failure can withdraw it."""
    message = getattr(_pickling, "message", None)
    if message is not None and reduction[0] in _SEND_REBUILDS:
        message.tickets.append(reduction[1][len(sharing.PAYLOAD_FIELDS)])  # the ticket
    return reduction


def _note_error_payload() -> None:
    """A queue's feeder thread put an error payload in the message being pickled: its receiver
    raises there, and never imports the sends that come after it."""
    message = getattr(_pickling, "message", None)
    if message is not None and message.error_at is None:
        message.error_at = len(message.tickets)


def _pickled_or_withdrawn(pickle_it: Callable[[], Any]) -> Any:
    """Runs pickle_it(), which pickles one message into memory; if it raises, withdraws the
    sends made for that message: its payload never leaves, so no receiver will acknowledge
    them, and their memory comes back now rather than at the end of their lease. Likewise the
    sends placed after an error payload (the feeder thread's), which its receiver never
    reaches. A message pickled inside another one (a reducer that sends something itself)
    keeps its own sends: once pickled they may have left, whatever becomes of the outer
    message; but inside a dry run nothing leaves, and the dry run withdraws them."""
    outer = getattr(_pickling, "message", None)
    message = _pickling.message = _Message(dry=outer is not None and outer.dry)
    try:
        result = pickle_it()
    except BaseException:
        _withdraw(message.tickets)
        raise
    finally:
        _pickling.message = outer
    if message.error_at is not None:  # the receiver stops at the error: the rest goes nowhere
        _withdraw(message.tickets[message.error_at:])
        del message.tickets[message.error_at:]
    if message.dry:
        outer.tickets.extend(message.tickets)
    return result


def _withdraw(tickets: List[bytes]) -> None:
    for ticket in tickets:
        try:
            sharing.cancel_send(ticket)
        except Exception as error:  # noqa: BLE001 (received meanwhile: left to its receiver)
            _log.debug("vmm_torch: withdrawing a send: %s", error)


def _withdrawing_init(init: Callable[..., Any]) -> Callable[..., Any]:
    """ForkingPickler.__init__, noting whether the pickler writes into memory."""

    def init_noting_file(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        file = args[0] if args else kwargs.get("file")
        self._vmm_into_memory = isinstance(file, io.BytesIO)

    init_noting_file.__wrapped__ = init  # type: ignore[attr-defined]
    init_noting_file._vmm_withdrawing = True  # type: ignore[attr-defined]
    return init_noting_file


def _withdrawing_dump(dump: Callable[..., Any]) -> Callable[..., Any]:
    """ForkingPickler(file).dump, withdrawing the sends of a message that fails to pickle
    (_pickled_or_withdrawn) where it pickles into memory: ForkingPickler.dumps (queues' feeder
    threads, pipes, SimpleQueue), torch.multiprocessing's connections (its Queue and Pool),
    multiprocessing.reduction.dump (a spawned Process's arguments). Into a file or a pipe,
    part of a failed message may have left, so nothing is withdrawn there."""

    def dump_withdrawing(self: Any, obj: Any) -> Any:
        if not getattr(self, "_vmm_into_memory", False):
            # Into a file or a pipe: its sends may leave as they are written, so no message
            # (not even one this dump is nested in) may withdraw them.
            outer = getattr(_pickling, "message", None)
            _pickling.message = None
            try:
                return dump(self, obj)
            finally:
                _pickling.message = outer
        if not _on_feeder_thread():
            return _pickled_or_withdrawn(lambda: dump(self, obj))
        # A queue's feeder: noted while it pickles (the exit wait waits for that before it
        # withdraws the sends of a queue whose join was cancelled), and stopped there once the
        # exit wait has abandoned its queue (the feeder ends quietly on an error at exit).
        thread = threading.current_thread()
        outermost = thread not in _pickling_feeders  # a reducer may pickle inside a message
        if outermost:
            _take_send_token(thread)
            _pickling_feeders.add(thread)
        try:
            if thread in _abandoned_feeders:
                # The feeder ends on this error, dropping the message: its tensors would be
                # freed on this thread, whose GIL release inside PyTorch's tensor deallocation
                # aborts the process once the interpreter finalises ("terminate called without
                # an active exception"). Kept: the main thread frees them, or the exit does.
                _abandoned_messages.append(obj)
                raise RuntimeError("vmm_torch: this queue's join was cancelled and the process "
                                   "is exiting: nothing more is sent")
            return _pickled_or_withdrawn(lambda: dump(self, obj))
        finally:
            if outermost:
                thread.__dict__[_DUMP_ENDED] = time.monotonic()
                _pickling_feeders.discard(thread)

    dump_withdrawing.__wrapped__ = dump  # type: ignore[attr-defined]
    dump_withdrawing._vmm_withdrawing = True  # type: ignore[attr-defined]
    return dump_withdrawing


def _patch_dumps() -> None:
    init = ForkingPickler.__init__
    if not getattr(init, "_vmm_withdrawing", False):
        ForkingPickler.__init__ = _withdrawing_init(init)  # type: ignore[method-assign]
    dump = ForkingPickler.dump
    if not getattr(dump, "_vmm_withdrawing", False):
        ForkingPickler.dump = _withdrawing_dump(dump)  # type: ignore[method-assign]


# --- Queue.put: errors in the caller ---------------------------------------------------------


class _Preparer(pickle.Pickler):
    """Pickles an object to nowhere to find every tensor pickle will reach (through containers,
    attributes, slots, __getstate__ and __reduce__ alike), preparing each vmm tensor for its
    send and pickling it as nothing. Objects that only ForkingPickler knows how to pickle
    (connections, sockets, storages: their reducers duplicate fds or move memory) are skipped,
    also as nothing, so the dry run has no side effect but the tensors' preparation."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found_vmm = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if _prepare_tensor(obj):
                self.found_vmm = True
            return _NOTHING
        if isinstance(obj, _STORAGE_TYPES):  # sent as a tensor over its bytes (reduce_storage)
            view = sharing.storage_view(obj)
            if view is not None and _prepare_tensor(view):
                self.found_vmm = True
            return _NOTHING
        kind = type(obj)
        if kind in ForkingPickler._extra_reducers or kind.__module__ == "numpy":
            return _NOTHING  # numpy arrays: no tensor inside, and pickling one copies it
        return NotImplemented


#: The storage classes: untyped, and typed (TypedStorage and the legacy typed ones).
_STORAGE_TYPES = (torch.UntypedStorage, torch.TypedStorage)


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


_NOTHING = (int, ())

#: The kind vmm's CUDA module gives a non-leaf tensor that requires grad (send_steps.h).
_NON_LEAF = -1


_SCALARS = (str, bytes, bytearray, int, float, bool, type(None))


def _flat(obj: Any) -> bool:
    """Whether `obj` is a plain tuple or list (not a subclass, which may pickle otherwise)
    of at most 16 items, each a plain tensor or a plain scalar (no subclass of either: one
    may carry tensors in its attributes)."""
    if type(obj) not in (tuple, list) or len(obj) > 16:
        return False
    return all(type(item) is torch.Tensor or type(item) in _SCALARS for item in obj)


#: The plain containers _plain walks (exact types: a subclass may pickle otherwise).
_CONTAINERS = (tuple, list, dict, set, frozenset)
#: How many items _plain looks at before it leaves an object to the dry run.
PLAIN_ITEMS_CHECKED = 4096


def _plain(obj: Any) -> bool:
    """Whether `obj` is plain data that cannot hold a tensor: scalars (str, bytes, int, float,
    bool, None) and tuples, lists, dicts, sets and frozensets of them, nested, all of exactly
    those types, at most PLAIN_ITEMS_CHECKED items in all (beyond, not known: False). Looked
    at without pickling, so that Queue.put runs no object's pickling code twice for it."""
    pending = [obj]
    budget = PLAIN_ITEMS_CHECKED
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if kind not in _CONTAINERS:
            return False
        budget -= len(item) * (2 if kind is dict else 1)
        if budget < 0:
            return False
        pending.extend(item)  # a dict's keys
        if kind is dict:
            pending.extend(item.values())
    return True


def prepare_send(obj: Any) -> bool:
    """What Queue.put does before it hands `obj` to the queue's feeder thread, for every tensor
    pickling `obj` reaches: raises what sending it would raise (RuntimeError for a non-leaf
    tensor that requires grad, VmmError for memory of a pool that cannot export); in a pool
    that isolates sends, moves a vmm tensor that shares a physical chunk to memory of its own —
    here in the caller's thread and on its current stream, where the owner's work is ordered —
    and marks the chunks of one alone in them, so that nothing lands beside it before the
    feeder sends it. Then, for CUDA tensors,
    records an event on the current stream, which the feeder thread waits for before the send
    goes, so that the receiver reads what was written before put.
    Last, if this process's unacknowledged sends hold more than the send budget, waits while
    their receivers acknowledge (sharing.set_send_budget). An object that cannot be pickled is
    left to the feeder (which reports it as before). Tensors and flat tuples and lists of
    tensors and scalars are prepared without pickling, and plain data (_plain) is known to hold
    none; in any other object a dry run of pickle finds them (so its __getstate__ and
    __reduce__ run here, and again in the feeder thread).
    Returns whether `obj` holds vmm tensors."""
    if type(obj) in _SCALARS:
        return False
    if isinstance(obj, torch.Tensor):
        found = _prepare_tensor(obj)  # the common case, without a pickler's round
    elif _flat(obj):
        # A tuple or list of tensors and scalars: no pickler's round either.
        found = False
        for item in obj:
            if isinstance(item, torch.Tensor) and _prepare_tensor(item):
                found = True
    elif _plain(obj):
        return False  # plain data: no tensor to prepare, and no dry run
    else:
        preparer = _Preparer()
        # The dry run pickles to nowhere: a send some object's own reducer makes meanwhile
        # (calling reduce_tensor itself, or pickling a message of its own) goes nowhere
        # either, and is withdrawn; the object then holds vmm memory all the same.
        outer = getattr(_pickling, "message", None)
        message = _pickling.message = _Message(dry=True)
        try:
            preparer.dump(obj)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            pass  # not picklable: the feeder thread fails on it as it would without vmm
        finally:
            _pickling.message = outer
            _withdraw(message.tickets)
        found = preparer.found_vmm or bool(message.tickets)
    if found:
        sharing.wait_for_send_room()
    return found


def _prepare_tensor(tensor: torch.Tensor) -> bool:
    """Prepares one tensor (see prepare_send); whether it is vmm memory. A CUDA tensor of
    memory that goes as it is takes one call of vmm's CUDA module where it was built."""
    parts = _parts(tensor)
    if parts is not None:  # sent as its parts (_reduce): each is prepared
        return any([_prepare_tensor(part) for part in parts])
    module = sharing.cuda_module() if tensor.is_cuda else None
    if module is not None:
        kind, base = module.prepare_send(tensor)
        if kind in (SEND_IN_PLACE, SEND_IMPORT):
            return True  # its ready event is recorded
    elif tensor.requires_grad and not tensor.is_leaf:
        kind, base = _NON_LEAF, 0
    else:
        base = sharing.storage_address(tensor)
        kind = sharing.send_kind_marked(base)
    if kind == _NON_LEAF:
        raise _non_leaf_error(tensor)
    if kind == SEND_NOT_VMM:
        return False
    if kind == SEND_NOT_EXPORTABLE:
        sharing.send_payload(tensor, 0, SEND_NOT_EXPORTABLE)  # raises the one message
    elif kind == SEND_RELOCATE:
        try:
            base = sharing.relocate_storage(tensor, base)
        except _lib.VmmError as error:
            if not sharing.refused_after_fork(error, tensor, kind):
                raise
            return False  # its parent's pool: the reducer sends it as PyTorch does
    if tensor.is_cuda:
        # What the current stream wrote before put: the feeder thread waits for it before the
        # send goes (sharing.wait_until_ready), this thread goes on.
        sharing.record_ready(tensor, base)
    return True


_original_puts: Dict[type, Callable[..., Any]] = {}


def _checked(put: Callable[..., Any]) -> Callable[..., Any]:
    def checked_put(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        if prepare_send(obj):
            _vmm_queues.add(self)
        try:
            return put(self, obj, *args, **kwargs)
        finally:
            _note_if_cancelled(self)  # put starts the feeder

    checked_put.__wrapped__ = put  # type: ignore[attr-defined]
    checked_put.__doc__ = put.__doc__
    return checked_put


def _note_if_cancelled(queue: Any) -> None:
    """Remembers the feeder thread of a queue of vmm sends whose join was cancelled, for the
    exit wait, which then gives its sends up even if the program has dropped the queue (and
    the feeder has ended) by then: the thread while it lives, and its send token, a number,
    for good (taken at its first message, _take_send_token)."""
    thread = getattr(queue, "_thread", None)
    if (thread is not None and getattr(queue, "_joincancelled", False)
            and queue in _vmm_queues):
        _cancelled_feeders.add(thread)
        token = thread.__dict__.get(_SEND_TOKEN)
        if token is not None:
            _cancelled_tokens.add(token)


def _noting_cancel(cancel: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def cancel_join_thread(self: Any) -> Any:
        try:
            return cancel(self)
        finally:
            _note_if_cancelled(self)  # a feeder already running (puts after it: checked_put)

    cancel_join_thread.__wrapped__ = cancel  # type: ignore[attr-defined]
    cancel_join_thread.__doc__ = cancel.__doc__
    cancel_join_thread._vmm_noting = True  # type: ignore[attr-defined]
    return cancel_join_thread


def _patch_queue_puts() -> None:
    """Queue.put (and JoinableQueue.put) pickle in a feeder thread, too late to fail in the
    caller or to move a tensor safely: they prepare the tensors first (prepare_send).
    Queue.cancel_join_thread and every put note a cancelled queue's feeder (the exit wait)."""
    for queue_type in (multiprocessing.queues.Queue, multiprocessing.queues.JoinableQueue):
        put = queue_type.__dict__.get("put")
        if put is None or queue_type in _original_puts:
            continue
        _original_puts[queue_type] = put
        queue_type.put = _checked(put)
    queue_type = multiprocessing.queues.Queue
    cancel = queue_type.__dict__.get("cancel_join_thread")
    if cancel is not None and not getattr(cancel, "_vmm_noting", False):
        queue_type.cancel_join_thread = _noting_cancel(cancel)


def exit_wait_seconds() -> float:
    """VMM_SEND_EXIT_WAIT_S as seconds (default 10; 0 waits not at all)."""
    text = os.environ.get(EXIT_WAIT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_EXIT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        _log.warning("vmm_torch: %s=%r is not a number of seconds; using %s", EXIT_WAIT_VARIABLE,
                     text, DEFAULT_EXIT_WAIT_S)
        return DEFAULT_EXIT_WAIT_S
    return value


def _wait_for_receivers() -> None:
    """At exit, once multiprocessing has told the queues' feeder threads to finish (their close
    finalizers, priority 10, run first) and before it terminates daemon children (which may be
    the receivers): lets the feeders flush, then gives the receivers of this process's sends
    time to import them, since the memory goes with the process. Not those of a queue whose
    join was cancelled (_give_up_cancelled_queues, once the children are joined)."""
    _ending_on_signal(_wait_until_received)


def _give_up_cancelled_queues() -> None:
    """At exit, after multiprocessing has terminated daemon children and joined the others
    (readers of a cancelled queue among them, which get what its feeder flushes meanwhile, as
    without vmm): gives up the sends of the queues whose join was cancelled."""
    _ending_on_signal(_withdraw_cancelled)


def _ending_on_signal(step: Callable[[], None]) -> None:
    """Runs an exit step. A signal handler that raises meanwhile (SIGTERM's calling sys.exit,
    Ctrl-C) ends it; multiprocessing's exit goes on (daemon children terminated, children
    joined, the other finalizers), and in a multiprocessing child the exception is raised
    again after that (_raise_again, registered with the steps: multiprocessing runs only the
    finalizers registered before it began its last pass), so that it sets the exit code as
    the handler meant. In any other process the exit code is fixed by then, and it is
    dropped (raised from an exit handler it would only be printed)."""
    global _stopped_by
    try:
        step()
    except (SystemExit, KeyboardInterrupt) as stop:
        if _stopped_by is None and multiprocessing.parent_process() is not None:
            _stopped_by = stop


def _raise_again() -> None:
    global _stopped_by
    stop, _stopped_by = _stopped_by, None
    if stop is not None:
        raise stop


def _live_vmm_queues() -> List[Any]:
    return [q for q in (ref() for ref in list(_vmm_queues.data)) if q is not None]


def _cancelled_now(queues: List[Any]) -> Set[threading.Thread]:
    """The feeder threads of queues of vmm sends whose join was cancelled (Queue.cancel_join_
    thread: the program lets the process exit without flushing that queue and gives up what
    it holds, as a DataLoader worker does with its prefetched batches when its loader shuts it
    down): of the live queues, and those noted before (the queue may be gone)."""
    cancelled = {q._thread for q in queues
                 if getattr(q, "_joincancelled", False) and getattr(q, "_thread", None)}
    cancelled.update(list(_cancelled_feeders))
    return cancelled


def _cancelled_tokens_now(cancelled: Set[threading.Thread]) -> Set[int]:
    tokens = set(_cancelled_tokens)
    tokens.update(t.__dict__[_SEND_TOKEN] for t in cancelled if _SEND_TOKEN in t.__dict__)
    # Pools' task handlers that have ended: at exit multiprocessing has terminated every
    # pool before the exit wait (a finalizer of priority 15), and a pool terminated before
    # has no worker left to read the tasks in its pipe (a loop over Pool.imap left early
    # inside `with Pool()`: the wait took its whole 10 s, where without vmm the process
    # exits at once). A pool closed and joined leaves nothing unread.
    for token, ref in list(_pool_task_tokens.items()):
        thread = ref()
        if thread is None or not thread.is_alive():
            tokens.add(token)
    return tokens


def _held_but_cancelled() -> int:
    """This process's sends not yet acknowledged, but for those of cancelled queues (in one
    step: their feeders may still send meanwhile)."""
    return sharing.held_sends_except(_cancelled_tokens_now(_cancelled_now(_live_vmm_queues())))


def _no_child_to_join() -> bool:
    """Whether multiprocessing's exit has no child of this process to join (a daemon child is
    terminated): nothing can read a cancelled queue after the wait for receivers."""
    return not any(not p.daemon for p in multiprocessing.active_children())


def _wait_until_received() -> None:
    global _exit_deadline
    start = time.monotonic()
    deadline = _exit_deadline = start + exit_wait_seconds()
    # Snapshots in one step each (a feeder may add itself meanwhile).
    queues = _live_vmm_queues()
    feeders = {t for t in (ref() for ref in list(_vmm_feeders.data)) if t is not None}
    feeders.update(t for t in (getattr(q, "_thread", None) for q in queues) if t)
    # A cancelled queue's feeder is not joined (nor by multiprocessing), and its sends are not
    # waited for: they are given up once the children are joined (a reader of the queue that
    # is slower than that loses them, as it loses what was not flushed).
    if _no_child_to_join():
        # Given up at once (a DataLoader worker's queue), as multiprocessing's exit would
        # only terminate daemon children before the second step.
        _withdraw_cancelled()
    for thread in feeders - _cancelled_now(queues):
        if thread is not threading.current_thread() and thread.is_alive():
            thread.join(min(threading.TIMEOUT_MAX, max(0.0, deadline - time.monotonic())))
    left = _held_but_cancelled()
    while left > 0 and time.monotonic() < deadline:
        sharing.wait_for_sends(min(_CANCELLED_POLL_S, max(0.0, deadline - time.monotonic())))
        left = _held_but_cancelled()
    if left:
        _log.warning("vmm_torch: exiting with %d sent tensor(s) that no receiver has imported; "
                     "importing them will fail (keep the sender alive until they are "
                     "received, or raise %s)", left, EXIT_WAIT_VARIABLE)


def _withdraw_cancelled() -> None:
    global _gave_up
    if _gave_up:
        return  # at the wait's start (no child to join): nothing can add to it since
    _gave_up = True
    abandoned = _cancelled_now(_live_vmm_queues())
    if not abandoned:
        for token in _cancelled_tokens_now(abandoned):
            sharing.withdraw_thread_sends(token)
        return
    # The feeder's arguments hold the queue's buffer: kept, so that the messages left in it
    # are not freed on the feeder's thread as it ends (see _abandoned_messages).
    _abandoned_messages.extend(getattr(t, "_args", None) for t in abandoned
                               if t not in _abandoned_feeders)
    # Such a feeder may be blocked writing to a pipe no one reads; it is let finish the message
    # it is pickling (a thread the interpreter's finalisation stops inside PyTorch's code may
    # abort the process), for at least _ABANDON_PICKLE_S whatever the exit wait, and pickles
    # no other.
    _abandoned_feeders.update(abandoned)
    pickled_by = max(_exit_deadline, time.monotonic() + _ABANDON_PICKLE_S)
    try:
        while (any(t in _pickling_feeders for t in abandoned)
               and time.monotonic() < pickled_by):
            time.sleep(0.005)
        # A feeder frees the message it has just pickled on its own thread (multiprocessing
        # drops it there), and PyTorch's tensor deallocation lets go of the GIL: if the
        # interpreter finalises meanwhile, the thread is stopped inside it and the process
        # aborts ("terminate called without an active exception"; a DataLoader worker stopped
        # early, 1 exit in 15 on the host). Such a feeder is given _ABANDON_SETTLE_S after its
        # last message to free it.
        while time.monotonic() < pickled_by:
            ended = [t.__dict__.get(_DUMP_ENDED) for t in abandoned if t.is_alive()]
            settled_at = (max((e for e in ended if e is not None), default=0.0)
                          + _ABANDON_SETTLE_S)
            if time.monotonic() >= settled_at:
                break
            time.sleep(min(0.005, max(0.0, settled_at - time.monotonic())))
    finally:
        for token in _cancelled_tokens_now(abandoned):
            sharing.withdraw_thread_sends(token)


_exit_wait_registered = False
#: A signal handler's exception that ended an exit step in a multiprocessing child, raised
#: again at the end of multiprocessing's exit (_raise_again).
_stopped_by: Optional[BaseException] = None
#: When the exit wait ends (time.monotonic(); set as it begins), and whether the cancelled
#: queues were given up (once, in the first step or the second).
_exit_deadline = 0.0
_gave_up = False
#: How often the exit wait looks again at what is held while cancelled queues' sends are
#: (seconds).
_CANCELLED_POLL_S = 0.05
#: How long the exit wait lets an abandoned queue's feeder finish the message it is pickling,
#: at least (seconds), and how long after its last message it lets it free that message.
_ABANDON_PICKLE_S = 2.0
_ABANDON_SETTLE_S = 0.05
#: The queues' feeder threads that have sent vmm tensors, and the queues put vmm tensors in:
#: the exit wait lets their feeders flush (and no other queue's).
_vmm_feeders: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_vmm_queues: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: Feeder threads pickling now, and those of queues the exit wait abandoned (their join was
#: cancelled), which pickle nothing more.
_pickling_feeders: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_abandoned_feeders: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
#: The feeder threads of queues of vmm sends whose join was cancelled, noted at the cancel
#: and at each put, while they live, and their send tokens, kept (the queue may be gone by
#: the exit, and the thread ended): an int a feeder that sent, nothing one that did not.
_cancelled_feeders: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_cancelled_tokens: "Set[int]" = set()
#: The send tokens of multiprocessing Pools' task handler threads (weak references to them).
_pool_task_tokens: "Dict[int, weakref.ref[threading.Thread]]" = {}
#: The messages abandoned feeders stopped at, kept from being freed on their threads.
_abandoned_messages: List[Any] = []
#: The attributes of a feeder thread that hold its send token (sharing.send_thread_token) and
#: when it last finished pickling a message (time.monotonic()).
_SEND_TOKEN = "_vmm_send_token"
_DUMP_ENDED = "_vmm_dump_ended"


def _register_exit_wait() -> None:
    global _exit_wait_registered
    if not _exit_wait_registered:
        _exit_wait_registered = True
        multiprocessing.util.Finalize(None, _wait_for_receivers, exitpriority=5)
        # After the children are joined (between the finalizers of priority 0 and up and the
        # others) and the queues' own join finalizers (-5).
        multiprocessing.util.Finalize(None, _give_up_cancelled_queues, exitpriority=-10)
        multiprocessing.util.Finalize(None, _raise_again, exitpriority=-1000)


class _ForkHook:
    """What multiprocessing calls in a child it forked, after it emptied the finalizers there,
    and what os.fork calls in any child: the exit wait is registered again."""

    def __call__(self, _: object) -> None:
        global _exit_wait_registered, _gave_up
        _gave_up = False
        # The parent's threads do not exist here (a feeder pickling at the fork would hold
        # the exit wait for good).
        for threads in (_vmm_feeders, _pickling_feeders, _abandoned_feeders,
                        _cancelled_feeders):
            threads.clear()
        _cancelled_tokens.clear()
        _pool_task_tokens.clear()
        _exit_wait_registered = False
        if _installed:
            _register_exit_wait()


_fork_hook = _ForkHook()
multiprocessing.util.register_after_fork(_fork_hook, _fork_hook)
# A child made by os.fork() runs none of multiprocessing's after-fork hooks, and the
# finalizer registered in the parent is skipped there (a Finalize runs only in the process
# that made it): registered again at the fork itself. In a child multiprocessing forks, its
# bootstrap then empties the finalizers and the hook above registers it once more.
os.register_at_fork(after_in_child=lambda: _fork_hook(None))


def install_reducers() -> None:
    """Makes torch.multiprocessing carry tensors of vmm memory as vmm sends (CUDA tensors of
    the enabled allocator or of an explicit Pool, CPU tensors of host pools, and tensors
    received from another process), and makes ``Queue.put`` check what cannot travel.
    ``torch.multiprocessing.reductions.reduce_tensor`` becomes vmm's reducer too (for other
    tensors it is PyTorch's), and storages of vmm memory travel as sends (reduce_storage).
    Idempotent; affects this process's pickling only."""
    global _installed, _torch_reducer
    import torch.multiprocessing  # noqa: F401  (registers PyTorch's reducers first)
    from torch.multiprocessing import reductions

    with _install_lock:
        _lib.load()  # now, not in the first reducer call (a queue's feeder thread)
        for tensor_type in (torch.Tensor, torch.nn.Parameter):
            ForkingPickler.register(tensor_type, reduce_tensor)
        # Storages of vmm memory: PyTorch's reducer would copy a CPU one into new shared memory
        # (the receiver's writes would never reach the sender) and refuse a CUDA one. Where
        # PyTorch registers its reduce_storage (untyped storages; its reducers of the typed
        # ones pickle the untyped storage they wrap, so reach vmm's too).
        for storage_type in _untyped_storage_types():
            registered = ForkingPickler._extra_reducers.get(storage_type)
            if registered is not None and registered is not reduce_storage:
                _torch_storage_reducers[storage_type] = registered
            ForkingPickler.register(storage_type, reduce_storage)
        # Programs that call PyTorch's reducer themselves (handing weights to another process
        # as `func, args = reduce_tensor(t)`, then `func(*args)` there) get vmm's: PyTorch's
        # would ask the allocator for a CUDA IPC handle, which a pluggable allocator has not.
        if reductions.reduce_tensor is not reduce_tensor:
            _torch_reducer = reductions.reduce_tensor
            reductions.reduce_tensor = reduce_tensor
        _patch_queue_puts()
        _patch_dumps()
        _register_exit_wait()
        _installed = True


#: PyTorch's reducers of the untyped storage classes, as install_reducers found them.
_torch_storage_reducers: Dict[type, Callable[[Any], Reduction]] = {}


def _untyped_storage_types() -> List[type]:
    """The untyped storage classes of this torch (those PyTorch gives its reduce_storage:
    torch.multiprocessing.reductions.init_reductions)."""
    found = [t for t in getattr(torch, "_storage_classes", ()) if t.__name__ == "UntypedStorage"]
    if torch.UntypedStorage not in found:
        found.append(torch.UntypedStorage)
    return found


def reducers_installed() -> bool:
    """Whether install_reducers() ran in this process."""
    return _installed

