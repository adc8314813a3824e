"""Sharing tensors between processes as buffer descriptors.

Exporter::

    shared = vmm_torch.export_tensor(t)     # t lives in a vmm pool
    send(pickle.dumps(shared))              # any transport; keep t alive until imported

Importer (any process)::

    t = pickle.loads(received).open()       # a tensor over the same memory

The descriptor pins nothing: the exporter must keep the tensor alive until every importer has
opened it. After that the importer's mapping is its own (the exporter may free or exit).
"""

import ctypes

import torch

from . import _lib
from .descriptors import BufferDescriptor, descriptor_from_bytes
from .pool import contiguous_strides, element_size


def _descriptor_bytes(descriptor):
    if isinstance(descriptor, BufferDescriptor):
        return descriptor.to_bytes()
    if isinstance(descriptor, (bytes, bytearray, memoryview)):
        return bytes(descriptor)
    raise TypeError(f"expected a buffer descriptor or its bytes, not {type(descriptor).__name__}")


def _import_device(device):
    """The device argument of vmm_import: -1 (the owner's device) or a CUDA index."""
    if device is None:
        return -1
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return -1
        device = device.index if device.index is not None else 0
    elif isinstance(device, str):
        parsed = torch.device(device)
        if parsed.type == "cpu":
            return -1
        device = parsed.index if parsed.index is not None else 0
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device {device!r} is not a CUDA device index")
    return device


def import_backend(descriptor, backend=None):
    """The backend an import of `descriptor` uses: `backend` if given, else "host" for a
    descriptor exported by vmm's host backend (owner "HOST-..."), else this process's
    default backend (the rule vmm_import applies)."""
    if backend:
        if backend not in ("cuda", "host"):
            raise ValueError(f"backend {backend!r} is not 'cuda' or 'host'")
        return backend
    owner = descriptor.owner_uuid if isinstance(descriptor, BufferDescriptor) else None
    if owner is not None and owner.startswith("HOST-"):
        return "host"
    return _lib.backend()


def _import_id(descriptor, device=None, backend=None):
    """Imports `descriptor` (a BufferDescriptor or canonical bytes, which vmm_import parses
    and validates: malformed bytes raise ValueError) and returns the import id (holding one
    reference). Releases the GIL: an import maps memory and may fetch fds from the exporter."""
    data = descriptor if type(descriptor) is bytes else _descriptor_bytes(descriptor)
    return _lib.check_id(
        _lib.vmm().vmm_import(data, len(data), _import_device(device),
                              backend.encode() if backend else None, 0),
        "import")


def _release(import_id):
    _lib.vmm().vmm_import_release(ctypes.c_void_p(import_id))


