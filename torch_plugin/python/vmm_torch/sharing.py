"""Sharing tensors between processes as buffer descriptors.

Exporter::

    shared = vmm_torch.export_tensor(t)     # t lives in a vmm pool
    send(pickle.dumps(shared))              # any transport; keep t alive until imported

Importer (any process)::

    t = pickle.loads(received).open()       # a tensor over the same memory

A SharedTensor's descriptor pins nothing: the exporter must keep the tensor alive until every
importer has opened it. After that the importer's mapping is its own (the exporter may free or
exit). A *send* (:func:`send_payload`, what torch.multiprocessing uses once
``vmm_torch.install_reducers()`` ran) is held by the sender until its receiver has imported it
and acknowledged the send's ticket, or until the send's lease ends (``set_send_lease``; 600 s
by default): the sender may drop the tensor at once.

The payload: a shared tensor travels as one flat tuple, the same for a pickled
:class:`SharedTensor` and for a tensor sent through torch.multiprocessing
(``vmm_torch.reductions``)::

    (descriptor, dtype, shape, stride, storage_offset, device, parameter, requires_grad
     [, ticket])

- ``descriptor``: the canonical descriptor bytes as vmm_export returned them; the receiver
  hands them straight to vmm_import, which decodes and checks them once, in C++;
- ``dtype``: a stable code (``vmm_torch._tensors.dtype_code``: an index into a fixed table,
  or the dtype's name for dtypes outside it, looked up and checked to be a torch.dtype);
- ``shape``, ``stride`` (elements), ``storage_offset`` (elements): the view;
- ``device``: "cpu" (a tensor of vmm's host backend) or "cuda:N" (exported from CUDA device
  N; the importer maps on that device, found by the UUID the descriptor carries);
- ``parameter``, ``requires_grad``: rebuild as torch.nn.Parameter / with requires_grad;
- ``ticket`` (sends only): 64 bytes the receiver acknowledges to the sender once it has
  imported the descriptor (or failed to), so that the sender lets go of the memory;
- ``conj``, ``neg`` (only where the tensor has one of these bits set: ``is_conj()``, a lazy
  ``conj()`` view; ``is_neg()``): bools, set again on the rebuilt tensor over the same
  memory, so that it holds the sender's values. They follow the ticket, which is None in a
  SharedTensor's payload. Payloads without them keep the fields above, so earlier versions
  read them; a payload with them is refused by earlier versions (too many fields), never
  rebuilt without the bits (such a refused send is not acknowledged: its sender holds the
  memory until the send's lease ends). (PyTorch's torch.multiprocessing reducer drops both bits,
  CPU and CUDA alike.)

:func:`rebuild_tensor` turns a payload into a tensor (it is what unpickling a
torch.multiprocessing payload calls, and what ``SharedTensor.open()`` runs); the view is
checked against the imported buffer (a received payload is hostile input).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import math
import multiprocessing.util
import os
import re
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
# At import, not in received_storage: a tensor opened in a __del__ that the interpreter's
# finalisation runs found sys.modules emptied (ImportError).
from torch.multiprocessing.reductions import StorageWeakRef

from . import _cuda, _lib, allocator
from ._streams import pool_stream
from .allocator import send_stats  # noqa: F401  (re-exported: sends are this module's)
from ._devices import parse_device
from ._signatures import (BACKEND_CUDA, BACKEND_DEFAULT, BACKEND_HOST, BACKENDS,
                          FAILED_PRECONDITION, SEND_IMPORT, SEND_IN_PLACE, SEND_NOT_EXPORTABLE,
                          SEND_NOT_VMM, SEND_RELOCATE, TICKET_BYTES)
from ._tensors import (INT64_MAX, DtypeCode, contiguous_strides, dtype_code, dtype_from_code,
                       dtype_from_name, element_size, numel, shape_list, tensor_nbytes,
                       view_int, view_ints)
from .descriptors import BufferDescriptor, as_bytes

#: The payload's fields, in order (see the module docstring).
PAYLOAD_FIELDS: Tuple[str, ...] = ("descriptor", "dtype", "shape", "stride", "storage_offset",
                                   "device", "parameter", "requires_grad")
#: A send's payload adds the ticket.
SEND_PAYLOAD_FIELDS: Tuple[str, ...] = PAYLOAD_FIELDS + ("ticket",)
#: Both payloads of a tensor with its conjugate or negative bit set end with these (a
#: SharedTensor's with None as its ticket).
MATH_BIT_FIELDS: Tuple[str, ...] = ("conj", "neg")
Payload = Tuple[bytes, DtypeCode, Tuple[int, ...], Tuple[int, ...], int, str, bool, bool]
SendPayload = Tuple[bytes, DtypeCode, Tuple[int, ...], Tuple[int, ...], int, str, bool, bool,
                    bytes]

_log = logging.getLogger("vmm_torch")

#: The name multiprocessing gives a Queue's feeder thread (which pickles what put was given).
FEEDER_THREAD = "QueueFeederThread"
DeviceArg = Union[None, int, str, torch.device]

# Device type of the payload -> the backend that imports it.
_BACKENDS: Dict[str, int] = {"cuda": BACKEND_CUDA, "cpu": BACKEND_HOST}
_CUDA_DEVICE = re.compile(r"cuda(?::([0-9]{1,9}))?")


# --- Payload device field --------------------------------------------------------------------


def device_field(device_type: str, device_index: Optional[int] = None) -> str:
    """The payload's device text: "cpu", "cuda" or "cuda:N"."""
    if device_type == "cuda" and device_index is not None:
        return f"cuda:{int(device_index)}"
    return device_type


def parse_device_field(device: Any) -> Tuple[str, Optional[int]]:
    """(device type, CUDA index or None) of a payload's device text; ValueError for anything
    but "cpu", "cuda" and "cuda:N"."""
    if device == "cpu":
        return "cpu", None
    if isinstance(device, str):
        match = _CUDA_DEVICE.fullmatch(device)
        if match is not None:
            index = match.group(1)
            return "cuda", None if index is None else int(index)
    raise ValueError(f"device type {device!r} is not 'cuda' or 'cpu'")


# --- Storage and export ----------------------------------------------------------------------


def storage_base(t: torch.Tensor) -> Tuple[int, int]:
    """(address, nbytes) of the storage of tensor `t`."""
    base, nbytes = _lib.load().storage_info(t)
    return int(base), int(nbytes)


