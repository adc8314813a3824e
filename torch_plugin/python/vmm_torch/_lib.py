"""Loading vmm's shared libraries and calling its C interface (torch_plugin/vmm_c.h).

Two libraries live next to this file (or in $VMM_LIB_DIR):

- ``libvmm.so``: the allocator, its pools, imports and descriptors, behind a C interface that
  this module binds with ctypes;
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

Loading happens on first use (``load()``), so that ``import vmm_torch`` and the statistics
command line work without the libraries.
"""

import ctypes
import json
import os
import threading

import torch

LIBVMM_NAME = "libvmm.so"
EXTENSION_NAME = "_C.so"

_c_int = ctypes.c_int
_c_int64 = ctypes.c_int64
_c_size_t = ctypes.c_size_t
_c_void_p = ctypes.c_void_p
_c_char_p = ctypes.c_char_p

# name: (restype, argtypes) of every vmm_c.h function this package calls. Functions returning
# a string or buffer to release are declared as returning c_void_p.
_SIGNATURES = {
    "vmm_last_error": (_c_char_p, []),
    "vmm_backend": (_c_char_p, []),
    "vmm_release_buffer": (None, [_c_void_p]),
    "vmm_configure": (_c_int, [_c_char_p]),
    "vmm_empty_cache": (_c_int, [_c_int]),
    "vmm_set_memory_fraction": (_c_int, [ctypes.c_double, _c_int]),
    "vmm_stats_json": (_c_void_p, [_c_int]),
    "vmm_reset_peak_stats": (_c_int, [_c_int]),
    "vmm_reset_accumulated_stats": (_c_int, [_c_int]),
    "vmm_snapshot_json": (_c_void_p, []),
    "vmm_pool_create": (_c_int64, [_c_char_p, _c_char_p]),
    "vmm_pool_destroy": (_c_int, [_c_int64]),
    "vmm_pool_alloc": (_c_void_p, [_c_int64, _c_size_t, _c_void_p, _c_int]),
    "vmm_pool_empty_cache": (_c_int, [_c_int64]),
    "vmm_pool_stats_json": (_c_void_p, [_c_int64]),
    "vmm_pool_handle_type": (_c_char_p, [_c_int64]),
    "vmm_pool_device": (_c_int, [_c_int64]),
    "vmm_block_free": (None, [_c_void_p]),
    "vmm_owns": (_c_int, [_c_void_p]),
    "vmm_export": (_c_int, [_c_void_p, ctypes.POINTER(_c_void_p), ctypes.POINTER(_c_size_t)]),
    "vmm_import": (_c_int64, [_c_char_p, _c_size_t, _c_int, _c_char_p, _c_int]),
    "vmm_import_info": (
        _c_int,
        [_c_int64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(_c_size_t),
         ctypes.POINTER(_c_int)],
    ),
    "vmm_import_retain": (_c_int, [_c_int64]),
    "vmm_import_release": (None, [_c_void_p]),
    "vmm_descriptor_from_handles": (
        _c_int,
        [_c_int, ctypes.POINTER(_c_char_p), ctypes.POINTER(_c_size_t),
         ctypes.POINTER(_c_int64), _c_size_t, _c_int64, _c_char_p, _c_int64,
         ctypes.POINTER(_c_void_p), ctypes.POINTER(_c_size_t)],
    ),
    "vmm_descriptor_json": (_c_void_p, [_c_char_p, _c_size_t]),
}


class Closable:
    """Gives a class with an idempotent close() the context-manager protocol, and closes it
    when it is collected (errors there are swallowed: the interpreter may be shutting down)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class VmmError(RuntimeError):
    """A failure reported by vmm's C library.

    ``code`` is the status code ("NOT_FOUND", "UNAVAILABLE", "FAILED_PRECONDITION", ...): a
    stale descriptor gives NOT_FOUND, an exporter that has exited UNAVAILABLE. Invalid
    arguments are raised as ValueError and out-of-memory as torch.cuda.OutOfMemoryError (or
    MemoryError) instead.
    """

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code


def _out_of_memory_type():
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom if oom is not None else MemoryError


def error_from_status(text):
    """Maps a status text "CODE: message" from vmm_last_error() to a Python exception."""
    code, sep, message = text.partition(": ")
    if not sep or not code.replace("_", "").isalpha() or not code.isupper():
        code, message = "UNKNOWN", text
    if code == "INVALID_ARGUMENT":
        return ValueError(message)
    if code == "RESOURCE_EXHAUSTED":
        return _out_of_memory_type()(message)
    return VmmError(text, code)


def library_dir():
    """Where libvmm.so and _C.so are looked for: $VMM_LIB_DIR, else this package's folder."""
    override = os.environ.get("VMM_LIB_DIR")
    if override:
        return os.path.abspath(override)
    return os.path.dirname(os.path.abspath(__file__))


