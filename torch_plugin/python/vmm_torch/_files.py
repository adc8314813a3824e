"""Writing output files whole: what dump_stats and the statistics command line write.

:func:`write_file` writes through symlinks to the regular file they name (the final target is
replaced, the link stays), refuses to replace anything that exists and is not a regular file
(a directory, a device node, a FIFO, a socket), writes a temporary file beside the target
(created exclusively, with an unpredictable name of :data:`TEMPORARY_NAME_BYTES` bytes
whatever the target's, so that a target's name up to the file system's limit works) and
renames it over the target, and removes the temporary file on every failure. Paths are str,
bytes or os.PathLike (os.fspath); anything else is a TypeError.

Imports nothing of the package (a bottom layer).
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Any, Callable, Union

PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

# The temporary file's name: ".vmm-XXXXXXXX.tmp", never longer whatever the target's name (a
# name built from the target's would not fit beside a target whose name nears NAME_MAX).
_TEMPORARY_PREFIX, _TEMPORARY_SUFFIX = ".vmm-", ".tmp"
TEMPORARY_NAME_BYTES = len(_TEMPORARY_PREFIX) + 8 + len(_TEMPORARY_SUFFIX)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def fs_path(path: Any) -> str:
    """`path` (str, bytes or os.PathLike) as a str (bytes decoded with the file system
    encoding, undecodable bytes kept as surrogates: the same file). TypeError otherwise."""
    if isinstance(path, (bool, int)):  # os.fspath would also refuse; say what is expected
        raise TypeError(f"a path is a str, bytes or os.PathLike, not {type(path).__name__}")
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(
            f"a path is a str, bytes or os.PathLike, not {type(path).__name__}") from None
    path = os.fsdecode(path)
    if "\0" in path:
        raise ValueError(f"path {path!r} contains a NUL character")
    if not path:
        raise ValueError("the path is empty")
    return path


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _new_file_mode() -> int:
    """0o666 less this process's umask (read without changing it, where Linux says it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o644


def resolve_target(path: PathArg) -> str:
    """The file that writing `path` replaces: symlinks followed to their final target (which
    need not exist yet). FileExistsError if that exists and is not a regular file."""
    target = os.path.realpath(fs_path(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(mode):
        shown = fs_path(path)
        via = "" if target == os.path.abspath(shown) else f" (via {shown!r})"
        raise FileExistsError(
            f"{target!r}{via} exists and is {_kind(mode)}, not a regular file; "
            f"refusing to replace it")
    return target


def write_file(path: PathArg, write: Callable[[Any], None], binary: bool = False) -> str:
    """Writes the file `path` whole: `write(f)` fills a temporary file (a text file, or a
    binary one with `binary`) that then replaces the target (see the module docstring).
    Returns the path written (the final target). Nothing is left behind on failure."""
    target = resolve_target(path)
    directory = os.path.dirname(target)
    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        mode = _new_file_mode()
    fd, temporary = tempfile.mkstemp(prefix=_TEMPORARY_PREFIX, suffix=_TEMPORARY_SUFFIX,
                                     dir=directory)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else
                                                      {"encoding": "utf-8"})) as f:
            os.fchmod(f.fileno(), mode)
            write(f)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return target