def storage_address(t: torch.Tensor) -> int:
    """Address of the storage of tensor `t` if it is a strided CUDA or CPU tensor, else 0.
    Cheap: tensor attributes only, no operator call, where `t` has elements."""
    if t.layout is not torch.strided or not (t.is_cuda or t.is_cpu):
        return 0
    try:
        if t.numel():  # data_ptr() is the first element's address (NULL without elements)
            return t.data_ptr() - t.storage_offset() * t.element_size()
        return storage_base(t)[0]
    except RuntimeError:  # no storage (wrapper tensors)
        return 0


def vmm_storage_address(t: torch.Tensor) -> int:
    """Address of the storage of tensor `t` if it lies in a vmm pool, else 0 (one ownership
    test, keeping the GIL)."""
    base = storage_address(t)
    return base if base and _lib.quick().vmm_owns(base) else 0


def in_vmm_pool(t: Any) -> bool:
    """Whether `t`'s storage lies in a vmm pool (the enabled allocator or an explicit pool)."""
    return isinstance(t, torch.Tensor) and vmm_storage_address(t) != 0


def export_bytes(ptr: int) -> bytes:
    """The descriptor bytes of the vmm block starting at `ptr` (vmm_export; the GIL is
    kept)."""
    out = ctypes.c_void_p()
    length = ctypes.c_size_t()
    _lib.check(_lib.quick().vmm_export(ptr, ctypes.byref(out), ctypes.byref(length)),
               "export_tensor")
    return _lib.take_buffer(out, length.value)


def math_bits(t: torch.Tensor) -> Tuple[bool, ...]:
    """The payload's trailing (conj, neg) fields of tensor `t`: () where neither bit is set."""
    conj, neg = t.is_conj(), t.is_neg()
    return (conj, neg) if conj or neg else ()


def tensor_payload(t: torch.Tensor, base: int, parameter: bool = False,
                   requires_grad: bool = False) -> Payload:
    """The payload of tensor `t`, whose storage starts at `base` in a vmm pool (exports the
    block)."""
    bits = math_bits(t)
    return (export_bytes(base), dtype_code(t.dtype), tuple(t.shape), t.stride(),
            t.storage_offset(), f"cuda:{t.get_device()}" if t.is_cuda else "cpu",
            parameter, requires_grad) + ((None,) + bits if bits else ())


# --- Sends -----------------------------------------------------------------------------------


def send_kind(base: int) -> int:
    """The vmm_send_kind of the storage starting at `base` (one call, keeping the GIL)."""
    return _lib.quick().vmm_send_kind(base) if base else SEND_NOT_VMM


def send_kind_marked(base: int) -> int:
    """send_kind of the storage at `base`, marking a block alone in its chunks so that it stays
    alone until it is sent (vmm_send_prepare; keeps the GIL)."""
    return _lib.quick().vmm_send_prepare(base) if base else SEND_NOT_VMM


