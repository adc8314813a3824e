"""Device arguments: one parser for every public function that takes a device (Pool,
import_buffer, SharedTensor.open, the device-pool statistics).

A device is "host" or "cpu" (vmm's host backend), a CUDA device index, "cuda" or "cuda:N"
(either case, surrounding blanks ignored), or a torch.device of type cpu (index None or 0) or
cuda. Anything else is a ValueError naming the value, raised here, before torch or the
library sees it (torch.device("host:99") would raise RuntimeError): negative or huge indices,
"host:1", "cuda:-1", other device types, bools, floats, None.

Imports torch only (a bottom layer of the package).
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Optional, Tuple, Union

import torch

DeviceLike = Union[int, str, torch.device]

MAX_INDEX = 2**31 - 1  # CUDA device indices are C ints
_CUDA_TEXT = re.compile(r"cuda(?::([0-9]{1,10}))?")
_EXPECTED = "\"host\", \"cpu\", a CUDA device index, \"cuda\" or \"cuda:N\""


def bad_device(device: Any, expected: str = _EXPECTED) -> ValueError:
    """The ValueError for a device argument that is not `expected`."""
    return ValueError(f"device {device!r} is not {expected}")


def _index(device: Any, index: int) -> int:
    if not 0 <= index <= MAX_INDEX:
        raise bad_device(device)
    return index


def parse_device(device: Any) -> Tuple[str, Optional[int]]:
    """("host", None) or ("cuda", index; None for "cuda" without one) for a device argument
    (see the module docstring); ValueError for anything else."""
    if isinstance(device, str):
        text = device.strip().lower()
        if text in ("host", "cpu"):
            return "host", None
        match = _CUDA_TEXT.fullmatch(text)
        if match is None:
            raise bad_device(device)
        return "cuda", None if match.group(1) is None else _index(device, int(match.group(1)))
    if isinstance(device, torch.device):
        if device.type == "cpu" and device.index in (None, 0):
            return "host", None
        if device.type == "cuda":
            return "cuda", None if device.index is None else _index(device, device.index)
        raise bad_device(device)
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise bad_device(device)
    return "cuda", _index(device, int(device))


def cuda_index(device: Any, default: int = 0) -> int:
    """The CUDA device index of a device argument that must name a CUDA device (`default` for
    "cuda" without an index); ValueError for the host and anything else."""
    kind, index = parse_device(device)
    if kind != "cuda":
        raise bad_device(device, "a CUDA device")
    return default if index is None else index
