"""What VMM_TORCH_ENABLE does in each process (run by the ``_vmm_torch_autoenable`` module
that the package's .pth file loads at interpreter start, right after ``torch`` is imported).

:func:`run` enables vmm with the variable's options where this PyTorch can (a CUDA build,
CUDA not yet initialised: a process forked from one that enabled vmm keeps its parent's
allocator) and installs the torch.multiprocessing reducers in every case, so that host pools
and received tensors travel as vmm sends on CPU-only PyTorch too.
"""

from __future__ import annotations

from . import allocator, reductions


def run() -> bool:
    """Applies VMM_TORCH_ENABLE; returns whether vmm is PyTorch's CUDA allocator now.
    Malformed options raise ValueError (the caller prints it)."""
    enabled = allocator.enable_from_environment()
    reductions.install_reducers()
    return enabled