def _current_stream(t: torch.Tensor) -> Optional[int]:
    """The handle of the current CUDA stream of `t`'s device (0: the legacy default stream),
    or None for a CPU tensor."""
    return int(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else None


def relocate_storage(t: torch.Tensor, base: int) -> int:
    """Moves the storage of `t` (a vmm block starting at `base` that shares a physical chunk
    with another live block) into chunks of its own, so that sending it exposes no other
    tensor's bytes; returns the new address. Call it in the thread that owns `t`: the bytes are
    copied on that thread's current stream (after the work queued there), the new block
    belongs to that stream, and the old block is freed once the copy is done (stream-ordered).
    Every view of the storage follows; anything that kept the old address (a captured CUDA
    graph, a registered buffer) does not, so a tensor is never moved during graph capture
    (RuntimeError)."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cannot send a tensor that shares a physical chunk with other "
                           "tensors while a CUDA graph is being captured (it would have to "
                           "move); send it after the capture, or send tensor.clone()")
    libs = _lib.load()
    source = libs.storage_bytes(t)
    nbytes = source.numel()
    stream = _current_stream(t)
    # The new block's stream as pools take it (an ExternalStream marked foreign: _streams).
    block_stream = pool_stream(torch.cuda.current_stream(t.device)) if t.is_cuda else None
    # With the GIL kept: a spare chunk makes it a few microseconds (pool.h), and releasing
    # the GIL lets a busy feeder thread keep it for up to the switch interval.
    ptr = _lib.check_pointer(
        libs.quick.vmm_alloc_beside(base, max(nbytes, 1), block_stream), "send")
    device = t.device if t.is_cuda else torch.device("cpu")
    try:
        donor = libs.wrap(ptr, nbytes, [nbytes], [1], 0, torch.uint8, device)
    except BaseException:
        libs.vmm.vmm_block_free(ptr)
        raise
    donor.copy_(source)
    if stream is not None:
        _lib.check(libs.quick.vmm_record_stream(base, stream), "send")
    libs.swap_storage(source, donor)  # donor now holds the old block, freed with it
    return ptr


def cuda_module() -> Any:
    """vmm's CUDA module (vmm_torch._cuda), or None where it was not built: it takes a send's
    steps in one call each (prepare_send, export_send) and keeps the ready events."""
    return _cuda.module(_lib.load())


#: Where vmm's CUDA module is missing: ready key -> the torch.cuda.Events Queue.put recorded
#: after the writes a send of that storage must carry (reductions.prepare_send), for the
#: queue's feeder thread; oldest first, at most READY_EVENTS_KEPT keys (a put whose object is
#: never pickled leaves its entry). The module keeps its own (ready_events.h).
_ready_events: "Dict[Tuple[int, int], List[torch.cuda.Event]]" = {}
_ready_lock = threading.Lock()
READY_EVENTS_KEPT = 65536


def ready_key(t: torch.Tensor, base: int) -> Tuple[int, int]:
    """What names the storage of `t` (at `base`) among the ready events: its address and its
    StorageImpl's, so that another storage at the same address while the first lives finds
    none of its events (one made after it died, where the heap reused its StorageImpl, may find
    them, and waits for them too: more than it needs, never less)."""
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return base, storage._cdata


def record_ready(t: torch.Tensor, base: int) -> None:
    """Records an event on the current stream of CUDA tensor `t`'s device (in the thread that
    put it), after the writes a send of its storage (at `base`) must carry. RuntimeError while
    that stream captures a CUDA graph."""
    module = cuda_module()
    if module is not None:
        module.record_ready(t)
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cannot send a CUDA tensor of vmm memory while the current "
                           "stream captures a CUDA graph; send it after the capture")
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    with _ready_lock:
        _ready_events.setdefault(ready_key(t, base), []).append(event)
        while len(_ready_events) > READY_EVENTS_KEPT:
            _ready_events.pop(next(iter(_ready_events)))


def _take_ready_events(t: torch.Tensor, base: int) -> "List[torch.cuda.Event]":
    with _ready_lock:
        return _ready_events.pop(ready_key(t, base), [])


def wait_until_ready(t: torch.Tensor, base: int) -> None:
    """In a queue's feeder thread: waits for the events Queue.put recorded for the storage of
    CUDA tensor `t` (at `base`; the GIL released while one still runs); without any (a put that
    bypassed the patched method, or an entry dropped), for all work on its device."""
    module = cuda_module()
    if module is not None:
        if not module.wait_ready(t):
            torch.cuda.synchronize(t.device)
        return
    events = _take_ready_events(t, base)
    if not events:
        torch.cuda.synchronize(t.device)
    for event in events:
        event.synchronize()


def discard_ready(t: torch.Tensor, base: int) -> None:
    """Forgets the events recorded for the storage of CUDA tensor `t` (at `base`): a send that
    synchronised its stream instead."""
    module = cuda_module()
    if module is not None:
        module.discard_ready(t)
    else:
        _take_ready_events(t, base)


def export_send(base: int) -> Tuple[bytes, bytes]:
    """(descriptor bytes, ticket) of a send of the storage starting at `base` (a block alone
    in its chunks, or an import): held until the receiver acknowledges the ticket or the
    lease ends."""
    out = ctypes.c_void_p()
    length = ctypes.c_size_t()
    ticket = ctypes.create_string_buffer(TICKET_BYTES)
    _lib.check(_lib.quick().vmm_export_send(base, ctypes.byref(out), ctypes.byref(length),
                                            ticket), "send")
    return _lib.take_buffer(out, length.value), ticket.raw


def send_payload(t: torch.Tensor, base: int, kind: int, parameter: bool = False,
                 requires_grad: bool = False) -> SendPayload:
    """The payload of a send of `t`, whose storage starts at `base` and can be sent as `kind`
    (send_kind): a block sharing its chunks in a pool that isolates sends is relocated first;
    an imported tensor is forwarded (the receiver maps the original exporter's memory).
    VmmError (FAILED_PRECONDITION) for a tensor of a pool whose handle type is none."""
    if kind == SEND_NOT_EXPORTABLE:
        raise _lib.VmmError(
            "cannot send this tensor to another process: its vmm pool was made with "
            "handle_type='none' (not shareable); allocate it from a shareable pool, or send "
            "a copy (tensor.clone() outside that pool)", "FAILED_PRECONDITION")
    if kind == SEND_RELOCATE:
        base = relocate_storage(t, base)
    elif kind not in (SEND_IN_PLACE, SEND_IMPORT):
        raise ValueError(f"send kind {kind} of a tensor that is not vmm memory")
    in_feeder = threading.current_thread().name == FEEDER_THREAD
    if t.is_cuda:
        # The receiver may read at once: what was written before the send must be done. A
        # queue's put recorded an event for it in the sending thread; elsewhere the sending
        # thread waits here for an event recorded on its current stream. An event, not
        # Stream.synchronize(): under torch.cuda.set_sync_debug_mode("error") that raises,
        # and PyTorch's own sends (an event the receiver's stream waits for) do not.
        if in_feeder:
            wait_until_ready(t, base)
        else:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("cannot send a CUDA tensor of vmm memory while the current "
                                   "stream captures a CUDA graph; send it after the capture")
            discard_ready(t, base)
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(t.device))
            written.synchronize()
    try:
        data, ticket = export_send(base)
    except _lib.VmmError as error:
        # (A pool that isolates sends.) Another thread allocated into the block's chunk since
        # send_kind looked: move it after all, but only in the thread that owns it (never in a
        # queue's feeder thread, where the owner may still be writing to it). A moved block's chunks hold nothing else, ever,
        # so the second export cannot fail for that.
        if kind != SEND_IN_PLACE or error.code != "FAILED_PRECONDITION" or in_feeder:
            raise
        data, ticket = export_send(relocate_storage(t, base))
    return sent_payload(t, data, ticket, parameter, requires_grad)


def cancel_send(ticket: bytes) -> None:
    """Withdraws this process's send of `ticket`, whose payload never left it (the message
    holding it failed to pickle): its hold ends now instead of at its lease. VmmError
    (NOT_FOUND) if it was acknowledged or withdrawn already; TypeError if `ticket` is not
    bytes."""
    if not isinstance(ticket, (bytes, bytearray)):
        raise TypeError("withdrawing a send: the ticket must be bytes, not "
                        f"{type(ticket).__name__}")
    _lib.check(_lib.vmm().vmm_send_cancel(bytes(ticket), len(ticket)), "withdrawing a send")


def send_thread_token() -> int:
    """The calling thread's send token: a number no other thread of this process has had or
    will have (unlike ``threading.Thread.native_id``, which comes round again)."""
    return int(_lib.vmm().vmm_send_thread_token())


def held_sends_except(thread_tokens: Iterable[int]) -> int:
    """How many sends of this process are not yet acknowledged, but for those the threads
    whose tokens are `thread_tokens` made (counted in one step)."""
    tokens = [int(token) for token in thread_tokens]
    array = (ctypes.c_int64 * max(1, len(tokens)))(*tokens)
    left = int(_lib.quick().vmm_send_held_except(array, len(tokens)))
    if left < 0:
        _lib.raise_last_error("counting held sends")
    return left


def withdraw_thread_sends(thread_token: int) -> int:
    """Withdraws every send not yet acknowledged that the thread whose token is
    `thread_token` (send_thread_token, called on that thread) made in this process; returns
    how many."""
    return int(_lib.vmm().vmm_send_withdraw_token(int(thread_token)))


def sent_payload(t: torch.Tensor, data: bytes, ticket: bytes, parameter: bool,
                 requires_grad: bool) -> SendPayload:
    """The payload of a send of `t` exported as descriptor `data` with `ticket`."""
    return (data, dtype_code(t.dtype), tuple(t.shape), t.stride(), t.storage_offset(),
            f"cuda:{t.get_device()}" if t.is_cuda else "cpu", parameter, requires_grad,
            ticket) + math_bits(t)


def ack_send(ticket: bytes, wait: bool = False) -> bool:
    """Tells the sender of `ticket` that its send was received. By default the ticket is
    queued and a background thread of libvmm.so sends it (batched per sender; flushed at
    exit), so the receiver does not wait; with ``wait=True`` it is sent now and the result
    returned: False (logged at debug level) when the sender is gone or no longer holds it,
    which is no error for the receiver."""
    if not wait:
        _lib.check(_lib.quick().vmm_send_ack_later(ticket, len(ticket)), "receive")
        _flush_at_exit()
        return True
    result = _lib.vmm().vmm_send_ack(ticket, len(ticket))
    if result != 0:
        _log.debug("vmm_torch: acknowledging a send: %s", _lib.last_error())
        return False
    return True


def received_send(import_id: int, ticket: bytes) -> None:
    """The receiver's half of a send imported as `import_id` (0: the import failed): the ack
    is queued (as ``ack_send``), and the report that the memory is no longer mapped here goes
    out when the import's mapping is unmapped, so that the sender can reuse it."""
    _lib.check(_lib.quick().vmm_send_received(import_id, ticket, len(ticket)), "receive")
    _flush_at_exit()


