"""Tensor metadata helpers used by several modules: shapes, strides, element sizes, and dtypes
by a stable code (how a dtype travels in a shared tensor's payload).

Imports torch only (a bottom layer of the package).
"""

from __future__ import annotations

import collections.abc
import numbers
import operator
from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch

ShapeLike = Union[int, Iterable[int]]
DtypeCode = Union[int, str]

# Dtypes travel as their index in this table; others as their name. A table of names keeps
# the indices the same in every process, whichever dtypes its torch has. Append only.
DTYPE_NAMES: Tuple[str, ...] = (
    "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64",
    "bool", "complex64", "complex128")
_DTYPES: Tuple[object, ...] = tuple(getattr(torch, name, None) for name in DTYPE_NAMES)
_DTYPE_CODES: Dict[torch.dtype, int] = {
    dtype: code for code, dtype in enumerate(_DTYPES) if isinstance(dtype, torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32."""
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch.dtype named `name` ("float32"); ValueError for anything that is not the name
    of a dtype (the text may come from another process: it is only looked up, never run)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"unknown dtype {name!r}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_code(dtype: torch.dtype) -> DtypeCode:
    """The stable code of `dtype`: its index in DTYPE_NAMES, or its name if not there."""
    code = _DTYPE_CODES.get(dtype)
    return code if code is not None else dtype_name(dtype)


def dtype_from_code(code: DtypeCode) -> torch.dtype:
    """The dtype of a code from dtype_code(); ValueError for an unknown one."""
    if type(code) is int:
        if 0 <= code < len(_DTYPES):
            dtype = _DTYPES[code]
            if isinstance(dtype, torch.dtype):
                return dtype
        raise ValueError(f"unknown dtype code {code!r}")
    if isinstance(code, str):
        return dtype_from_name(code)
    raise ValueError(f"unknown dtype code {code!r}")


def contiguous_strides(shape: Sequence[int]) -> List[int]:
    """Row-major strides (in elements) of `shape`."""
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return list(reversed(strides))


INT64_MAX = 2**63 - 1
MAX_DIMS = 64  # more than any tensor needs; bounds the work a received payload can ask for


def _extent(value: Any, shape: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"shape {shape!r}: extents must be ints, not bool")
    try:
        extent = operator.index(value)
    except TypeError:
        raise TypeError(f"shape {shape!r}: extents must be ints, not "
                        f"{type(value).__name__}") from None
    if extent < 0:
        raise ValueError(f"shape {shape!r}: extents must be non-negative")
    if extent > INT64_MAX:
        raise ValueError(f"shape {shape!r}: extent {extent} does not fit in 64 bits")
    return extent


def shape_list(shape: ShapeLike) -> List[int]:
    """`shape` (an int or a sequence of ints) as a list. As PyTorch: TypeError for extents
    that are not ints (floats, bools, None, strings); ValueError for negative extents,
    extents beyond 2**63 - 1, and more than MAX_DIMS dimensions."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (numbers.Integral, collections.abc.Iterable)):
        raise TypeError(f"shape {shape!r} is not an int or a sequence of ints")
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    shape = tuple(shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    return [_extent(extent, shape) for extent in shape]


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of `shape`."""
    n = 1
    for extent in shape:
        n *= extent
    return n


def tensor_nbytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of a contiguous tensor of `shape` (non-negative extents) and `itemsize`;
    ValueError if that, or one of its strides, does not fit in a signed 64-bit integer (the
    product overflows: no memory could hold it, and PyTorch could not describe it)."""
    reach = itemsize  # bytes spanned by the largest stride times its extent
    for extent in shape:
        reach *= max(extent, 1)
    nbytes = numel(shape) * itemsize
    if reach > INT64_MAX or nbytes > INT64_MAX:
        raise ValueError(f"shape {tuple(shape)!r} of {itemsize}-byte elements needs "
                         f"{max(reach, nbytes)} bytes, more than 2**63 - 1")
    return nbytes


def view_ints(values: Any, name: str) -> Tuple[int, ...]:
    """A received payload's shape or strides as a tuple of ints: a list or tuple (TypeError
    otherwise) of at most MAX_DIMS ints (TypeError for other types, bools included;
    ValueError beyond the signed 64-bit range). Whether the view fits its buffer is checked
    by the wrap_import operator."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} is a {type(values).__name__}, expected a tuple of ints")
    if len(values) > MAX_DIMS:
        raise ValueError(f"{name} has {len(values)} dimensions, more than {MAX_DIMS}")
    return tuple(view_int(v, name) for v in values)


def view_int(value: Any, name: str) -> int:
    """A received payload's int (an extent, stride or storage offset): TypeError unless an
    int (bools refused), ValueError outside the signed 64-bit range."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: {type(value).__name__} {value!r:.60}, expected an int")
        value = int(value)
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError(f"{name}: {value} does not fit in 64 bits")
    return value


_element_sizes: Dict[torch.dtype, int] = {}


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    size = _element_sizes.get(dtype)
    if size is None:
        size = _element_sizes[dtype] = torch.empty((), dtype=dtype).element_size()
    return size
