"""vmm as a full CUDA allocator of PyTorch: the module ``_cuda_allocator.so``.

``pip install`` builds it where torch has CUDA (2.3 or later; ``torch_plugin/csrc/
vmm_cuda_allocator.cpp``). Made current by :func:`vmm_torch.enable`, it answers
``torch.cuda.memory_stats()`` and everything built on it, ``memory_snapshot()``,
``_record_memory_history()``, CUDA graph pools (``torch.cuda.graph``, ``torch.compile``'s
CUDA graph trees) and OOM observers from vmm; :class:`vmm_torch.MemPool` uses it without
``enable()``. Where it was not built (a CPU build of torch, an older one, or one whose
allocator interface it does not compile against), :func:`module` returns None and enable()
falls back to ``CUDAPluggableAllocator``, which covers allocation only.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from types import ModuleType
from typing import Any, Optional

#: The module's file, beside libvmm.so and _C.so (vmm_torch._lib.library_dir).
MODULE_FILE = "_cuda_allocator.so"

_module: Optional[ModuleType] = None
_looked = False
_lock = threading.Lock()
_log = logging.getLogger("vmm_torch")


def module(libs: Any) -> Optional[ModuleType]:
    """The module beside the libraries `libs` loaded (a vmm_torch._lib.Libraries), bound to
    their libvmm.so, or None where it was not built or cannot be loaded (a module built against
    another torch: said once in a warning, and vmm_torch falls back)."""
    global _module, _looked
    if _looked:  # every send asks: no lock once it was looked for
        return _module
    with _lock:
        if not _looked:
            _module = _load(libs)
            _looked = True  # after _module: a thread that sees it set finds the module too
        return _module


def _load(libs: Any) -> Optional[ModuleType]:
    path = os.path.join(os.path.dirname(libs.extension_path), MODULE_FILE)
    if not os.path.exists(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location("vmm_torch._cuda_allocator", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        loaded.bind(libs.libvmm_path)
    except (ImportError, RuntimeError) as error:  # built against another torch: fall back
        _log.warning("vmm_torch: %s cannot be used (%s); falling back to "
                     "CUDAPluggableAllocator", path, error)
        return None
    return loaded
