"""Buffer descriptors: the plain data that describes an exported vmm buffer.

A buffer spans one or more physical allocations. Its descriptor holds one opaque 64-byte
handle per allocation in address order, the allocation sizes, the buffer's size and offset
inside the allocations, and the UUID of the exporting device (used in error messages). Two kinds
share this shape:

- ``FabricBufferDescriptor``: CUDA fabric handles (``handle_type == "fabric"``);
- ``PosixFdBufferDescriptor``: tokens naming POSIX file descriptors held by the exporting
  process, fetched from it on import (``handle_type == "posix_fd"``).

Nothing is pinned: a descriptor parked in a queue keeps no memory alive, so the exporter must
keep the buffer alive until every importer has imported it.

A descriptor is its canonical encoding (``to_bytes()``); its fields are decoded from it by the
C library (``vmm_descriptor_decode``, into a struct: no text on the way) when first read, and
kept. Built with:

- ``from_bytes()``: bytes from elsewhere, untrusted: decoded (every rule checked) at once;
  invalid input raises ValueError;
- ``from_handles()``: parts received through any transport; the C library validates them as
  it builds the encoding, which is then trusted;
- ``from_trusted_bytes()``: bytes this process's vmm produced (an export): not checked again.

Descriptors compare equal when their canonical encodings are equal and pickle as that
encoding.
"""

from __future__ import annotations

import ctypes
import numbers
import operator
from typing import Any, ClassVar, Dict, Iterable, List, NamedTuple, Optional, Tuple, Type

from . import _lib
from ._signatures import (BACKEND_NAMES, HANDLE_BYTES, HANDLE_FABRIC, HANDLE_POSIX_FD,
                          HANDLE_TYPE_NAMES, DescriptorFields)

BytesLike = Any  # bytes, bytearray or memoryview

_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)


class Fields(NamedTuple):
    """A descriptor's decoded fields (vmm_descriptor_fields, in Python types)."""

    handle_type: str  # "posix_fd" or "fabric"
    backend: Optional[str]  # "cuda" or "host", from the owner UUID; None if unknown
    handles: Tuple[bytes, ...]
    sizes: Tuple[int, ...]
    size: int
    offset: int
    owner_uuid: Optional[str]


def decode(data: bytes) -> Fields:
    """Decodes canonical descriptor bytes with vmm_descriptor_decode (which checks every
    rule: ValueError for anything that is not a valid descriptor)."""
    raw = DescriptorFields()
    vmm = _lib.quick()
    _lib.check(vmm.vmm_descriptor_decode(data, len(data), ctypes.byref(raw)))
    try:
        count = int(raw.count)
        block = ctypes.string_at(raw.handles, count * HANDLE_BYTES) if count else b""
        handles = tuple(block[i:i + HANDLE_BYTES] for i in range(0, len(block), HANDLE_BYTES))
        sizes = tuple(int(raw.sizes[i]) for i in range(count))
        owner = None
        if raw.owner_uuid:
            owner = ctypes.string_at(raw.owner_uuid, int(raw.owner_uuid_len)).decode(
                "utf-8", "replace")
        handle_type = HANDLE_TYPE_NAMES.get(int(raw.handle_type), str(raw.handle_type))
        return Fields(handle_type, BACKEND_NAMES.get(int(raw.backend)), handles, sizes,
                      int(raw.size), int(raw.offset), owner)
    finally:
        vmm.vmm_descriptor_fields_release(ctypes.byref(raw))


def as_bytes(data: BytesLike) -> bytes:
    """`data` (bytes, bytearray or memoryview) as bytes; TypeError for anything else."""
    if type(data) is bytes:
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"a descriptor is bytes, not {type(data).__name__}")


# --- from_handles' argument checks (before the C call, with the C++ rules' messages) --------


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _handle_list(handles: List[Any]) -> List[bytes]:
    out = []
    for i, handle in enumerate(handles):
        if isinstance(handle, (bytes, bytearray, memoryview)):
            out.append(bytes(handle))
        else:
            raise ValueError(
                f"handle {i} is a {type(handle).__name__}, expected {HANDLE_BYTES} bytes")
    return out


def _size_list(sizes: List[Any]) -> List[int]:
    out = []
    for i, size in enumerate(sizes):
        if not _is_int(size):
            raise ValueError(
                f"allocation size {i} is {size!r} ({type(size).__name__}), "
                f"expected a positive integer")
        size = operator.index(size)
        if size < _INT64_MIN:
            raise ValueError(f"allocation size {i} is {size}, expected a positive integer")
        if size > _INT64_MAX:
            raise ValueError(f"allocation size {i} is {size}, larger than 2**63 - 1 bytes")
        out.append(size)
    return out


