"""Buffer descriptors: the plain data that describes an exported vmm buffer.

A buffer spans one or more physical allocations. Its descriptor holds one opaque 64-byte
handle per allocation in address order, the allocation sizes, the buffer's size and offset
inside the allocations, and the exporting device's UUID (used in error messages). Two kinds
share this shape:

- ``FabricBufferDescriptor``: CUDA fabric handles (``handle_type == "fabric"``);
- ``PosixFdBufferDescriptor``: tokens naming POSIX file descriptors held by the exporting
  process, fetched from it on import (``handle_type == "posix_fd"``).

Nothing is pinned: a descriptor parked in a queue keeps no memory alive, so the exporter must
keep the buffer alive until every importer has imported it.

Descriptors are built with ``from_handles()`` (parts received through any transport) or
``from_bytes()`` (the canonical encoding, ``to_bytes()``). Both are validated by the C
library, which applies the one set of rules; invalid input raises ValueError. Descriptors
compare equal when their canonical encodings are equal and pickle as that encoding.
"""

import ctypes
import numbers
import operator

from . import _lib

HANDLE_BYTES = 64
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _handle_list(handles):
    out = []
    for i, handle in enumerate(list(handles)):
        if isinstance(handle, (bytes, bytearray, memoryview)):
            out.append(bytes(handle))
        else:
            raise ValueError(
                f"handle {i} is a {type(handle).__name__}, expected {HANDLE_BYTES} bytes")
    return out


def _size_list(sizes):
    out = []
    for i, size in enumerate(list(sizes)):
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


def _optional_int(name, value):
    if value is None:
        return None
    if not _is_int(value):
        raise ValueError(f"{name} is {value!r} ({type(value).__name__}), expected an integer")
    return operator.index(value)


def _owner_text(owner_uuid):
    if owner_uuid is None:
        return None
    if not isinstance(owner_uuid, str):
        raise ValueError(
            f"owner_uuid is a {type(owner_uuid).__name__}, expected a str or None")
    if "\0" in owner_uuid:
        raise ValueError("owner_uuid may not contain NUL characters")
    return owner_uuid.encode("utf-8")


def _count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _check_counts(handles, sizes):
    # vmm_descriptor_from_handles takes one count for both arrays, so this rule (the first
    # one C++ checks) is applied here, with the C++ message.
    if len(handles) != len(sizes):
        raise ValueError(f"{_count(len(handles), 'handle')} but {_count(len(sizes), 'size')}")


def _out_of_range(name, value, total):
    return ValueError(f"{name} {value} is outside [0, {total}]")


def _encode_from_handles(type_code, handles, sizes, size, owner, offset):
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


