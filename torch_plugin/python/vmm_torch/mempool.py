"""vmm_torch.MemPool: a torch.cuda.MemPool whose memory comes from vmm."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from . import _cuda, _lib
from ._options import format_options
from .allocator import FULL_ALLOCATOR, DeviceLike, device_index, enabled_hooks, flatten_stats


def _base() -> type:
    """torch.cuda.MemPool, or a stand-in that refuses (torch without MemPool)."""
    base = getattr(torch.cuda, "MemPool", None)
    if isinstance(base, type):
        return base
    return object


class MemPool(_base()):  # type: ignore[misc]
    """A ``torch.cuda.MemPool`` over vmm, for ``with torch.cuda.use_mem_pool(pool):``.

    ``MemPool(device=None, use_on_oom=False, **options)``: `options` are those of
    :func:`vmm_torch.enable` (``handle_type``, ``memory_limit``, ...) and apply to this pool's
    memory only. It works with or without :func:`vmm_torch.enable` and after CUDA is
    initialised, the way NCCL's and vLLM's allocators are used:

    - without ``enable()`` (PyTorch's own allocator current), PyTorch gives each tensor of the
      pool a segment of its own (``no_split``) and asks vmm for it: from a vmm pool of this
      MemPool's (one per device, with `options`);
    - with ``enable()``, vmm serves the pool itself (a private pool with `options`), as it
      serves CUDA graph pools.

    Either way each tensor is a vmm block of its own: exporting it (``torch.multiprocessing``,
    :func:`vmm_torch.export_tensor`) never exposes another tensor's bytes. Statistics:
    :meth:`vmm_memory_stats` (vmm's), ``pool.snapshot()`` and ``torch.cuda.memory_snapshot``
    (PyTorch's). RuntimeError where the package has no vmm CUDA allocator module
    (``vmm_torch._cuda``: a CPU build of torch, or one older than 2.3).
    """

    def __init__(self, device: DeviceLike = None, use_on_oom: bool = False,
                 **options: Any) -> None:
        module = _cuda.module(_lib.load())
        if module is None or not isinstance(torch.cuda.__dict__.get("MemPool"), type):
            raise RuntimeError(
                f"vmm_torch.MemPool needs a CUDA build of torch 2.3 or later and vmm's CUDA "
                f"allocator module (built by pip install there); torch {torch.__version__} "
                f"here")
        text = format_options(options)
        # Checked here, as vmm's own API refuses a bad option (ValueError): past this point
        # libvmm parses them inside PyTorch's calls, which raise RuntimeError as PyTorch's
        # allocator does.
        _lib.check_pool_options(text)
        self._vmm_device = device_index(device)
        self._vmm_allocator = module.pool_allocator(text)
        # no_split is for PyTorch's own allocator (a segment, so a vmm block, per tensor); where
        # vmm's is current it would give each tensor a chunk of its own, which this pool does
        # not need.
        no_split = FULL_ALLOCATOR not in enabled_hooks()
        with torch.cuda.device(self._vmm_device):
            super().__init__(self._vmm_allocator, use_on_oom=use_on_oom, no_split=no_split)

    def __del__(self) -> None:
        # The allocator object lives on (PyTorch may still free segments through it); its
        # vmm pools close now: cached memory goes back, live blocks when they are freed.
        allocator = self.__dict__.get("_vmm_allocator")
        if allocator is None:
            return
        try:
            _cuda.module(_lib.load()).close_pool_allocator(allocator)
        except Exception:  # interpreter shutdown: the process's memory goes with it
            pass

    @property
    def vmm_device(self) -> int:
        """The CUDA device whose memory the pool holds."""
        return self._vmm_device

    def vmm_pool_ids(self) -> List[int]:
        """vmm's ids of the pools that hold this MemPool's memory (see the class comment)."""
        id0, id1 = self.id
        return list(_cuda.module(_lib.load()).pool_ids(self._vmm_allocator, self._vmm_device, id0, id1))

    def vmm_memory_stats(self) -> Dict[str, Any]:
        """vmm's statistics of this pool's memory, keyed as ``torch.cuda.memory_stats()``
        (summed over the vmm pools behind it; ``vmm.`` keys of the first one)."""
        total: Dict[str, Any] = {}
        for pool in self.vmm_pool_ids():
            stats = flatten_stats(_lib.take_json(_lib.vmm().vmm_pool_stats_json(pool),
                                                 "MemPool.vmm_memory_stats"))
            for key, value in stats.items():
                if key in total and isinstance(value, (int, float)) and key.endswith(
                        (".current", ".peak", ".allocated", ".freed")):
                    total[key] += value
                else:
                    total.setdefault(key, value)
        return total


def full_allocator_available() -> bool:
    """Whether vmm's own CUDA allocator module (vmm_torch._cuda) is there: what enable() needs
    for torch.cuda's memory functions and CUDA graphs, and MemPool needs at all."""
    return _cuda.module(_lib.load()) is not None
