"""Turning Python keyword options into vmm's option text ("key=value,key=value").

The C library parses and validates the text (unknown keys and malformed values are errors
naming the key), so this module only spells Python values the way it reads them:

- sizes as ints (bytes) or strings with a K, M, G or T suffix ("40G");
- growth_fraction as a number;
- peer_devices as a list of device indices (or one index);
- handle_type as a string.
"""

import numbers
import re

_SEPARATORS = (",", "=")
_SIZE = re.compile(r"([0-9]+)(?:([KMGT])(?:I?B)?|B)?", re.IGNORECASE)
_SIZE_SHIFTS = {None: 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_size(text):
    """Bytes of a size: a whole number with an optional K, M, G or T suffix (powers of 1024,
    either case) and an optional "B" or "iB" ("64M", "64MiB", "2KB", "512B", "512").
    Surrounding whitespace is ignored. ValueError for anything else (the C library's grammar).
    """
    match = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a size in bytes (a whole number with an optional "
                         "K, M, G or T suffix, e.g. 512M)")
    value = int(match.group(1)) << _SIZE_SHIFTS[match.group(2) and match.group(2).upper()]
    if value >= 1 << 64:
        raise ValueError(f"{text!r} is not a size in bytes (more than 64 bits)")
    return value


def _format_peer_devices(value):
    if isinstance(value, (list, tuple)):
        return ":".join(_format_scalar("peer_devices", v) for v in value)
    return _format_scalar("peer_devices", value)


def _format_scalar(key, value):
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


def format_value(key, value):
    """The text of one option's value."""
    if key == "peer_devices":
        return _format_peer_devices(value)
    return _format_scalar(key, value)


def format_options(options):
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
