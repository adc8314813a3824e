"""vmm as PyTorch's CUDA allocator, and the statistics of its device pools."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import _cuda, _lib, _registry, _settings, _signatures
from ._devices import bad_device, parse_device
from ._files import PathArg, write_file
from ._options import format_options

DeviceLike = Union[None, int, str, torch.device]

# (method of torch._C._CUDAPluggableAllocator, function of _C.so) for the optional hooks.
# Signatures (torch/csrc/cuda/Module.cpp): set_init_fn void(int device_count); set_reset_fn
# void() (empty_cache); set_memory_fraction_fn void(double, int); set_record_stream_fn
# void(void*, cudaStream_t).
_HOOKS = (
    ("set_init_fn", "vmm_torch_init"),
    ("set_reset_fn", "vmm_torch_empty_cache"),
    ("set_memory_fraction_fn", "vmm_torch_memory_fraction"),
    ("set_record_stream_fn", "vmm_torch_record_stream"),
)

#: What enabled_hooks() says when vmm's own CUDA allocator (vmm_torch._cuda) is current: it
#: answers every call PyTorch makes of an allocator, not only the hooks above.
FULL_ALLOCATOR = "vmm_cuda_allocator"

_enable_lock = threading.Lock()
_enabled: Optional["_Enabled"] = None  # the _Enabled of this process, once enable() succeeded
_receive_checked = False  # enable_for_receive() has run in this process
_log = logging.getLogger("vmm_torch")

#: The environment variable that enables vmm in every process of a program (see
#: environment_options): "1" for the default options, option text such as
#: "handle_type=posix_fd,memory_limit=40G", or "0" to keep vmm off even where a process
#: receives a vmm tensor before using CUDA.
ENABLE_VARIABLE = "VMM_TORCH_ENABLE"
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


class _Enabled:
    """What enable() registered: its option text, PyTorch's allocator object, the hooks set,
    and whether it was enabled implicitly (from the environment or on receiving a tensor),
    so that an explicit enable() may still choose the options."""

    def __init__(self, options_text: str, allocator: Any, hooks: Tuple[str, ...],
                 implicit: bool) -> None:
        self.options_text = options_text
        self.allocator = allocator
        self.hooks = hooks
        self.implicit = implicit


def environment_options() -> Optional[str]:
    """The option text VMM_TORCH_ENABLE asks for ("" for the defaults), or None when it is
    unset, empty or off."""
    value = os.environ.get(ENABLE_VARIABLE, "").strip()
    if not value or value.lower() in _OFF:
        return None
    return "" if value.lower() in _ON else value


def environment_forbids() -> bool:
    """Whether VMM_TORCH_ENABLE is set to off ("0", "false", "no", "off")."""
    return os.environ.get(ENABLE_VARIABLE, "").strip().lower() in _OFF


def _function_address(library: ctypes.CDLL, name: str) -> Optional[int]:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def _set_hooks(pluggable: Any, extension_path: str) -> Tuple[str, ...]:
    """Passes the addresses of _C.so's hook functions to the hook setters this torch has.
    Returns the names of the hooks set."""
    native = pluggable.allocator()
    extension = ctypes.CDLL(extension_path)
    done = []
    for method, symbol in _HOOKS:
        setter = getattr(native, method, None)
        if setter is None:
            continue
        setter(_function_address(extension, symbol))
        done.append(method)
    return tuple(done)


def _check_can_enable() -> None:
    memory = torch.cuda.memory
    if not hasattr(memory, "CUDAPluggableAllocator") or not hasattr(
            memory, "change_current_allocator"):
        raise RuntimeError(
            f"vmm_torch.enable() needs torch.cuda.memory.CUDAPluggableAllocator "
            f"(PyTorch 2.0 or later); this is torch {torch.__version__}. Explicit pools "
            f"(vmm_torch.Pool) work without it.")
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(
            f"vmm_torch.enable() needs a CUDA build of PyTorch; torch {torch.__version__} has "
            f"no CUDA support. Explicit host pools (vmm_torch.Pool(\"host\")) work without it.")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "vmm_torch.enable() must be called before CUDA is used: CUDA is already "
            "initialised in this process and PyTorch cannot swap an initialised allocator. "
            "Call enable() first thing, before any CUDA tensor, torch.cuda call or model "
            ".cuda().")


def enable(**options: Any) -> None:
    """Registers vmm as PyTorch's CUDA allocator for this process.

    Call it before CUDA is used (before the first CUDA tensor, ``torch.cuda`` query or
    ``model.cuda()``): PyTorch cannot swap an allocator once it is initialised, and enable()
    raises RuntimeError if CUDA already is. From then on every CUDA tensor is a block of
    vmm's pool for its device, and ``vmm_torch.export_tensor`` can share it.

    Options (all optional) configure the device pools:

    - ``handle_type``: "auto" (fabric where available, else POSIX fds), "posix_fd", "fabric",
      or "none" (not shareable).
    - sizes, as ints (bytes) or strings like "40G": ``reserve_size`` (virtual range per
      device: by default 32 times its memory, twice with ``pressure_page=0``; twice for
      the private pools of CUDA graphs and MemPools), ``memory_limit`` (most physical bytes),
      ``release_threshold`` (cached bytes kept when freeing), ``small_size``,
      ``small_chunk``, ``max_growth_extra``, ``max_chunk``,
      ``large_page`` (grow in pages of this size, and move free pages to where a miss needs
      memory instead of growing: less memory stranded in holes, more driver calls, and a
      tensor sent in place spans one handle per page; off unless given, "4M" is the C++
      pools' default), ``growth_page`` (with pages: the largest chunk a growth makes before
      the pool first moves memory or finds free memory in such a chunk beside a live block;
      one page unless given, since a block sent in place retires the whole of the chunks it
      spans), ``growth_page_from`` (the smallest request grown in such chunks, four of them
      unless given), ``pressure_page`` (without ``large_page``: the pages a device pool
      grows in, and moves, once a growth would take it past half of what it may hold, or
      one failed for lack of memory, so that memory freed near the GPU's capacity serves
      any request again; "4M" unless given, 0 keeps single chunks for good; a tensor grown
      since and sent in place spans one handle per page).
    - ``growth_fraction``: grow by at least this fraction of what is reserved (0..1).
    - ``peer_devices``: list of other device indices granted access to the memory.

    Unknown options and malformed values raise ValueError naming them. A torch without
    pluggable allocators or CUDA, or CUDA already initialised, raises RuntimeError saying so;
    so does, checked last, a first enable() after vmm's device pools have allocated. Calling
    enable() again with the same options does nothing; with other options it raises
    RuntimeError, unless vmm was enabled implicitly (by VMM_TORCH_ENABLE, or because this
    process received a vmm tensor before using CUDA): then a plain ``enable()`` keeps the
    options in force, and other options apply if vmm has not allocated yet.

    Where the package has vmm's own CUDA allocator (``vmm_torch._cuda``: built by pip where
    torch has CUDA, 2.3 or later), enable() makes it current: then ``torch.cuda``'s memory
    functions (``memory_stats``, ``memory_allocated``, ``memory_summary``,
    ``memory_snapshot``, ``_record_memory_history``, ``reset_peak_memory_stats``...), CUDA
    graphs (``torch.cuda.graph``, ``make_graphed_callables``, ``torch.compile(mode=
    "reduce-overhead")``), ``torch.cuda.MemPool``/``use_mem_pool`` and OOM observers all work
    from vmm. Elsewhere it creates ``torch.cuda.memory.CUDAPluggableAllocator`` over
    ``vmm_torch_malloc`` and ``vmm_torch_free`` of the extension _C.so, sets the optional hooks
    this torch supports (init, empty_cache, memory fraction, record_stream) and makes it
    current: ``torch.cuda.empty_cache()``, ``set_per_process_memory_fraction()`` and
    ``Tensor.record_stream()`` reach vmm, ``torch.cuda.memory_stats()`` does not (use
    ``vmm_torch.memory_stats()``). ``enabled_hooks()`` says which.
    """
    _enable_text(format_options(options), implicit=False)


def _enable_text(text: str, implicit: bool) -> None:
    global _enabled
    with _enable_lock:
        if _enabled is not None:
            if _enabled.options_text == text:
                if not implicit:
                    _enabled.implicit = False
                return
            if implicit:
                return
            if _enabled.implicit and not text:
                # A plain enable() where VMM_TORCH_ENABLE (or a receive) enabled vmm already:
                # those options stand.
                _enabled.implicit = False
                return
            if not _enabled.implicit:
                raise RuntimeError(
                    f"vmm_torch.enable() was already called with options "
                    f"{_enabled.options_text!r}; the allocator cannot be reconfigured")
            # Enabled implicitly: the options still apply if no device pool exists yet.
            if _lib.vmm().vmm_configure(text.encode()) != 0:
                raise RuntimeError(
                    f"vmm was enabled with options {_enabled.options_text!r} (from "
                    f"{ENABLE_VARIABLE} or on receiving a tensor) and has allocated since; "
                    f"enable({text!r}) comes too late: {_lib.last_error()}")
            _enabled.options_text, _enabled.implicit = text, False
            return
        libs = _lib.load()
        # Options first, so that bad ones are reported as such on any torch (they only apply
        # to device pools created later); then what this torch or process lacks, which no
        # later call mends; then configure's other refusal (device pools exist already).
        refusal = None
        try:
            _lib.check(libs.vmm.vmm_configure(text.encode()), "vmm_torch.enable")
        except _lib.VmmError as e:  # bad options are ValueError, raised here
            refusal = e
        _check_can_enable()
        if refusal is not None:
            raise refusal
        # A backend named at run time: the allocator in place now is what programs may name
        # (_settings), read before vmm takes its place.
        _settings.install(_settings.startup_backend())
        full = _cuda.module(libs)
        if full is not None:
            # vmm's own CUDAAllocator: statistics, snapshots, graph pools, OOM observers.
            full.install()
            _enabled = _Enabled(text, None, (FULL_ALLOCATOR,), implicit)
            return
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            libs.extension_path, "vmm_torch_malloc", "vmm_torch_free")
        hooks = _set_hooks(pluggable, libs.extension_path)
        torch.cuda.memory.change_current_allocator(pluggable)
        _enabled = _Enabled(text, pluggable, hooks, implicit)


def can_enable() -> bool:
    """Whether enable() could succeed now: a CUDA build of PyTorch with pluggable allocators,
    and CUDA not yet initialised in this process."""
    memory = torch.cuda.memory
    return (hasattr(memory, "CUDAPluggableAllocator")
            and hasattr(memory, "change_current_allocator")
            and hasattr(torch._C, "_cuda_customAllocator")
            and not torch.cuda.is_initialized())


def enable_from_environment() -> bool:
    """Enables vmm with VMM_TORCH_ENABLE's options if it asks for it and this PyTorch can
    (a CUDA build, CUDA not yet initialised); returns whether vmm is enabled. Malformed
    options raise ValueError."""
    text = environment_options()
    if text is None:
        return _enabled is not None
    if _enabled is None and not can_enable():
        return False
    _enable_text(text, implicit=True)
    return True


def enable_for_receive() -> None:
    """Called before a vmm CUDA tensor is imported: a process that has not used CUDA yet takes
    vmm as its allocator (VMM_TORCH_ENABLE's options), so that importing a tensor — which
    initialises PyTorch's CUDA state — does not lock in PyTorch's allocator before the
    process's own enable() call (a tensor passed as an argument of ``Process(...)`` is
    unpickled before the target runs). Nothing happens with VMM_TORCH_ENABLE=0, once vmm is
    enabled, or where it cannot be; never raises. Cheap after the first call."""
    global _receive_checked
    if _receive_checked:
        return
    _receive_checked = True
    if _enabled is not None or environment_forbids():
        return
    try:
        if can_enable():
            _enable_text(environment_options() or "", implicit=True)
    except Exception as error:  # the import works with any allocator; say why, go on
        _log.warning("vmm_torch: could not enable vmm before importing a tensor: %s", error)


def is_enabled() -> bool:
    """Whether enable() has registered vmm as this process's CUDA allocator."""
    return _enabled is not None