def _flush_at_exit() -> None:
    """Has this process flush its queued acknowledgements and reports at exit (once)."""
    global _flush_registered
    if not _flush_registered:
        _flush_registered = True
        multiprocessing.util.Finalize(None, flush_acks, exitpriority=0)


_flush_registered = False


def _after_fork_in_child() -> None:
    global _flush_registered
    _flush_registered = False  # multiprocessing empties its finalizers in a forked child


os.register_at_fork(after_in_child=_after_fork_in_child)

#: How long a process waits at exit for its queued acknowledgements to go out.
ACK_FLUSH_TIMEOUT_S = 5.0


def flush_acks(timeout: float = ACK_FLUSH_TIMEOUT_S) -> int:
    """Waits until this process's queued acknowledgements are sent; returns how many are
    left."""
    return int(_lib.vmm().vmm_send_ack_flush(float(timeout)))


#: The shortest lease set_send_lease takes. The library counts time in quarter nanoseconds
#: (absl::Duration, rounded to the nearest) and refuses a lease that rounds to none (below
#: 1.25e-10 s); a nanosecond is the least this function passes on.
MIN_SEND_LEASE_S = 1e-9


def set_send_lease(seconds: float) -> None:
    """How long this process holds a send whose receiver has not acknowledged it (sends made
    from now on). Default 600 s, or VMM_SEND_LEASE_S. TypeError for what is not an int or a
    float; ValueError for a lease below MIN_SEND_LEASE_S, beyond 1e9 s or not finite."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        raise TypeError(f"the lease is a number of seconds, not {type(seconds).__name__}")
    try:
        value = float(seconds)
    except OverflowError:  # an int beyond the range of floats
        value, seconds = math.inf, f"an int of {seconds.bit_length()} bits"
    if not (math.isfinite(value) and value >= MIN_SEND_LEASE_S):
        raise ValueError(f"set_send_lease: the lease is a finite number of seconds, at least "
                         f"{MIN_SEND_LEASE_S:g}, not {seconds}")
    _lib.check(_lib.vmm().vmm_send_set_lease(value), "set_send_lease")


#: How long a sender over its send budget waits for an acknowledgement before it stops
#: waiting (until the next one): receivers that do not read must not stop a sender.
SEND_STALL_S = 0.1

_INT64_MAX = (1 << 63) - 1


def set_send_budget(nbytes: int) -> None:
    """How many bytes this process's unacknowledged sends may hold before ``Queue.put`` waits
    for their receivers to acknowledge some (default 1 GiB, or VMM_SEND_BUDGET; 0: no budget).
    A send holds its tensor's storage until received (in a pool that isolates sends, whole
    chunks: a small tensor travels in one of its own, 2 MiB on an H200), so a producer far
    ahead of its consumers would otherwise hold memory per tensor queued. The wait ends
    once no acknowledgement came for SEND_STALL_S (receivers not reading), so a program that
    fills a queue before it starts its consumers is never stopped."""
    # The C call takes an int64_t: ctypes would wrap a larger value silently (2**64 to 0, which
    # turns the budget off).
    if (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0
            or nbytes > _INT64_MAX):
        raise TypeError(f"the send budget is a number of bytes >= 0 (and < 2**63), "
                        f"not {nbytes!r}")
    _lib.check(_lib.vmm().vmm_send_set_budget(nbytes), "set_send_budget")


def wait_for_send_room() -> bool:
    """Waits while this process's unacknowledged sends are over the send budget and their
    receivers keep acknowledging (see set_send_budget); whether it waited."""
    if not _lib.quick().vmm_send_over_budget():
        return False
    return bool(_lib.vmm().vmm_send_wait_for_room(SEND_STALL_S))


#: The longest one call into libvmm waits for sends (seconds): Python runs signal handlers
#: (a SIGTERM handler, Ctrl-C's KeyboardInterrupt) only between calls.
_SEND_WAIT_SLICE_S = 0.05


def wait_for_sends(timeout: float) -> int:
    """Waits until every send of this process was acknowledged (or expired), at most
    `timeout` seconds; returns the sends still held. A signal handler that raises (a
    SIGTERM handler calling sys.exit, KeyboardInterrupt) ends the wait at once."""
    deadline = time.monotonic() + max(0.0, float(timeout))
    while True:
        slice_s = min(_SEND_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
        left = int(_lib.vmm().vmm_send_wait(slice_s))
        if left == 0 or time.monotonic() >= deadline:
            return left


def raise_send_error(kind: str, message: str, code: Optional[str] = None) -> None:
    """What a receiver unpickles where the sender could not send a tensor from a queue's
    feeder thread: the sender's error (its type, and a VmmError's code), raised in the
    receiver, so that nothing is dropped."""
    text = f"the sending process could not send this tensor: {message}"
    if kind == "VmmError":
        raise _lib.VmmError(text, code if isinstance(code, str) else "UNKNOWN")
    types = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}
    raise types.get(kind if isinstance(kind, str) else "", RuntimeError)(text)


# --- Import ----------------------------------------------------------------------------------


def import_descriptor(descriptor: bytes, device: int = -1,
                      backend: int = BACKEND_DEFAULT) -> int:
    """Imports canonical descriptor bytes (vmm_import decodes and checks them: malformed ones
    raise ValueError) and returns the import id, holding one reference. `device`: the CUDA
    device to map on (-1: the owner's); `backend`: a vmm_backend (0: the descriptor's own).
    Releases the GIL: an import maps memory and may fetch fds from the exporter."""
    return _lib.check_id(
        _lib.vmm().vmm_import(descriptor, len(descriptor), device, backend, 0), "import")


def import_info(import_id: int) -> Tuple[int, int, int]:
    """(address, size, device) of an import: device is the CUDA device it is mapped on, -1
    for the host backend."""
    ptr, size, device = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
    _lib.check(_lib.quick().vmm_import_info(import_id, ctypes.byref(ptr), ctypes.byref(size),
                                            ctypes.byref(device)), "import")
    return ptr.value, size.value, device.value


def retain_import(import_id: int) -> None:
    """Takes one more reference of an import."""
    _lib.check(_lib.quick().vmm_import_retain(import_id), "import")


def release_import(import_id: int) -> None:
    """Releases one reference of an import (the mapping goes with the last)."""
    _lib.vmm().vmm_import_release(ctypes.c_void_p(import_id))


def wrap_import(import_id: int, shape: Sequence[int], stride: Sequence[int],
                storage_offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the buffer of import `import_id`, on the device it is mapped on (CPU for
    the host backend), that releases one reference of the import when its storage dies (the
    caller hands that reference over, also on failure). One operator call: it gets the
    buffer's address, size and device from libvmm.so itself, and checks that the view (a
    received payload is hostile input) lies inside the buffer."""
    try:
        return _lib.load().wrap_import(import_id, shape, stride, storage_offset, dtype)
    except BaseException:
        release_import(import_id)
        raise


