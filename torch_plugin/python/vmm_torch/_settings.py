"""PyTorch's allocator settings given at run time while vmm is PyTorch's CUDA allocator.

``torch.cuda.memory._set_allocator_settings(text)`` hands ``text`` (PYTORCH_CUDA_ALLOC_CONF's
syntax: ``key:value`` items separated by commas, a value may be a bracketed list) to PyTorch's
parser, which requires a ``backend`` item to name the allocator in place. With PyTorch's
allocator, naming the backend the process started with (``native`` unless the environment
says otherwise) is accepted and changes nothing; with vmm in place the parser raises, since
vmm's allocator is named ``vmm``. Programs that apply their configuration string again after
start-up name it. ``install()`` wraps the function so that such an item is left out before
PyTorch parses the rest; any other ``backend`` (which PyTorch's allocator refuses too) and
every other item go through as given. A call given only that item returns without calling
PyTorch. Calls of ``torch._C._accelerator_setAllocatorSettings`` itself are not wrapped.
"""
import os
from typing import Any, Callable, List, Optional

#: The variables PyTorch reads its allocator configuration from at start-up.
CONFIG_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_installed = False


def split_items(text: str) -> List[str]:
    """The top-level items of a configuration string: split at commas outside brackets
    (``roundup_power2_divisions:[256:1,512:2]`` is one item)."""
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
    """The value of a ``backend:VALUE`` item (spaces around either part allowed), else None."""
    key, sep, value = item.partition(":")
    if not sep or key.strip() != "backend":
        return None
    return value.strip()


def startup_backend(environ: Any = None) -> str:
    """The backend the process's allocator configuration named at start-up: the last
    ``backend`` item of the configuration variables, ``native`` where none names one."""
    environ = os.environ if environ is None else environ
    backend = "native"
    for name in CONFIG_VARIABLES:
        for item in split_items(environ.get(name) or ""):
            value = _backend_of(item)
            if value:
                backend = value
    return backend


def without_startup_backend(text: str, startup: str) -> Optional[str]:
    """``text`` less its ``backend`` items that name `startup` (what PyTorch's allocator
    accepts as a no-op); None where nothing else is left. Text with no such item is
    returned unchanged."""
    items = split_items(text)
    kept = [item for item in items if _backend_of(item) != startup]
    if len(kept) == len(items):
        return text
    kept = [item for item in kept if item.strip()]
    return ",".join(kept) if kept else None


def wrap(setter: Callable[[str], Any], startup: str) -> Callable[[str], Any]:
    """`setter` (``_set_allocator_settings``) with the start-up backend's items left out."""
    def set_allocator_settings(env: str) -> Any:
        text = without_startup_backend(env, startup) if isinstance(env, str) else env
        if text is None:
            return None
        return setter(text)

    set_allocator_settings.__doc__ = setter.__doc__
    set_allocator_settings.__wrapped__ = setter  # type: ignore[attr-defined]
    return set_allocator_settings


def install() -> None:
    """Wraps torch.cuda.memory._set_allocator_settings (where this torch has it), and the same
    function where torch.cuda holds it too, once vmm is PyTorch's CUDA allocator."""
    global _installed
    if _installed:
        return
    import torch.cuda
    import torch.cuda.memory as memory

    setter = getattr(memory, "_set_allocator_settings", None)
    if setter is None:
        return
    wrapped = wrap(setter, startup_backend())
    for module in (memory, torch.cuda):
        if getattr(module, "_set_allocator_settings", None) is setter:
            module._set_allocator_settings = wrapped
    _installed = True