def enabled_hooks() -> Tuple[str, ...]:
    """The hook setters enable() called on this torch, or (FULL_ALLOCATOR,) where vmm's own
    CUDA allocator is current (empty before enable())."""
    return _enabled.hooks if _enabled is not None else ()


# --- Statistics ------------------------------------------------------------------------------


def device_index(device: DeviceLike = None) -> int:
    """A device pool's index from None (the current CUDA device, or 0 while CUDA is not
    initialised), an int, "cuda", "cuda:N" or a torch.device of type cuda. ValueError for
    anything else (vmm_torch._devices), the host included."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    kind, index = parse_device(device)
    if kind != "cuda":
        raise bad_device(device, "a CUDA device (device pools are per GPU; use "
                                 "Pool.memory_stats() for a host pool)")
    return device_index(None) if index is None else index  # "cuda": the current device


def _flatten(prefix: str, value: Any, out: Dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value


def flatten_stats(document: Dict[str, Any]) -> Dict[str, Any]:
    """A stats document {"torch": {...}, "vmm": {...}} as one flat dict: its "torch" object,
    which has PyTorch's key names and the allocator's own figures under "vmm." (the "vmm"
    object holds the same figures by field name, for dump_stats)."""
    out: Dict[str, Any] = {}
    _flatten("", document.get("torch", {}), out)
    return dict(sorted(out.items()))


def memory_stats(device: DeviceLike = None) -> Dict[str, Any]:
    """Statistics of the device pool of `device` (default: the current device), with the
    private pools on it (CUDA graph pools, MemPools), as a dict.

    Keys follow ``torch.cuda.memory_stats()`` where the meaning is the same
    (``allocated_bytes.all.current``, ``reserved_bytes.all.peak``, ``num_device_alloc``,
    ...); the allocator's own figures (driver calls, fragmentation, largest free block,
    exported bytes, ...) follow under ``vmm.``, and the process's sends (held for receivers
    that have not imported them yet: ``vmm.sends.held_bytes``, ...; see :func:`send_stats`)
    under ``vmm.sends.``. A device vmm has not used gives zeros.
    """
    index = device_index(device)
    stats = flatten_stats(_lib.take_json(_lib.vmm().vmm_stats_json(index), "memory_stats"))
    stats.update((f"vmm.sends.{name}", value) for name, value in send_stats().items())
    return stats


def send_stats() -> Dict[str, Any]:
    """This process's sends (tensors sent through torch.multiprocessing): ``held`` and
    ``held_bytes`` (held now, until their receivers import them or their lease ends),
    ``peak_held_bytes`` (physical bytes: whole chunks), the totals ``holds``, ``acked`` and
    ``expired``, ``lease_seconds`` (the lease of new sends), ``awaiting_release`` (acknowledged
    sends whose receivers still map the memory: their chunks are reused once they report) and
    ``released`` (sends whose receivers reported they unmapped it)."""
    stats = _signatures.SendStats()
    _lib.check(_lib.vmm().vmm_send_stats_get(ctypes.byref(stats)), "send_stats")
    return {name: getattr(stats, name) for name, _ in _signatures.SendStats._fields_}


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes held by live blocks of the device pool."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: DeviceLike = None) -> int:
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: DeviceLike = None) -> int:
    """Physical bytes the device pool holds (cached memory included)."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: DeviceLike = None) -> int:
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Resets the peaks of the device pool's statistics to their current values."""
    _lib.check(_lib.vmm().vmm_reset_peak_stats(device_index(device)))


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    """Resets the cumulative ("allocated"/"freed") statistics of the device pool."""
    _lib.check(_lib.vmm().vmm_reset_accumulated_stats(device_index(device)))