def _import_device(device: DeviceArg) -> int:
    """The device argument of vmm_import: -1 (the owner's device: None, or the host) or a
    CUDA index ("cuda" alone is device 0). ValueError for anything that is not a device
    (vmm_torch._devices), never torch's RuntimeError."""
    if device is None:
        return -1
    kind, index = parse_device(device)
    if kind == "host":
        return -1
    return 0 if index is None else index


def _flag(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise TypeError(f"payload field {name} is a {type(value).__name__}, expected a bool")
    return value


def check_view(shape: Any, stride: Any, storage_offset: Any, dtype: torch.dtype,
               requires_grad: Any = False
               ) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """A received view's fields as ints, checked before anything is imported: TypeError for
    fields of the wrong type (shape and stride are lists or tuples of ints, the storage
    offset an int), ValueError for values beyond 64 bits, more than MAX_DIMS dimensions, an
    element count beyond 2**63 - 1, and requires_grad on a dtype that cannot have gradients.
    Signs and whether the view fits the buffer are checked by the wrap_import operator
    (ValueError)."""
    shape = view_ints(shape, "shape")
    stride = view_ints(stride, "stride")
    storage_offset = view_int(storage_offset, "storage_offset")
    if all(extent >= 0 for extent in shape) and numel(shape) > INT64_MAX:
        raise ValueError(f"shape {shape!r} has more than 2**63 - 1 elements")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"requires_grad on a tensor of {dtype}: only floating point and "
                         f"complex tensors can require gradients")
    return shape, stride, storage_offset


def _check_ticket(ticket: Any) -> Optional[bytes]:
    if ticket is None:
        return None
    if type(ticket) is not bytes:
        raise TypeError(f"payload field ticket is a {type(ticket).__name__}, expected bytes")
    if len(ticket) != TICKET_BYTES:
        raise ValueError(f"payload field ticket has {len(ticket)} bytes, not {TICKET_BYTES}")
    return ticket


def check_math_bits(conj: Any, neg: Any, dtype: torch.dtype) -> Tuple[bool, bool]:
    """A received payload's conj and neg fields: TypeError unless bools, ValueError for a bit
    no tensor of `dtype` has (conj on a dtype that is not complex, neg on bool)."""
    conj, neg = _flag(conj, "conj"), _flag(neg, "neg")
    if conj and not dtype.is_complex:
        raise ValueError(f"conj on a tensor of {dtype}: only complex tensors have the "
                         f"conjugate bit")
    if neg and dtype == torch.bool:
        raise ValueError("neg on a tensor of torch.bool: bool tensors cannot be negated")
    return conj, neg


def _rebuild(descriptor: Any, dtype: Any, shape: Any, stride: Any, storage_offset: Any,
             device: Any, parameter: Any, requires_grad: Any, map_device: int,
             ticket: Any = None, conj: Any = False, neg: Any = False) -> torch.Tensor:
    # Every field is checked before the import, so that these failures have nothing to
    # release; the import's own failures and the operator's (the view must fit the buffer)
    # release it. A send's ticket is acknowledged once the import is done or has failed.
    ticket = _check_ticket(ticket)
    import_id = 0
    try:
        dtype = dtype_from_code(dtype)
        device_type, _ = parse_device_field(device)
        parameter = _flag(parameter, "parameter")
        requires_grad = _flag(requires_grad, "requires_grad")
        conj, neg = check_math_bits(conj, neg, dtype)
        shape, stride, storage_offset = check_view(shape, stride, storage_offset, dtype,
                                                   requires_grad)
        data = descriptor if type(descriptor) is bytes else as_bytes(descriptor)
        if ticket is not None:  # a send is imported once (see vmm_send_check)
            _lib.check(_lib.quick().vmm_send_check(ticket, len(ticket)), "receive")
        if device_type == "cuda":
            allocator.enable_for_receive()
        # Module globals looked up per call: benchmarks may wrap them to time each step.
        import_id = import_descriptor(data, map_device if device_type == "cuda" else -1,
                                      _BACKENDS[device_type])
    finally:
        if ticket is not None:
            received_send(import_id, ticket)
    tensor = received_storage(wrap_import(import_id, shape, stride, storage_offset, dtype))
    if conj:  # views of the same memory, as the sender's: the values it had
        tensor = tensor.conj()
    if neg:
        tensor = torch._neg_view(tensor)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


#: The storages this process received, by (device, address, bytes), weakly: a storage received
#: while one over the same bytes lives (two sends of one block share the import's mapping) is
#: that one, as PyTorch's receivers find theirs by IPC handle, so tensors that shared a storage
#: in the sender share one here (tied weights stay tied, torch.save writes them once).
_received: "Dict[Tuple[str, int, int], Any]" = {}
_received_lock = threading.Lock()
_received_sweep_at = 64


