"""PyTorch's allocator settings given at run time while vmm is PyTorch's CUDA allocator.

``torch.cuda.memory._set_allocator_settings(text)`` (and ``torch._C``'s function it calls,
``_accelerator_setAllocatorSettings`` from torch 2.9, ``_cuda_cudaCachingAllocator_set_
allocator_settings`` before, which programs also call directly) hands ``text``
(PYTORCH_CUDA_ALLOC_CONF's syntax: ``key:value`` items separated by commas, a value may be a
bracketed list; whitespace is ignored) to PyTorch's parser, which requires a ``backend`` item
to name the allocator in place. With PyTorch's allocator, naming the backend the process
started with is accepted and changes nothing; with vmm in place the parser raises, since
vmm's allocator is named ``vmm``. Programs that apply their configuration string again after
start-up (or write back what ``_accelerator_getAllocatorSettings()`` read) name it.

``install(startup)``, called by ``enable()`` before vmm takes PyTorch's place, wraps those
``torch._C`` functions so that an item naming ``startup`` (the allocator that was in place,
``torch.cuda.get_allocator_backend()``) is left out before PyTorch parses the rest; any other
``backend`` (which PyTorch's allocator refuses too) and every other item go through as given,
and a string with no such item goes through unchanged. The Python function finds the wrapped
one at each call, so calls through it, and functions bound before ``enable()``, are covered.
"""
import functools
import logging
import os
from typing import Any, Callable, List, Mapping, Optional

_log = logging.getLogger("vmm_torch")

#: The torch._C functions that parse a settings string (the first this torch has is used by
#: torch.cuda.memory._set_allocator_settings; each is wrapped where present).
SETTERS = ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings")

_installed = False


def split_items(text: str) -> List[str]:
    """The top-level items of a configuration string: split at commas outside brackets
    (``roundup_power2_divisions:[256:1,512:2]`` is one item); empty items are kept."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _backend_of(item: str) -> Optional[str]:
    """The value of a ``backend:VALUE`` item (whitespace anywhere ignored, as PyTorch's
    tokenizer does), else None."""
    key, sep, value = "".join(item.split()).partition(":")
    return value if sep and key == "backend" else None


def startup_backend_from(environ: Mapping[str, str]) -> str:
    """The backend the configuration variables name for a process starting with `environ`, as
    torch 2.9+ reads them (PYTORCH_ALLOC_CONF where it is set at all, else
    PYTORCH_CUDA_ALLOC_CONF; the last backend item), ``native`` where none names one: the
    fallback where torch.cuda.get_allocator_backend() cannot say."""
    text = environ.get("PYTORCH_ALLOC_CONF")
    if text is None:
        text = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    backend = "native"
    for item in split_items(text):
        value = _backend_of(item)
        if value:
            backend = value
    return backend


def startup_backend() -> str:
    """The allocator in place now (before vmm takes its place): what PyTorch's parser compares
    a backend item with."""
    try:
        import torch.cuda

        return str(torch.cuda.get_allocator_backend())
    except Exception:  # noqa: BLE001  (an older torch: read the variables as it would)
        return startup_backend_from(os.environ)


def without_backend(text: str, startup: str) -> str:
    """`text` less its top-level items that name `startup` as the backend (a no-op with the
    allocator PyTorch started with); unchanged where it has none."""
    items = split_items(text)
    kept = [item for item in items if _backend_of(item) != startup]
    return text if len(kept) == len(items) else ",".join(kept)


def wrap(setter: Callable[[str], Any], startup: str) -> Callable[[str], Any]:
    """`setter` (a torch._C settings function) with `startup`'s backend items left out. A
    string of that item alone becomes "" (still parsed: PyTorch resets what a parse resets)."""
    @functools.wraps(setter)
    def set_allocator_settings(env: Any) -> Any:
        return setter(without_backend(env, startup) if isinstance(env, str) else env)

    return set_allocator_settings


def install(startup: str) -> None:
    """Wraps torch._C's settings functions (those this torch has), once, for `startup`."""
    global _installed
    if _installed:
        return
    try:
        import torch

        for name in SETTERS:
            setter = getattr(torch._C, name, None)
            if setter is not None:
                setattr(torch._C, name, wrap(setter, startup))
        _installed = True
    except Exception as error:  # noqa: BLE001  (enable() goes on; only this is not covered)
        _log.warning("vmm_torch: could not wrap PyTorch's allocator settings: %s", error)
