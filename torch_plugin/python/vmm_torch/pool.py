"""Explicit vmm pools: tensors allocated from a pool of your own, on a GPU or on the host."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

from . import _lib, _registry
from ._devices import parse_device
from ._options import format_options
from ._signatures import BACKEND_CUDA, BACKEND_HOST, HANDLE_TYPE_NAMES
from ._streams import pool_stream
from ._tensors import ShapeLike, contiguous_strides, element_size, shape_list, tensor_nbytes
from .allocator import flatten_stats

PoolDevice = Union[int, str, torch.device]

def pool_device(device: PoolDevice) -> Tuple[Union[str, int], int, int]:
    """(``Pool.device``, vmm_backend, device index) for Pool's `device`: "host" (or "cpu", a
    CPU torch.device) is the host backend's device 0; a CUDA index, "cuda", "cuda:N" or a
    CUDA torch.device is that CUDA device. ValueError for anything else (negative or huge
    indices, "host:1", bools, floats; vmm_torch._devices)."""
    kind, index = parse_device(device)
    if kind == "host":
        return "host", BACKEND_HOST, 0
    index = 0 if index is None else index
    return index, BACKEND_CUDA, index


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

    _id: Optional[int] = None

    def __init__(self, device: PoolDevice, handle_type: str = "auto", **options: Any) -> None:
        self._device, backend, index = pool_device(device)
        text = format_options(dict(options, handle_type=handle_type))
        vmm = _lib.vmm()
        pool_id = _lib.check_id(vmm.vmm_pool_create(backend, index, text.encode()), "Pool")
        code = vmm.vmm_pool_handle_type(pool_id)
        if code < 0:
            try:
                _lib.raise_last_error("Pool")
            finally:
                vmm.vmm_pool_destroy(pool_id)
        self._handle_type: str = HANDLE_TYPE_NAMES.get(code, str(code))
        self._torch_device = (torch.device("cpu") if self._device == "host"
                              else torch.device("cuda", index))
        self._id = pool_id
        _registry.register(pool_id, self)

    @property
    def device(self) -> Union[str, int]:
        """"host" or the CUDA device index."""
        return self._device

    @property
    def handle_type(self) -> str:
        """The handle type the pool's memory is exportable as: "fabric", "posix_fd" or
        "none"."""
        return self._handle_type

    @property
    def closed(self) -> bool:
        return self._id is None

    @property
    def id(self) -> Optional[int]:
        return self._id

    def _require_open(self) -> int:
        if self._id is None:
            raise ValueError("the pool is closed")
        return self._id

    def _stream(self) -> Optional[int]:
        if self._device == "host":
            return None
        return pool_stream(torch.cuda.current_stream(self._torch_device)) or None

    def empty(self, shape: ShapeLike, dtype: torch.dtype = torch.float32,
              shareable: bool = False) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype` in this pool.

        With ``shareable=True`` the block gets physical chunks of its own, so exporting it
        retires no memory that other tensors could use. On CUDA the block is allocated for
        the current stream.

        Extents are ints (TypeError otherwise, as in PyTorch); a negative extent, or a shape
        whose byte size (or a stride) does not fit in 64 bits, is a ValueError; a size the
        pool cannot hold is torch.cuda.OutOfMemoryError.
        """
        pool_id = self._require_open()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        sizes = shape_list(shape)
        nbytes = tensor_nbytes(sizes, element_size(dtype))
        libs = _lib.load()
        ptr = _lib.check_pointer(
            libs.vmm.vmm_pool_alloc(pool_id, max(nbytes, 1), self._stream(),
                                    int(bool(shareable))),
            f"Pool.empty({tuple(sizes)}, {dtype})")
        try:
            return libs.wrap(ptr, nbytes, sizes, contiguous_strides(sizes), 0, dtype,
                             self._torch_device)
        except BaseException:
            libs.vmm.vmm_block_free(ptr)
            raise

    def zeros(self, shape: ShapeLike, dtype: torch.dtype = torch.float32,
              shareable: bool = False) -> torch.Tensor:
        """Like empty(), filled with zeros."""
        return self.empty(shape, dtype, shareable).zero_()

    def memory_stats(self) -> Dict[str, Any]:
        """The pool's statistics, with the keys of :func:`vmm_torch.memory_stats`."""
        pool_id = self._require_open()
        return flatten_stats(
            _lib.take_json(_lib.vmm().vmm_pool_stats_json(pool_id), "Pool.memory_stats"))

    def empty_cache(self) -> None:
        """Returns the pool's entirely free chunks to the driver."""
        _lib.check(_lib.vmm().vmm_pool_empty_cache(self._require_open()), "Pool.empty_cache")

    def describe(self) -> Dict[str, Any]:
        """{"device", "handle_type", "stats"} (used by vmm_torch.dump_stats)."""
        return {"device": self._device, "handle_type": self._handle_type,
                "stats": self.memory_stats()}

    def close(self) -> None:
        """Closes the pool (idempotent). Tensors already allocated stay valid; the pool's
        memory goes back to the driver once the last of them is freed."""
        pool_id, self._id = self._id, None
        if pool_id is None:
            return
        _registry.unregister(pool_id)
        _lib.check(_lib.vmm().vmm_pool_destroy(pool_id), "Pool.close")

    def __repr__(self) -> str:
        state = "closed" if self._id is None else f"id={self._id}"
        return f"Pool(device={self._device!r}, handle_type={self._handle_type!r}, {state})"


def open_pool_stats() -> Dict[str, Dict[str, Any]]:
    """{pool id: {"device", "handle_type", "stats"}} of the explicit pools open now."""
    return _registry.open_pool_stats()