class ImportedBuffer(_lib.Closable):
    """An imported buffer: ``ptr`` (address of its first byte), ``size`` (bytes), ``device``
    (the CUDA device it is mapped on; -1 for the host backend) and ``backend`` ("cuda" or
    "host"). ``close()`` (idempotent, also on leaving a ``with`` block) unmaps it once no
    tensor made by ``as_tensor()`` uses it any more."""

    def __init__(self, import_id, backend):
        self._id = import_id
        self.backend = backend
        self.ptr, self.size, self.device = _import_info(import_id)

    @property
    def closed(self):
        return self._id is None

    def as_tensor(self, dtype=torch.uint8, shape=None):
        """A tensor over the buffer (bytes as uint8 by default) that keeps the mapping alive
        on its own, even after close()."""
        if self._id is None:
            raise ValueError("the imported buffer is closed")
        itemsize = element_size(dtype)
        if shape is None:
            shape = [self.size // itemsize]
        shape = list(shape)
        _lib.check(_lib.quick().vmm_import_retain(self._id))
        return _wrap_import(self._id, shape, contiguous_strides(shape), 0, dtype)

    def close(self):
        import_id, self._id = self._id, None
        if import_id is not None:
            _release(import_id)

    def __repr__(self):
        state = "closed" if self._id is None else f"ptr={self.ptr:#x}"
        return f"ImportedBuffer({state}, size={self.size}, device={self.device})"


def import_buffer(descriptor, device=None, backend=None):
    """Imports a buffer descriptor (object or canonical bytes) and returns an ImportedBuffer.

    `device`: the CUDA device to map on (default: the exporting device, found by UUID).
    `backend`: "cuda" or "host" (default: from the descriptor's owner). Stale or forged
    descriptors raise VmmError (code NOT_FOUND, or UNAVAILABLE when the exporting process has
    exited) naming the owner; malformed ones raise ValueError.
    """
    if not isinstance(descriptor, BufferDescriptor):
        descriptor = descriptor_from_bytes(_descriptor_bytes(descriptor))
    backend = import_backend(descriptor, backend)
    return ImportedBuffer(_import_id(descriptor, device, backend), backend)


def _import_info(import_id):
    """(address, size, device) of an import: device is the CUDA device it is mapped on, -1
    for the host backend."""
    ptr, size, device = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
    _lib.check(_lib.quick().vmm_import_info(import_id, ctypes.byref(ptr), ctypes.byref(size),
                                            ctypes.byref(device)), "import")
    return ptr.value, size.value, device.value


def _wrap_import(import_id, sizes, strides, storage_offset, dtype):
    """A tensor over the buffer of import `import_id`, on the device it is mapped on (CPU for
    the host backend), that releases one reference of the import when its storage dies (the
    caller hands that reference over, also on failure). One operator call: it gets the
    buffer's address, size and device from libvmm.so itself, and checks that the view (a
    received payload is hostile input) lies inside the buffer."""
    try:
        return _lib.load().wrap_import(import_id, sizes, strides, storage_offset, dtype)
    except BaseException:
        _release(import_id)
        raise


def _dtype_from_name(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class SharedTensor:
    """A tensor exported from a vmm pool: its buffer descriptor and the metadata to rebuild it.

    Attributes: ``descriptor`` (a FabricBufferDescriptor or PosixFdBufferDescriptor),
    ``dtype``, ``shape``, ``stride``, ``storage_offset`` (in elements), ``device_type``
    ("cuda" or "cpu"), ``device_index`` (exporting CUDA device or None) and
    ``storage_nbytes``. Picklable with plain pickle; ``open()`` imports it.
    """

    def __init__(self, descriptor, dtype, shape, stride, storage_offset, device_type,
                 storage_nbytes, device_index=None):
        if not isinstance(descriptor, BufferDescriptor):
            raise TypeError("descriptor must be a FabricBufferDescriptor or "
                            "PosixFdBufferDescriptor")
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type {device_type!r} is not 'cuda' or 'cpu'")
        self.descriptor = descriptor
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.stride = tuple(int(s) for s in stride)
        self.storage_offset = int(storage_offset)
        self.device_type = device_type
        self.storage_nbytes = int(storage_nbytes)
        self.device_index = device_index

    def open(self, device=None):
        """Imports the descriptor and returns a tensor over the shared memory with the
        exported dtype, shape, strides and storage offset. The mapping lives as long as any
        view of the returned tensor. `device`: CUDA device to map on (default: the
        exporting device); ignored for CPU tensors."""
        backend = "cuda" if self.device_type == "cuda" else "host"
        import_id = _import_id(self.descriptor, device if backend == "cuda" else None, backend)
        return _wrap_import(import_id, self.shape, self.stride, self.storage_offset, self.dtype)

    def __getstate__(self):
        return {
            "descriptor": self.descriptor.to_bytes(),
            "dtype": _dtype_name(self.dtype),
            "shape": self.shape,
            "stride": self.stride,
            "storage_offset": self.storage_offset,
            "device_type": self.device_type,
            "storage_nbytes": self.storage_nbytes,
            "device_index": self.device_index,
        }

    def __setstate__(self, state):
        self.__init__(descriptor_from_bytes(state["descriptor"]),
                      _dtype_from_name(state["dtype"]), state["shape"], state["stride"],
                      state["storage_offset"], state["device_type"], state["storage_nbytes"],
                      state.get("device_index"))

    def __eq__(self, other):
        if not isinstance(other, SharedTensor):
            return NotImplemented
        return self.__getstate__() == other.__getstate__()

    def __repr__(self):
        return (f"SharedTensor({self.descriptor.handle_type}, dtype={self.dtype}, "
                f"shape={self.shape}, stride={self.stride}, "
                f"storage_offset={self.storage_offset}, device_type={self.device_type!r}, "
                f"storage_nbytes={self.storage_nbytes})")


def storage_base(t):
    """(address, nbytes) of the storage of tensor `t`."""
    base, nbytes = _lib.load().storage_info(t)
    return int(base), int(nbytes)


def _storage_address(t):
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


def _vmm_storage_address(t):
    """Address of the storage of tensor `t` if it lies in a vmm pool, else 0."""
    base = _storage_address(t)
    return base if base and _lib.quick().vmm_owns(base) else 0


def in_vmm_pool(t):
    """Whether `t`'s storage lies in a vmm pool (the enabled allocator or an explicit pool)."""
    return isinstance(t, torch.Tensor) and _vmm_storage_address(t) != 0


def _export_bytes(ptr):
    """The descriptor bytes of the vmm block at `ptr` (vmm_export)."""
    out = ctypes.c_void_p()
    length = ctypes.c_size_t()
    _lib.check(_lib.quick().vmm_export(ptr, ctypes.byref(out), ctypes.byref(length)),
               "export_tensor")
    return _lib.take_buffer(out, length.value)


def export_tensor(t):
    """Exports a tensor whose storage lives in a vmm pool and returns a SharedTensor.

    The whole storage is exported (views keep their offset and strides). The chunks the
    storage spans are marked exported: their free space is never given to another tensor, so
    an importer can only ever see this tensor's data. Keep `t` alive until every importer has
    opened the SharedTensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"export_tensor expects a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"export_tensor: {t.layout} tensors cannot be exported")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"export_tensor: {t.device.type} tensors cannot be exported")
    base, nbytes = storage_base(t)
    descriptor = descriptor_from_bytes(_export_bytes(base))
    return SharedTensor(descriptor, t.dtype, t.shape, t.stride(), t.storage_offset(),
                        t.device.type, nbytes, t.device.index if t.is_cuda else None)
