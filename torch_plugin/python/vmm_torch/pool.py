"""Explicit vmm pools: tensors allocated from a pool of your own, on a GPU or on the host."""

import threading
import weakref

import torch

from . import _lib
from ._options import format_options
from .allocator import flatten_stats

_open_pools = weakref.WeakValueDictionary()  # pool id -> Pool
_open_pools_lock = threading.Lock()


def open_pool_stats():
    """{pool id: {"device", "handle_type", "stats"}} of the explicit pools open now."""
    with _open_pools_lock:
        pools = list(_open_pools.items())
    return {str(pool_id): pool.describe() for pool_id, pool in pools if not pool.closed}


def contiguous_strides(shape):
    """Row-major strides (in elements) of `shape`."""
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return list(reversed(strides))


def _shape_list(shape):
    if isinstance(shape, int):
        shape = (shape,)
    out = []
    for extent in shape:
        if isinstance(extent, bool) or not isinstance(extent, int) or extent < 0:
            raise ValueError(f"shape {tuple(shape)!r}: extents must be non-negative ints")
        out.append(int(extent))
    return out


_element_sizes = {}


def element_size(dtype):
    """Bytes per element of `dtype`."""
    if dtype not in _element_sizes:
        _element_sizes[dtype] = torch.empty((), dtype=dtype).element_size()
    return _element_sizes[dtype]


def _device_text(device):
    """("host" or the CUDA index, option text of the device) for Pool's `device`."""
    if isinstance(device, str) and device.strip().lower() in ("host", "cpu"):
        return "host", "host"
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return "host", "host"
        if device.type == "cuda":
            device = 0 if device.index is None else device.index
    if isinstance(device, str) and device.strip().lower().startswith("cuda"):
        parsed = torch.device(device)
        device = 0 if parsed.index is None else parsed.index
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device {device!r} is neither \"host\" nor a CUDA device index")
    return device, str(device)


class Pool(_lib.Closable):
    """A vmm pool of its own on a CUDA device or on the host.

    ``Pool(device, handle_type="auto", **options)``: `device` is a CUDA device index (or
    "cuda:N") or "host" (vmm's host backend: memfd-backed memory any process can map, for
    CPU tensors and machines without a GPU). `handle_type` is "auto", "posix_fd", "fabric" or
    "none"; other options are those of :func:`vmm_torch.enable`.

    ``pool.empty(shape, dtype)`` returns a tensor whose storage is a block of the pool (a CPU
    tensor for "host"); the block returns to the pool when the storage dies. Tensors from a
    shareable pool can be exported (:func:`vmm_torch.export_tensor`). ``close()`` (or leaving
    a ``with`` block) closes the pool; its memory goes back once its last tensor is freed.
    """

    def __init__(self, device, handle_type="auto", **options):
        self._device, device_text = _device_text(device)
        options = dict(options, handle_type=handle_type)
        libs = _lib.load()
        self._id = _lib.check_id(
            libs.vmm.vmm_pool_create(device_text.encode(), format_options(options).encode()),
            "Pool")
        self._handle_type = libs.vmm.vmm_pool_handle_type(self._id).decode()
        self._torch_device = (torch.device("cpu") if self._device == "host"
                              else torch.device("cuda", self._device))
        with _open_pools_lock:
            _open_pools[self._id] = self

    @property
    def device(self):
        """"host" or the CUDA device index."""
        return self._device

    @property
    def handle_type(self):
        """The handle type the pool's memory is exportable as: "fabric", "posix_fd" or
        "none"."""
        return self._handle_type

    @property
    def closed(self):
        return self._id is None

    @property
    def id(self):
        return self._id

    def _require_open(self):
        if self._id is None:
            raise ValueError("the pool is closed")
        return self._id

    def _stream(self):
        if self._device == "host":
            return None
        return torch.cuda.current_stream(self._device).cuda_stream or None

    def empty(self, shape, dtype=torch.float32, shareable=False):
        """An uninitialised contiguous tensor of `shape` and `dtype` in this pool.

        With ``shareable=True`` the block gets physical chunks of its own, so exporting it
        retires no memory that other tensors could use. On CUDA the block is allocated for
        the current stream.
        """
        pool_id = self._require_open()
        sizes = _shape_list(shape)
        numel = 1
        for extent in sizes:
            numel *= extent
        nbytes = numel * element_size(dtype)
        vmm = _lib.vmm()
        ptr = _lib.check_pointer(
            vmm.vmm_pool_alloc(pool_id, max(nbytes, 1), self._stream(), int(bool(shareable))),
            f"Pool.empty({tuple(sizes)}, {dtype})")
        try:
            return _lib.load().wrap(ptr, nbytes, sizes, contiguous_strides(sizes), 0, dtype,
                                    self._torch_device)
        except BaseException:
            vmm.vmm_block_free(ptr)
            raise

    def zeros(self, shape, dtype=torch.float32, shareable=False):
        """Like empty(), filled with zeros."""
        return self.empty(shape, dtype, shareable).zero_()

    def memory_stats(self):
        """The pool's statistics, with the keys of :func:`vmm_torch.memory_stats`."""
        pool_id = self._require_open()
        return flatten_stats(
            _lib.take_json(_lib.vmm().vmm_pool_stats_json(pool_id), "Pool.memory_stats"))

    def empty_cache(self):
        """Returns the pool's entirely free chunks to the driver."""
        _lib.check(_lib.vmm().vmm_pool_empty_cache(self._require_open()), "Pool.empty_cache")

    def describe(self):
        """{"device", "handle_type", "stats"} (used by vmm_torch.dump_stats)."""
        return {"device": self._device, "handle_type": self._handle_type,
                "stats": self.memory_stats()}

    def close(self):
        """Closes the pool (idempotent). Tensors already allocated stay valid; the pool's
        memory goes back to the driver once the last of them is freed."""
        pool_id, self._id = self._id, None
        if pool_id is None:
            return
        with _open_pools_lock:
            _open_pools.pop(pool_id, None)
        _lib.check(_lib.vmm().vmm_pool_destroy(pool_id), "Pool.close")

    def __repr__(self):
        state = "closed" if self._id is None else f"id={self._id}"
        return f"Pool(device={self._device!r}, handle_type={self._handle_type!r}, {state})"