class _Libraries:
    """The loaded libraries: ``vmm`` (ctypes handle of libvmm.so), ``quick`` (the same library
    bound without releasing the GIL), the extension's path, and its operators ``wrap``,
    ``wrap_import`` and ``storage_info`` (their single overloads)."""

    def __init__(self, directory):
        self.libvmm_path = os.path.join(directory, LIBVMM_NAME)
        self.extension_path = os.path.join(directory, EXTENSION_NAME)
        for path in (self.libvmm_path, self.extension_path):
            if not os.path.exists(path):
                raise ImportError(
                    f"vmm_torch: {path} is missing; install the package with pip (see "
                    f"torch_plugin/python/README.md) or set VMM_LIB_DIR to the folder that holds "
                    f"{LIBVMM_NAME} and {EXTENSION_NAME}")
        self.vmm = ctypes.CDLL(self.libvmm_path)
        self.quick = ctypes.PyDLL(self.libvmm_path)
        for handle in (self.vmm, self.quick):
            for name, (restype, argtypes) in _SIGNATURES.items():
                function = getattr(handle, name)
                function.restype = restype
                function.argtypes = argtypes
        torch.ops.load_library(self.extension_path)
        torch.ops.vmm.bind(self.libvmm_path)
        self.wrap = torch.ops.vmm.wrap.default
        self.wrap_import = torch.ops.vmm.wrap_import.default
        self.storage_info = torch.ops.vmm.storage_info.default


_loaded = None
_load_lock = threading.Lock()


def load():
    """Loads both libraries once per process and returns them."""
    global _loaded
    if _loaded is None:
        with _load_lock:
            if _loaded is None:
                _loaded = _Libraries(library_dir())
    return _loaded


def vmm():
    """The ctypes handle of libvmm.so (loading it on first use)."""
    return load().vmm


def quick():
    """libvmm.so bound with ctypes.PyDLL: the calls keep the GIL. For short calls only (see
    the module docstring); never for one that can block."""
    return load().quick


def ops():
    """torch.ops.vmm, the extension's operators (loading the libraries on first use)."""
    load()
    return torch.ops.vmm


def last_error():
    return (vmm().vmm_last_error() or b"").decode("utf-8", "replace")


def raise_last_error(context=None):
    """Raises the exception that describes this thread's last vmm failure."""
    error = error_from_status(last_error() or "UNKNOWN: vmm call failed")
    if context:
        error.args = (f"{context}: {error.args[0]}",) + error.args[1:]
    raise error


def check(result, context=None):
    """Returns `result` of a function that gives 0 on success and -1 on failure."""
    if result != 0:
        raise_last_error(context)
    return result


def check_id(result, context=None):
    """Returns `result` of a function that gives an id, or -1 on failure."""
    if result < 0:
        raise_last_error(context)
    return result


def check_pointer(result, context=None):
    """Returns `result` (an address as int) of a function that gives NULL on failure."""
    if not result:
        raise_last_error(context)
    return result


def take_string(pointer, context=None):
    """Reads and releases a NUL-terminated string the library returned."""
    check_pointer(pointer, context)
    try:
        return ctypes.string_at(pointer).decode("utf-8", "replace")
    finally:
        vmm().vmm_release_buffer(pointer)


def take_json(pointer, context=None):
    """Reads, releases and parses a JSON document the library returned."""
    return json.loads(take_string(pointer, context))


def take_buffer(pointer, length):
    """Reads and releases a buffer of `length` bytes the library returned."""
    try:
        return ctypes.string_at(pointer, length)
    finally:
        quick().vmm_release_buffer(pointer)


def backend():
    """"cuda" when a CUDA driver and device are present, else "host" (VMM_BACKEND forces)."""
    return vmm().vmm_backend().decode()
