"""Turning Python keyword options into vmm's option text ("key=value,key=value").

The C library parses and validates the text (unknown keys and malformed values are errors
naming the key), so this module only spells Python values the way it reads them:

- sizes as ints (bytes) or strings with a K, M, G or T suffix ("40G");
- growth_fraction as a number;
- peer_devices as a list of device indices (or one index);
- handle_type as a string;
- isolate_sends as a bool (or 0/1).
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

_SEPARATORS = (",", "=")


def _format_peer_devices(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ":".join(_format_scalar("peer_devices", v) for v in value)
    return _format_scalar("peer_devices", value)


def _format_scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError(f"option {key}: {value!r} is a bool, expected a number or a string")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, str):
        if any(s in value for s in _SEPARATORS):
            raise ValueError(f"option {key}: {value!r} may not contain ',' or '='")
        return value.strip()
    raise ValueError(
        f"option {key}: {value!r} ({type(value).__name__}) is not a number or a string")


#: Options whose value is a flag: True/False are written 1/0.
_FLAGS = ("isolate_sends",)


def format_value(key: str, value: Any) -> str:
    """The text of one option's value."""
    if key == "peer_devices":
        return _format_peer_devices(value)
    if key in _FLAGS and isinstance(value, bool):
        return "1" if value else "0"
    return _format_scalar(key, value)


def format_options(options: Mapping[str, Any]) -> str:
    """The option text for a dict of options, keys in sorted order (None values are skipped)."""
    items = []
    for key in sorted(options):
        value = options[key]
        if value is None:
            continue
        if not key.isidentifier():
            raise ValueError(f"option name {key!r} is not valid")
        items.append(f"{key}={format_value(key, value)}")
    return ",".join(items)