def empty_cache() -> None:
    """Returns the cached (free) memory of every vmm pool, explicit pools included, to the
    driver (not that of a private pool in use: a CUDA graph may replay into it)."""
    _lib.check(_lib.vmm().vmm_empty_cache(-1), "empty_cache")


def set_per_process_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    """Caps the device pool at `fraction` (0 <= fraction <= 1) of the memory of the device
    (ValueError outside that, an int too large for a float included)."""
    try:
        value = float(fraction)
    except OverflowError:  # an int beyond the range of floats: outside [0, 1] all the same
        value = math.inf
    _lib.check(_lib.vmm().vmm_set_memory_fraction(value, device_index(device)))


def memory_snapshot() -> Dict[str, Any]:
    """The state of every vmm pool in the structure of ``torch.cuda.memory._snapshot()``:
    {"segments": [{"device", "address", "total_size", "stream", "segment_type", "blocks":
    [{"address", "size", "requested_size", "state"}, ...]}, ...], "device_traces": [...]},
    plus "vmm_pools": vmm's own snapshot of each pool (chunks, export marks)."""
    return _lib.take_json(_lib.vmm().vmm_snapshot_json(), "memory_snapshot")


def backend() -> str:
    """"cuda" or "host": the backend of the device pools (host where no GPU is present)."""
    return _lib.backend()