def _parse(data):
    """The fields of a descriptor's canonical bytes, as a dict (ValueError if not one)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"a descriptor is bytes, not {type(data).__name__}")
    data = bytes(data)
    fields = _lib.take_json(_lib.vmm().vmm_descriptor_json(data, len(data)))
    fields["handles"] = tuple(bytes.fromhex(h) for h in fields["handles"])
    fields["sizes"] = tuple(int(s) for s in fields["sizes"])
    return data, fields


class BufferDescriptor:
    """Base of the descriptor classes; see the module docstring.

    Attributes: ``handle_type``, ``handles`` (tuple of 64-byte bytes, address order),
    ``sizes`` (tuple of positive ints, same order), ``size`` (bytes of the buffer),
    ``offset`` (where the buffer starts in the first allocation), ``owner_uuid`` (str or
    None), ``mapped_size`` (sum of ``sizes``).
    """

    handle_type = None
    _TYPE_CODE = None

    def __init__(self, *args, **kwargs):
        raise TypeError(f"build a {type(self).__name__} with from_handles() or from_bytes()")

    @classmethod
    def _from_parsed(cls, data, fields):
        subclass = _BY_TYPE.get(fields["handle_type"])
        if subclass is None:
            raise ValueError(f"descriptor has handle type {fields['handle_type']!r}")
        if cls is not BufferDescriptor and subclass is not cls:
            raise ValueError(
                f"descriptor has handle type {subclass.handle_type!r}, "
                f"not {cls.handle_type!r} ({cls.__name__})")
        self = object.__new__(subclass)
        self._bytes = data
        self._handles = fields["handles"]
        self._sizes = fields["sizes"]
        self._size = int(fields["size"])
        self._offset = int(fields["offset"])
        self._owner_uuid = fields["owner_uuid"]
        return self

    @classmethod
    def from_bytes(cls, data):
        """Parses a canonical encoding (as from ``to_bytes()``). The bytes are treated as
        untrusted: anything that is not a valid descriptor raises ValueError. Called on
        ``BufferDescriptor`` it returns the subclass the bytes name."""
        data, fields = _parse(data)
        return cls._from_parsed(data, fields)

    @classmethod
    def from_handles(cls, handles, sizes, *, size=None, owner_uuid=None, offset=0):
        """Builds a descriptor from handles received through a transport of your own.

        Args:
            handles: one opaque 64-byte handle per physical allocation, in address order.
            sizes: one positive allocation size per handle, in the same order.
            size: buffer size, between zero and the sum of sizes; by default the sum
                (less ``offset``).
            owner_uuid: the exporting device's UUID, used to name the owner in errors.
            offset: where the buffer starts inside the allocations (default 0).

        Raises:
            ValueError: if the counts differ, a handle is not 64 bytes, an allocation size
                is not a positive integer, or the buffer size is outside the allocation
                sizes.
        """
        if cls._TYPE_CODE is None:
            raise TypeError("call from_handles on FabricBufferDescriptor or "
                            "PosixFdBufferDescriptor")
        handles = list(handles)
        sizes = list(sizes)
        _check_counts(handles, sizes)
        handles = _handle_list(handles)
        sizes = _size_list(sizes)
        size = _optional_int("size", size)
        offset = _optional_int("offset", offset)
        owner = _owner_text(owner_uuid)
        if offset > _INT64_MAX or offset < _INT64_MIN:
            raise _out_of_range("offset", offset, sum(sizes))
        # The C function reads a negative size as "the default": check those here, after
        # the other rules (so errors come in the same order as in C++).
        explicit = size is not None and 0 <= size <= _INT64_MAX
        data = _encode_from_handles(cls._TYPE_CODE, handles, sizes,
                                    size if explicit else None, owner, offset)
        if size is not None and not explicit:
            raise _out_of_range("size", size, sum(sizes))
        return cls.from_bytes(data)

    def to_bytes(self):
        """The canonical, versioned encoding: same content, same bytes."""
        return self._bytes

    @property
    def handles(self):
        return self._handles

    @property
    def sizes(self):
        return self._sizes

    @property
    def size(self):
        return self._size

    @property
    def offset(self):
        return self._offset

    @property
    def owner_uuid(self):
        return self._owner_uuid

    @property
    def mapped_size(self):
        return sum(self._sizes)

    def __eq__(self, other):
        if not isinstance(other, BufferDescriptor):
            return NotImplemented
        return self._bytes == other._bytes

    def __hash__(self):
        return hash(self._bytes)

    def __repr__(self):
        return (f"{type(self).__name__}(handles=<{len(self._handles)} x {HANDLE_BYTES} bytes>, "
                f"sizes={self._sizes!r}, size={self._size}, offset={self._offset}, "
                f"owner_uuid={self._owner_uuid!r})")

    def __reduce__(self):
        return (_descriptor_from_bytes, (self._bytes,))


class FabricBufferDescriptor(BufferDescriptor):
    """Descriptor of a buffer exported with fabric handles. ``handle_type`` is "fabric".

    Fabric handles need an NVLink fabric and an IMEX channel on CUDA; vmm's host backend
    emulates them on machines without a GPU.
    """

    handle_type = "fabric"
    _TYPE_CODE = 2


class PosixFdBufferDescriptor(BufferDescriptor):
    """Descriptor of a buffer exported as POSIX file descriptors. ``handle_type`` is
    "posix_fd". Each handle is a token naming an fd that the exporting process holds; an
    importer fetches the fds from that process, which must still be running."""

    handle_type = "posix_fd"
    _TYPE_CODE = 1


_BY_TYPE = {
    FabricBufferDescriptor.handle_type: FabricBufferDescriptor,
    PosixFdBufferDescriptor.handle_type: PosixFdBufferDescriptor,
}


def _descriptor_from_bytes(data):
    """Unpickles a descriptor (module level so that pickle finds it)."""
    return BufferDescriptor.from_bytes(data)


def descriptor_from_bytes(data):
    """The descriptor (of the right class) whose canonical encoding is `data`."""
    return BufferDescriptor.from_bytes(data)