def _forget_received() -> None:
    """At exit, while the interpreter still works: drops the weak references of the received
    storages. Left to the interpreter's teardown, each StorageWeakRef frees its reference
    once torch can no longer import (torch 1.13 then warns "Failed to initialize NumPy")."""
    with _received_lock:
        refs = list(_received.values())
        _received.clear()
    del refs  # freed here, outside the lock


atexit.register(_forget_received)


def _untyped_storage(t: torch.Tensor) -> Any:
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()


def received_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (just wrapped over an import, its view checked) or the same view of the live
    storage this process received earlier over the same bytes; then `tensor` and its
    reference of the import go when the caller drops it (the mapping is shared)."""
    global _received_sweep_at
    storage = _untyped_storage(tensor)
    key = (str(tensor.device), storage.data_ptr(), storage.nbytes())
    with _received_lock:
        ref = _received.get(key)
        earlier = None if ref is None else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        if earlier is None:
            _received[key] = StorageWeakRef(storage)
            if len(_received) > _received_sweep_at:
                for stale in [k for k, r in _received.items() if r.expired()]:
                    del _received[stale]
                _received_sweep_at = max(64, 2 * len(_received))
            return tensor
    view = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
    return view.set_(earlier, tensor.storage_offset(), tensor.shape, tensor.stride())


def rebuild_tensor(descriptor: bytes, dtype: DtypeCode, shape: Sequence[int],
                   stride: Sequence[int], storage_offset: int, device: str,
                   parameter: bool = False, requires_grad: bool = False,
                   ticket: Optional[bytes] = None, conj: bool = False,
                   neg: bool = False) -> torch.Tensor:
    """The tensor of a payload (the module docstring's fields, in order): imports the
    descriptor and wraps a tensor over it, which keeps the mapping alive while any view of it
    lives. What unpickling a torch.multiprocessing payload calls.

    A payload is hostile input. Raises TypeError for a field of the wrong type (flags are
    bools, shape and stride lists or tuples of ints), ValueError for a malformed one (bytes
    that are not a descriptor, an unknown dtype or device, a view that does not fit the
    buffer, values beyond 64 bits, a conj or neg bit its dtype cannot have), VmmError for a
    stale or forged descriptor, and leaves no import behind on any failure. A send's `ticket`
    is acknowledged to the sender once the descriptor is imported (or its import failed), so
    that the sender lets go of it. `conj` and `neg` set those bits on the tensor (a view of
    the same memory), as the sender's had them."""
    return _rebuild(descriptor, dtype, shape, stride, storage_offset, device, parameter,
                    requires_grad, -1, ticket, conj, neg)


# --- Storages --------------------------------------------------------------------------------
# A storage of vmm memory (``t.untyped_storage()``, ``t.storage()``) travels as a send of a
# uint8 tensor over all its bytes; the receiver unpickles that tensor's untyped storage.


def untyped_storage_of(storage: Any) -> Any:
    """The untyped storage of `storage` (an UntypedStorage, or a TypedStorage or legacy typed
    storage such as torch.FloatStorage, which wraps one)."""
    if isinstance(storage, torch.TypedStorage):
        inner = getattr(storage, "_untyped_storage", None)  # torch 2.x's name
        return storage._storage if inner is None else inner  # torch 1.x's
    return storage


def storage_view(storage: Any) -> Optional[torch.Tensor]:
    """A uint8 tensor over all the bytes of `storage` (any storage class) if they are vmm
    memory (a pool block or an import), else None (also for an empty storage: nothing of it
    to share)."""
    untyped = untyped_storage_of(storage)
    device = untyped.device
    if device.type not in _BACKENDS or untyped.nbytes() == 0:
        return None
    if send_kind(untyped.data_ptr()) == SEND_NOT_VMM:
        return None
    view = torch.empty((0,), dtype=torch.uint8, device=device)
    return view.set_(untyped, 0, (untyped.nbytes(),), (1,))


def rebuild_storage(*payload: Any) -> Any:
    """What unpickling a storage sent by vmm calls: the untyped storage of the payload's
    tensor (rebuild_tensor checks the payload and imports it, as for a tensor). PyTorch's
    rebuild functions wrap it again in the TypedStorage or legacy typed storage sent."""
    return _untyped_storage(rebuild_tensor(*payload))


def refused_after_fork(error: BaseException, t: torch.Tensor, kind: int) -> bool:
    """Whether sending CPU tensor `t` (`kind`: a pool block, SEND_IN_PLACE or SEND_RELOCATE)
    failed because its pool was made by the parent of this forked process, which a forked
    child never exports from (the library's fork guard, allocator/fork_guard.h): a VmmError
    with code FAILED_PRECONDITION in a process forked since it loaded vmm. Such a tensor goes
    as PyTorch sends a CPU tensor (its reducer moves the storage to shared memory)."""
    return (isinstance(error, _lib.VmmError) and error.code_value == FAILED_PRECONDITION
            and kind in (SEND_IN_PLACE, SEND_RELOCATE) and not t.is_cuda
            and _lib.forked_since_load())


def shared_already(storage: Any) -> bool:
    """Whether `storage` (an untyped storage) is CPU memory of vmm that it sends where it lies
    (a block of a shareable pool, or an import): shared memory, which share_memory_ leaves
    in place. Loads nothing (no vmm memory exists before the library is loaded)."""
    if not _lib.is_loaded() or storage.device.type != "cpu" or storage.nbytes() == 0:
        return False
    return send_kind(storage.data_ptr()) in (SEND_IN_PLACE, SEND_RELOCATE, SEND_IMPORT)


def _keeping_vmm_memory(share_memory_: Any) -> Any:
    """torch.UntypedStorage.share_memory_ (what Tensor.share_memory_, TypedStorage's and
    Module.share_memory() call), leaving vmm's CPU memory where it is: PyTorch's would copy
    it into a new shared memory segment (it knows only its own as shared), detaching the
    tensor from the other processes that map it. Any other storage goes to PyTorch's."""

    @functools.wraps(share_memory_)
    def share_memory_keeping_vmm(self: Any, *args: Any, **kwargs: Any) -> Any:
        if shared_already(self):
            return self
        return share_memory_(self, *args, **kwargs)

    share_memory_keeping_vmm._vmm_keeps = True  # type: ignore[attr-defined]
    return share_memory_keeping_vmm


def _patch_share_memory() -> None:
    storage_type = getattr(torch, "UntypedStorage", None)
    method = getattr(storage_type, "share_memory_", None)
    if method is not None and not getattr(method, "_vmm_keeps", False):
        storage_type.share_memory_ = _keeping_vmm_memory(method)  # type: ignore[union-attr]


_patch_share_memory()


class ImportedBuffer(_lib.Closable):
    """An imported buffer: ``ptr`` (address of its first byte), ``size`` (bytes), ``device``
    (the CUDA device it is mapped on; -1 for the host backend) and ``backend`` ("cuda" or
    "host"). ``close()`` (idempotent, also on leaving a ``with`` block) unmaps it once no
    tensor made by ``as_tensor()`` uses it any more.

    Made by :func:`import_buffer`. ``ImportedBuffer(import_id)`` takes a reference of its own
    of a live import of this process (so closing it never releases one it did not take):
    TypeError unless `import_id` is an int, ValueError where it names no live import."""

    _id: Optional[int] = None  # set only while this object holds a reference of the import

    def __init__(self, import_id: int, backend: Optional[str] = None) -> None:
        if type(import_id) is not int:  # bool, float, str, None: not an import id
            raise TypeError(f"ImportedBuffer takes an import id (an int), not "
                            f"{type(import_id).__name__}; use vmm_torch.import_buffer()")
        if not 0 < import_id <= INT64_MAX:
            raise ValueError(f"no import {import_id} (import ids are ints from 1 to 2**63 - 1)")
        if backend is not None and backend not in ("cuda", "host"):
            raise ValueError(f"backend {backend!r} is not 'cuda' or 'host'")
        retain_import(import_id)  # ValueError ("no import N") where it names none
        self._adopt(import_id, backend)

    @classmethod
    def _adopting(cls, import_id: int, backend: Optional[str] = None) -> "ImportedBuffer":
        """The buffer of import `import_id`, taking over the caller's reference of it (released
        here if this fails)."""
        self = cls.__new__(cls)
        self._adopt(import_id, backend)
        return self

    def _adopt(self, import_id: int, backend: Optional[str]) -> None:
        try:
            self.ptr, self.size, self.device = import_info(import_id)
        except BaseException:
            release_import(import_id)
            raise
        self._id = import_id
        self.backend: str = backend or ("host" if self.device < 0 else "cuda")

    @property
    def closed(self) -> bool:
        return self._id is None

    def as_tensor(self, dtype: torch.dtype = torch.uint8,
                  shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """A tensor over the buffer (bytes as uint8 by default) that keeps the mapping alive
        on its own, even after close()."""
        if self._id is None:
            raise ValueError("the imported buffer is closed")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        if shape is None:
            shape = [self.size // element_size(dtype)]
        shape = shape_list(shape)
        tensor_nbytes(shape, element_size(dtype))  # ValueError if it overflows 64 bits
        retain_import(self._id)
        return wrap_import(self._id, shape, contiguous_strides(shape), 0, dtype)

    def close(self) -> None:
        import_id, self._id = self._id, None
        if import_id is not None:
            release_import(import_id)

    def __repr__(self) -> str:
        state = "closed" if self._id is None else f"ptr={self.ptr:#x}"
        return f"ImportedBuffer({state}, size={self.size}, device={self.device})"


def _backend_code(backend: Optional[str]) -> int:
    if not backend:
        return BACKEND_DEFAULT
    code = BACKENDS.get(backend) if isinstance(backend, str) else None
    if code is None:
        raise ValueError(f"backend {backend!r} is not 'cuda' or 'host'")
    return code


def import_buffer(descriptor: Union[BufferDescriptor, bytes], device: DeviceArg = None,
                  backend: Optional[str] = None) -> ImportedBuffer:
    """Imports a buffer descriptor (object or canonical bytes) and returns an ImportedBuffer.

    `device`: the CUDA device to map on (default: the exporting device, found by UUID).
    `backend`: "cuda" or "host" (default: the descriptor's own, which vmm reads from it).
    Stale or forged descriptors raise VmmError (code NOT_FOUND, or UNAVAILABLE when the
    exporting process has exited) naming the owner; malformed ones raise ValueError.
    """
    if isinstance(descriptor, BufferDescriptor):
        data = descriptor.to_bytes()
    elif isinstance(descriptor, (bytes, bytearray, memoryview)):
        data = bytes(descriptor)
    else:
        raise TypeError(
            f"expected a buffer descriptor or its bytes, not {type(descriptor).__name__}")
    code = _backend_code(backend)
    return ImportedBuffer._adopting(import_descriptor(data, _import_device(device), code))


# --- SharedTensor ----------------------------------------------------------------------------


_LEGACY_STATE_KEYS = ("descriptor", "dtype", "shape", "stride", "storage_offset",
                      "device_type")


class SharedTensor:
    """A tensor exported from a vmm pool: its buffer descriptor and the metadata to rebuild it.

    Attributes: ``descriptor`` (a FabricBufferDescriptor or PosixFdBufferDescriptor, decoded
    when first read), ``dtype``, ``shape``, ``stride``, ``storage_offset`` (in elements),
    ``device_type`` ("cuda" or "cpu"), ``device_index`` (exporting CUDA device or None),
    ``conj`` and ``neg`` (the exported tensor's is_conj() and is_neg(), set again by
    ``open()``), ``storage_nbytes`` and ``payload`` (the flat tuple it pickles as; see the
    module docstring). Picklable with plain pickle; ``open()`` imports it.
    """

    conj = False  # the exported tensor's conjugate bit (a lazy conj() view)
    neg = False  # its negative bit

    def __init__(self, descriptor: BufferDescriptor, dtype: torch.dtype,
                 shape: Sequence[int], stride: Sequence[int], storage_offset: int,
                 device_type: str, storage_nbytes: Optional[int] = None,
                 device_index: Optional[int] = None) -> None:
        if not isinstance(descriptor, BufferDescriptor):
            raise TypeError("descriptor must be a FabricBufferDescriptor or "
                            "PosixFdBufferDescriptor")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        self._set(descriptor.to_bytes(), descriptor, dtype, shape, stride, storage_offset,
                  device_type, device_index, storage_nbytes)

    _trusted = False  # descriptor bytes from this process's vmm_export

    def _set(self, data: bytes, descriptor: Optional[BufferDescriptor], dtype: torch.dtype,
             shape: Sequence[int], stride: Sequence[int], storage_offset: int,
             device_type: str, device_index: Optional[int],
             storage_nbytes: Optional[int]) -> None:
        if device_type not in _BACKENDS:
            raise ValueError(f"device_type {device_type!r} is not 'cuda' or 'cpu'")
        self._data = data
        self._descriptor = descriptor
        self.dtype = dtype
        self.shape, self.stride, self.storage_offset = check_view(
            tuple(shape) if isinstance(shape, torch.Size) else shape, stride, storage_offset,
            dtype)
        self.device_type = device_type
        self.device_index = None if device_index is None else view_int(device_index,
                                                                        "device_index")
        self._storage_nbytes = (None if storage_nbytes is None
                                else view_int(storage_nbytes, "storage_nbytes"))

    @classmethod
    def from_payload(cls, payload: Sequence[Any]) -> "SharedTensor":
        """The SharedTensor of a received payload (see the module docstring). Checks the
        dtype, device and view fields; the descriptor bytes are checked when imported (by
        vmm_import) or when ``descriptor`` is first read."""
        return cls._from_payload(payload, None, False)

    @classmethod
    def _from_payload(cls, payload: Sequence[Any], storage_nbytes: Optional[int],
                      trusted: bool) -> "SharedTensor":
        with_bits = len(SEND_PAYLOAD_FIELDS) + len(MATH_BIT_FIELDS)
        if len(payload) not in (len(PAYLOAD_FIELDS), with_bits):
            raise ValueError(f"a shared tensor payload has {len(PAYLOAD_FIELDS)} fields "
                             f"({with_bits} with the conj and neg bits), not {len(payload)}")
        data, code, shape, stride, storage_offset, device = payload[:6]
        device_type, device_index = parse_device_field(device)
        dtype = dtype_from_code(code)
        self = object.__new__(cls)
        if len(payload) == with_bits:
            if payload[len(PAYLOAD_FIELDS)] is not None:
                raise ValueError("a shared tensor payload has no ticket (its field is None)")
            self.conj, self.neg = check_math_bits(*payload[len(SEND_PAYLOAD_FIELDS):], dtype)
        self._set(as_bytes(data), None, dtype, shape, stride, storage_offset, device_type,
                  device_index, storage_nbytes)
        self._trusted = trusted
        return self

    @property
    def descriptor(self) -> BufferDescriptor:
        """The buffer descriptor, decoded on first read (once)."""
        descriptor = self._descriptor
        if descriptor is None:
            make = (BufferDescriptor.from_trusted_bytes if self._trusted
                    else BufferDescriptor.from_bytes)
            descriptor = self._descriptor = make(self._data)
        return descriptor

    @property
    def storage_nbytes(self) -> int:
        """Bytes of the exported storage (the descriptor's buffer size where not known)."""
        if self._storage_nbytes is None:
            self._storage_nbytes = self.descriptor.size
        return self._storage_nbytes

    @property
    def payload(self) -> Payload:
        """The flat tuple this tensor travels as (see the module docstring)."""
        bits = (None, self.conj, self.neg) if self.conj or self.neg else ()
        return (self._data, dtype_code(self.dtype), self.shape, self.stride,
                self.storage_offset, device_field(self.device_type, self.device_index),
                False, False) + bits

    def open(self, device: DeviceArg = None) -> torch.Tensor:
        """Imports the descriptor and returns a tensor over the shared memory with the
        exported dtype, shape, strides, storage offset and conjugate and negative bits. The
        mapping lives as long as any view of the returned tensor. `device`: CUDA device to
        map on (default: the exporting device); ignored for CPU tensors."""
        map_device = _import_device(device)  # checked also where it is ignored
        if self.device_type != "cuda":
            map_device = -1
        payload = self.payload
        return _rebuild(*payload[:len(PAYLOAD_FIELDS)], map_device,
                        *payload[len(PAYLOAD_FIELDS):])

    def __reduce__(self) -> Tuple[Any, Payload]:
        return (rebuild_shared_tensor, self.payload)

    def __getstate__(self) -> Payload:
        return self.payload

    def __setstate__(self, state: Any) -> None:
        self.conj = self.neg = False  # a payload without the bits has neither
        if isinstance(state, dict):  # pickles made before the flat payload
            missing = [key for key in _LEGACY_STATE_KEYS if key not in state]
            if missing:
                raise ValueError(f"a shared tensor's state lacks {', '.join(missing)}")
            self._set(as_bytes(state["descriptor"]), None, dtype_from_name(state["dtype"]),
                      state["shape"], state["stride"], state["storage_offset"],
                      state["device_type"], state.get("device_index"),
                      state.get("storage_nbytes"))
            return
        other = SharedTensor.from_payload(state)
        self.__dict__.update(other.__dict__)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SharedTensor):
            return NotImplemented
        return self.payload == other.payload

    def __hash__(self) -> int:
        return hash(self.payload)

    def __repr__(self) -> str:
        return (f"SharedTensor({self.descriptor.handle_type}, dtype={self.dtype}, "
                f"shape={self.shape}, stride={self.stride}, "
                f"storage_offset={self.storage_offset}, device_type={self.device_type!r}, "
                f"storage_nbytes={self.storage_nbytes})")


def rebuild_shared_tensor(*payload: Any) -> SharedTensor:
    """The SharedTensor of a payload (what unpickling a SharedTensor calls)."""
    return SharedTensor.from_payload(payload)


def export_tensor(t: torch.Tensor) -> SharedTensor:
    """Exports a tensor whose storage lives in a vmm pool, or was received from another
    process (then forwarded: the importer maps the first exporter's memory), and returns a
    SharedTensor.

    The whole storage is exported (views keep their offset and strides). The chunks of a pool
    block are marked exported: their free space is never given to another tensor, so an
    importer can only ever see this tensor's data. Keep `t` alive until every importer has
    opened the SharedTensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"export_tensor expects a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"export_tensor: {t.layout} tensors cannot be exported")
    if t.device.type not in _BACKENDS:
        raise ValueError(f"export_tensor: {t.device.type} tensors cannot be exported")
    base, nbytes = storage_base(t)
    # The bytes come from this process's vmm_export: trusted, decoded only if read.
    return SharedTensor._from_payload(tensor_payload(t, base), nbytes, True)
