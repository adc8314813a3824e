"""Loading vmm's shared libraries and calling its C interface (torch_plugin/vmm_c.h).

Two libraries live next to this file (or in $VMM_LIB_DIR):

- ``libvmm.so``: the allocator, its pools, imports and descriptors, behind a C interface that
  this module binds with ctypes (the declarations: ``vmm_torch._signatures``);
- ``_C.so``: the LibTorch extension with the ``torch.ops.vmm`` operators and the functions
  PyTorch's ``CUDAPluggableAllocator`` calls. It does not link libvmm.so; ``torch.ops.vmm.bind``
  tells it which file to open, and since that is the file ctypes already loaded, both use the
  one allocator instance of the process.

The paths that share tensors run per message, so they call through handles resolved once
(``load().wrap`` and friends: the operators' single overloads, which skip torch.ops' overload
resolution) and, for short calls, through ``quick()``: libvmm.so bound with ``ctypes.PyDLL``,
which keeps the GIL. A ctypes call through ``vmm()`` releases the GIL, and a thread that
releases it (a queue's feeder thread pickling a tensor, say) may have to wait for another
thread to hand it back; calls that can block (imports: mapping, fetching fds) still do.

Errors: a failed call leaves a numeric code (``vmm_last_error_code``, an absl::StatusCode)
and a message (``vmm_last_error``); :func:`error_for` maps the code to the Python exception:
INVALID_ARGUMENT to ValueError, RESOURCE_EXHAUSTED to torch.cuda.OutOfMemoryError (or
MemoryError), anything else to :class:`VmmError` carrying the code.

Loading happens on first use (``load()``), so that ``import vmm_torch`` and the statistics
command line work without the libraries.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from typing import Any, Callable, NoReturn, Optional, Type

import torch

from . import _signatures
from ._signatures import BACKEND_NAMES, STATUS_CODE_NAMES, STATUS_CODES

LIBVMM_NAME = "libvmm.so"
EXTENSION_NAME = "_C.so"


class Closable:
    """Gives a class with an idempotent close() the context-manager protocol, and closes it
    when it is collected (errors there are swallowed: the interpreter may be shutting down)."""

    def close(self) -> None:  # overridden
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class VmmError(RuntimeError):
    """A failure reported by vmm's C library.

    ``code`` is the status code's name ("NOT_FOUND", "UNAVAILABLE", "FAILED_PRECONDITION",
    ...) and ``code_value`` its number (absl::StatusCode, vmm_c.h's vmm_status_code): a stale
    descriptor gives NOT_FOUND, an exporter that has exited UNAVAILABLE. Invalid arguments
    are raised as ValueError and out-of-memory as torch.cuda.OutOfMemoryError (or
    MemoryError) instead.
    """

    def __init__(self, message: str, code: Any = "UNKNOWN") -> None:
        super().__init__(message)
        if isinstance(code, int) and not isinstance(code, bool):
            value = code
            name = STATUS_CODE_NAMES.get(code, "UNKNOWN")
        else:
            name = str(code)
            value = STATUS_CODES.get(name, _signatures.UNKNOWN)
        self.code: str = name
        self.code_value: int = value


def out_of_memory_type() -> Type[Exception]:
    """torch.cuda.OutOfMemoryError where this torch has it, else MemoryError."""
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom if oom is not None else MemoryError


def error_for(code: int, message: str) -> Exception:
    """The Python exception for a failure with status `code` (vmm_status_code) and `message`."""
    if code == _signatures.INVALID_ARGUMENT:
        return ValueError(message)
    if code == _signatures.RESOURCE_EXHAUSTED:
        return out_of_memory_type()(message)
    if code not in STATUS_CODE_NAMES or code == _signatures.OK:
        code = _signatures.UNKNOWN
    return VmmError(message, code)


def library_dir() -> str:
    """Where libvmm.so and _C.so are looked for: $VMM_LIB_DIR, else this package's folder."""
    override = os.environ.get("VMM_LIB_DIR")
    if override:
        return os.path.abspath(override)
    return os.path.dirname(os.path.abspath(__file__))


class Libraries:
    """The loaded libraries: ``vmm`` (ctypes handle of libvmm.so), ``quick`` (the same library
    bound without releasing the GIL), the extension's path, and its operators ``wrap``,
    ``wrap_import``, ``storage_info``, ``storage_bytes`` and ``swap_storage`` (their single overloads)."""

    def __init__(self, directory: str) -> None:
        self.libvmm_path = os.path.join(directory, LIBVMM_NAME)
        self.extension_path = os.path.join(directory, EXTENSION_NAME)
        for path in (self.libvmm_path, self.extension_path):
            if not os.path.exists(path):
                raise ImportError(
                    f"vmm_torch: {path} is missing; install the package with pip (see "
                    f"torch_plugin/python/README.md) or set VMM_LIB_DIR to the folder that holds "
                    f"{LIBVMM_NAME} and {EXTENSION_NAME}")
        self.pid = os.getpid()  # the process that loaded them (forked_since_load)
        self.vmm = ctypes.CDLL(self.libvmm_path)
        self.quick = ctypes.PyDLL(self.libvmm_path)
        _signatures.declare(self.vmm)
        _signatures.declare(self.quick)
        torch.ops.load_library(self.extension_path)
        torch.ops.vmm.bind(self.libvmm_path)
        self.wrap: Callable[..., torch.Tensor] = torch.ops.vmm.wrap.default
        self.wrap_import: Callable[..., torch.Tensor] = torch.ops.vmm.wrap_import.default
        self.storage_info: Callable[[torch.Tensor], Any] = torch.ops.vmm.storage_info.default
        self.storage_bytes: Callable[[torch.Tensor], torch.Tensor] = (
            torch.ops.vmm.storage_bytes.default)
        self.swap_storage: Callable[[torch.Tensor, torch.Tensor], None] = (
            torch.ops.vmm.swap_storage.default)


_loaded: Optional[Libraries] = None
_load_lock = threading.Lock()


def load() -> Libraries:
    """Loads both libraries once per process and returns them."""
    global _loaded
    if _loaded is None:
        with _load_lock:
            if _loaded is None:
                _loaded = Libraries(library_dir())
    return _loaded


def is_loaded() -> bool:
    """Whether this process (or the parent it was forked from) has loaded the libraries; where
    not, no memory of vmm's exists here. Loads nothing."""
    return _loaded is not None


def forked_since_load() -> bool:
    """Whether this process is a fork() child of the process that loaded the libraries (its
    pools made before the fork are its parent's, which the library's fork guard keeps it from
    allocating from or exporting: FAILED_PRECONDITION). Loads nothing."""
    return _loaded is not None and _loaded.pid != os.getpid()


def vmm() -> ctypes.CDLL:
    """The ctypes handle of libvmm.so (loading it on first use)."""
    return load().vmm


def quick() -> ctypes.CDLL:
    """libvmm.so bound with ctypes.PyDLL: the calls keep the GIL. For short calls only (see
    the module docstring); never for one that can block."""
    return load().quick


def ops() -> Any:
    """torch.ops.vmm, the extension's operators (loading the libraries on first use)."""
    load()
    return torch.ops.vmm


def last_error() -> str:
    """The message of this thread's last vmm failure ("" if none)."""
    return (quick().vmm_last_error() or b"").decode("utf-8", "replace")


def last_error_code() -> int:
    """The vmm_status_code of this thread's last vmm failure (0 if none)."""
    return int(quick().vmm_last_error_code())


def raise_last_error(context: Optional[str] = None) -> NoReturn:
    """Raises the exception that describes this thread's last vmm failure."""
    code = last_error_code()
    message = last_error()
    if code == _signatures.OK:
        code, message = _signatures.UNKNOWN, message or "vmm call failed"
    if context:
        message = f"{context}: {message}"
    raise error_for(code, message)


def check(result: int, context: Optional[str] = None) -> int:
    """Returns `result` of a function that gives 0 on success and -1 on failure."""
    if result != 0:
        raise_last_error(context)
    return result


def check_id(result: int, context: Optional[str] = None) -> int:
    """Returns `result` of a function that gives an id, or -1 on failure."""
    if result < 0:
        raise_last_error(context)
    return result


def check_pointer(result: Optional[int], context: Optional[str] = None) -> int:
    """Returns `result` (an address as int) of a function that gives NULL on failure."""
    if not result:
        raise_last_error(context)
    return result


def take_string(pointer: Optional[int], context: Optional[str] = None) -> str:
    """Reads and releases a NUL-terminated string the library returned."""
    address = check_pointer(pointer, context)
    try:
        return ctypes.string_at(address).decode("utf-8", "replace")
    finally:
        vmm().vmm_release_buffer(address)


def take_json(pointer: Optional[int], context: Optional[str] = None) -> Any:
    """Reads, releases and parses a JSON document the library returned (statistics and
    snapshots; never on the path that shares tensors)."""
    return json.loads(take_string(pointer, context))


def take_buffer(pointer: Any, length: int) -> bytes:
    """Reads and releases a buffer of `length` bytes the library returned."""
    try:
        return ctypes.string_at(pointer, length)
    finally:
        quick().vmm_release_buffer(pointer)


def backend_name(code: int) -> str:
    """"cuda" or "host" for a vmm_backend value (ValueError for others)."""
    name = BACKEND_NAMES.get(code)
    if name is None:
        raise ValueError(f"backend {code!r} is not VMM_BACKEND_CUDA or VMM_BACKEND_HOST")
    return name


def backend() -> str:
    """"cuda" when a CUDA driver and device are present, else "host" (VMM_BACKEND forces)."""
    return backend_name(vmm().vmm_default_backend())


def check_pool_options(text: str) -> None:
    """ValueError, saying what is wrong, unless `text` (format_options' form) parses as pool
    options; creates nothing. Loads libvmm.so: the library holds the one parser."""
    check(quick().vmm_check_pool_options(text.encode("utf-8")))


def parse_size(text: str) -> int:
    """A byte count from text, as vmm's options read sizes: "4096", "512M", "2G", "64MiB"
    (a whole number; K, M, G and T are powers of 1024, either case; a B or iB may follow).
    ValueError, naming the text, for anything else (fractions, signs, unknown suffixes, more
    than 64 bits). Loads libvmm.so: the library holds the one parser."""
    if not isinstance(text, str):
        raise ValueError(f"size {text!r} is a {type(text).__name__}, expected a str")
    if "\0" in text:
        raise ValueError(f"size {text!r} contains a NUL character")
    out = ctypes.c_uint64()
    check(quick().vmm_parse_byte_size(text.encode("utf-8"), ctypes.byref(out)))
    return int(out.value)
