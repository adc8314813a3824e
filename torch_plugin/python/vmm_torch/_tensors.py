"""Tensor metadata helpers used by several modules: shapes, strides, element sizes, and dtypes
by a stable code (how a dtype travels in a shared tensor's payload).

Imports torch only (a bottom layer of the package).
"""

from __future__ import annotations

import numbers
from typing import Dict, Iterable, List, Sequence, Tuple, Union

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


def shape_list(shape: ShapeLike) -> List[int]:
    """`shape` (an int or a sequence of ints) as a list; ValueError for negative or non-int
    extents."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (int(shape),)
    shape = tuple(shape)
    out = []
    for extent in shape:
        if isinstance(extent, bool) or not isinstance(extent, numbers.Integral) or extent < 0:
            raise ValueError(f"shape {shape!r}: extents must be non-negative ints")
        out.append(int(extent))
    return out


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of `shape`."""
    n = 1
    for extent in shape:
        n *= extent
    return n


_element_sizes: Dict[torch.dtype, int] = {}


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    size = _element_sizes.get(dtype)
    if size is None:
        size = _element_sizes[dtype] = torch.empty((), dtype=dtype).element_size()
    return size