def _device_pool_indices() -> List[int]:
    if backend() == "cuda" and torch.cuda.is_available():
        return list(range(torch.cuda.device_count()))
    return [0]


def collect_stats() -> Dict[str, Any]:
    """Everything dump_stats writes, as a dict (explicit pools: those registered open in
    vmm_torch._registry)."""
    return {
        "backend": backend(),
        "time": time.time(),
        "torch_version": torch.__version__,
        "stats": {str(d): memory_stats(d) for d in _device_pool_indices()},
        "pools": _registry.open_pool_stats(),
        "sends": send_stats(),
        "snapshot": memory_snapshot(),
    }


def dump_stats(path: PathArg) -> Dict[str, Any]:
    """Writes the statistics of the device pools and of the open explicit pools, and a
    snapshot of all pools, as JSON to `path`; returns the document.

    Layout: {"backend", "time", "torch_version", "stats": {device: memory_stats(device)},
    "pools": {pool id: {"device", "handle_type", "stats"}}, "snapshot": memory_snapshot()}.
    Read it back with ``python -m vmm_torch.stats summarize|render|torch-viz PATH``.

    `path` is a str, bytes or os.PathLike (TypeError otherwise). The file is written whole
    (a temporary file beside it, ".vmm-XXXXXXXX.tmp" whatever the name of `path`, renamed
    over it; removed on any failure). A symlink is
    written through: its final target is replaced, the link stays. Anything that exists and
    is not a regular file (a directory, a device node, a FIFO) is refused with
    FileExistsError and left alone.
    """
    document = collect_stats()
    write_file(path, lambda f: json.dump(document, f, indent=1))
    return document