def _optional_int(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if not _is_int(value):
        raise ValueError(f"{name} is {value!r} ({type(value).__name__}), expected an integer")
    return operator.index(value)


def _owner_text(owner_uuid: Optional[str]) -> Optional[bytes]:
    if owner_uuid is None:
        return None
    if not isinstance(owner_uuid, str):
        raise ValueError(
            f"owner_uuid is a {type(owner_uuid).__name__}, expected a str or None")
    if "\0" in owner_uuid:
        raise ValueError("owner_uuid may not contain NUL characters")
    return owner_uuid.encode("utf-8")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _out_of_range(name: str, value: int, total: int) -> ValueError:
    return ValueError(f"{name} {value} is outside [0, {total}]")


def _encode_from_handles(type_code: int, handles: List[bytes], sizes: List[int],
                         size: Optional[int], owner: Optional[bytes], offset: int) -> bytes:
    """Calls vmm_descriptor_from_handles and returns the canonical bytes."""
    count = len(handles)
    c_handles = (ctypes.c_char_p * count)(*handles)
    c_lengths = (ctypes.c_size_t * count)(*(len(h) for h in handles))
    c_sizes = (ctypes.c_int64 * count)(*sizes)
    out = ctypes.c_void_p()
    out_len = ctypes.c_size_t()
    rc = _lib.vmm().vmm_descriptor_from_handles(
        type_code, c_handles, c_lengths, c_sizes, count, -1 if size is None else size, owner,
        offset, ctypes.byref(out), ctypes.byref(out_len))
    _lib.check(rc)
    return _lib.take_buffer(out, out_len.value)


class BufferDescriptor:
    """Base of the descriptor classes; see the module docstring.

    Attributes: ``handle_type``, ``handles`` (tuple of 64-byte bytes, address order),
    ``sizes`` (tuple of positive ints, same order), ``size`` (bytes of the buffer),
    ``offset`` (where the buffer starts in the first allocation), ``owner_uuid`` (str or
    None), ``backend`` ("cuda", "host" or None: the exporter's backend, as its owner UUID
    says), ``mapped_size`` (sum of ``sizes``). Reading any of them (but ``handle_type``)
    decodes the encoding once.
    """

    handle_type: ClassVar[Optional[str]] = None
    HANDLE_TYPE_CODE: ClassVar[Optional[int]] = None

    _bytes: bytes
    _fields: Optional[Fields]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"build a {type(self).__name__} with from_handles() or from_bytes()")

    @classmethod
    def _make(cls, data: bytes, fields: Optional[Fields]) -> "BufferDescriptor":
        self = object.__new__(cls)
        self._bytes = data
        self._fields = fields
        return self

    @classmethod
    def _from_fields(cls, data: bytes, fields: Fields) -> "BufferDescriptor":
        subclass = _BY_TYPE.get(fields.handle_type)
        if subclass is None:
            raise ValueError(f"descriptor has handle type {fields.handle_type!r}")
        if cls is not BufferDescriptor and subclass is not cls:
            raise ValueError(
                f"descriptor has handle type {subclass.handle_type!r}, "
                f"not {cls.handle_type!r} ({cls.__name__})")
        return subclass._make(data, fields)

    @classmethod
    def from_bytes(cls, data: BytesLike) -> "BufferDescriptor":
        """Parses a canonical encoding (as from ``to_bytes()``). The bytes are treated as
        untrusted: anything that is not a valid descriptor raises ValueError. Called on
        ``BufferDescriptor`` it returns the subclass the bytes name."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"a descriptor is bytes, not {type(data).__name__}")
        data = as_bytes(data)
        return cls._from_fields(data, decode(data))

    @classmethod
    def from_trusted_bytes(cls, data: bytes) -> "BufferDescriptor":
        """A descriptor over bytes that this process's vmm produced (vmm_export,
        vmm_descriptor_from_handles), which need no checking. Called on a subclass nothing
        is decoded until a field is read; called on ``BufferDescriptor`` the bytes are
        decoded once, to find the subclass."""
        data = as_bytes(data)
        if cls is BufferDescriptor:
            return cls._from_fields(data, decode(data))
        return cls._make(data, None)

    @classmethod
    def from_handles(cls, handles: Iterable[BytesLike], sizes: Iterable[int], *,
                     size: Optional[int] = None, owner_uuid: Optional[str] = None,
                     offset: Optional[int] = 0) -> "BufferDescriptor":
        """Builds a descriptor from handles received through a transport of your own.

        Args:
            handles: one opaque 64-byte handle per physical allocation, in address order.
            sizes: one positive allocation size per handle, in the same order.
            size: buffer size, between zero and the sum of sizes; by default the sum
                (less ``offset``).
            owner_uuid: the UUID of the exporting device, used to name the owner in errors.
            offset: where the buffer starts inside the allocations (default 0; None is 0).

        Raises:
            ValueError: if the counts differ, a handle is not 64 bytes, an allocation size
                is not a positive integer, or the buffer size is outside the allocation
                sizes.
        """
        if cls.HANDLE_TYPE_CODE is None:
            raise TypeError("call from_handles on FabricBufferDescriptor or "
                            "PosixFdBufferDescriptor")
        handles = list(handles)
        sizes = list(sizes)
        # vmm_descriptor_from_handles takes one count for both arrays, so this rule (the
        # first one C++ checks) is applied here, with the C++ message.
        if len(handles) != len(sizes):
            raise ValueError(
                f"{_count(len(handles), 'handle')} but {_count(len(sizes), 'size')}")
        handle_bytes = _handle_list(handles)
        size_ints = _size_list(sizes)
        size = _optional_int("size", size)
        offset = _optional_int("offset", offset)
        if offset is None:  # as the default
            offset = 0
        owner = _owner_text(owner_uuid)
        if offset > _INT64_MAX or offset < _INT64_MIN:
            raise _out_of_range("offset", offset, sum(size_ints))
        # The C function reads a negative size as "the default": check those here, after
        # the other rules (so errors come in the same order as in C++).
        explicit = size is not None and 0 <= size <= _INT64_MAX
        data = _encode_from_handles(cls.HANDLE_TYPE_CODE, handle_bytes, size_ints,
                                    size if explicit else None, owner, offset)
        if size is not None and not explicit:
            raise _out_of_range("size", size, sum(size_ints))
        return cls._make(data, None)  # built (and checked) by the C library: trusted

    def to_bytes(self) -> bytes:
        """The canonical, versioned encoding: same content, same bytes."""
        return self._bytes

    @property
    def fields(self) -> Fields:
        """All fields at once (decoded on first use)."""
        fields = self._fields
        if fields is None:
            fields = self._fields = decode(self._bytes)
        return fields

    @property
    def handles(self) -> Tuple[bytes, ...]:
        return self.fields.handles

    @property
    def sizes(self) -> Tuple[int, ...]:
        return self.fields.sizes

    @property
    def size(self) -> int:
        return self.fields.size

    @property
    def offset(self) -> int:
        return self.fields.offset

    @property
    def owner_uuid(self) -> Optional[str]:
        return self.fields.owner_uuid

    @property
    def backend(self) -> Optional[str]:
        """"cuda" or "host": the backend that exported the buffer, as its owner UUID says
        (None when it does not)."""
        return self.fields.backend

    @property
    def mapped_size(self) -> int:
        return sum(self.fields.sizes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BufferDescriptor):
            return NotImplemented
        return self._bytes == other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __repr__(self) -> str:
        f = self.fields
        return (f"{type(self).__name__}(handles=<{len(f.handles)} x {HANDLE_BYTES} bytes>, "
                f"sizes={f.sizes!r}, size={f.size}, offset={f.offset}, "
                f"owner_uuid={f.owner_uuid!r})")

    def __reduce__(self) -> Tuple[Any, Tuple[bytes]]:
        return (descriptor_from_bytes, (self._bytes,))


class FabricBufferDescriptor(BufferDescriptor):
    """Descriptor of a buffer exported with fabric handles. ``handle_type`` is "fabric".

    Fabric handles need an NVLink fabric and an IMEX channel on CUDA; vmm's host backend
    emulates them on machines without a GPU.
    """

    handle_type = "fabric"
    HANDLE_TYPE_CODE = HANDLE_FABRIC


class PosixFdBufferDescriptor(BufferDescriptor):
    """Descriptor of a buffer exported as POSIX file descriptors. ``handle_type`` is
    "posix_fd". Each handle is a token naming an fd that the exporting process holds; an
    importer fetches the fds from that process, which must still be running."""

    handle_type = "posix_fd"
    HANDLE_TYPE_CODE = HANDLE_POSIX_FD


_BY_TYPE: Dict[Optional[str], Type[BufferDescriptor]] = {
    FabricBufferDescriptor.handle_type: FabricBufferDescriptor,
    PosixFdBufferDescriptor.handle_type: PosixFdBufferDescriptor,
}


def descriptor_from_bytes(data: BytesLike) -> BufferDescriptor:
    """The descriptor (of the right class) whose canonical encoding is `data` (untrusted:
    checked; ValueError if it is not one). Also what unpickling a descriptor calls."""
    return BufferDescriptor.from_bytes(data)


# Pickles made before descriptor_from_bytes was the unpickler name this one.
_descriptor_from_bytes = descriptor_from_bytes
