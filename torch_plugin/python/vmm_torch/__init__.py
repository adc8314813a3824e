"""vmm_torch: a CUDA virtual-memory caching allocator for PyTorch, and tensor sharing between
processes as multi-handle buffer descriptors.

    import vmm_torch
    vmm_torch.enable()                       # before CUDA is used
    ...                                      # CUDA tensors now live in vmm's pools
    vmm_torch.memory_stats()                 # PyTorch's key names plus "vmm." extras
    shared = vmm_torch.export_tensor(t)      # picklable; shared.open() in another process
    vmm_torch.install_reducers()             # torch.multiprocessing carries vmm tensors
    # or, for every process of a program: VMM_TORCH_ENABLE=1 python train.py
    vmm_torch.dump_stats("vmm.json")         # python -m vmm_torch.stats summarize vmm.json
    vmm_torch.parse_size("512M")             # 536870912: sizes as vmm's options read them

Explicit pools (``vmm_torch.Pool(device)``, device a CUDA index or "host") work without
enable(); "host" pools give CPU tensors in shareable memory, also where no GPU exists.
The native libraries (libvmm.so, _C.so) are loaded on first use; see ``vmm_torch._lib``.

Layers (each module imports only those above it): ``_signatures`` (the C interface's ctypes
declaration), ``_options``, ``_tensors``, ``_registry``, ``_cuda`` (vmm's own CUDA allocator
module, where built) -> ``_lib`` (loading, errors by code) -> ``descriptors``, ``allocator``
-> ``pool``, ``mempool``, ``sharing`` -> ``reductions``, ``distributed``.

``vmm_torch.MemPool(device, **options)`` is a ``torch.cuda.MemPool`` over vmm (for
``torch.cuda.use_mem_pool``), with or without enable().
"""

from ._lib import VmmError, library_dir, load, parse_size
from .allocator import (
    backend,
    dump_stats,
    empty_cache,
    enable,
    enabled_hooks,
    is_enabled,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    send_stats,
    set_per_process_memory_fraction,
)
from .descriptors import BufferDescriptor, FabricBufferDescriptor, PosixFdBufferDescriptor
from .mempool import MemPool, full_allocator_available
from .pool import Pool
from .reductions import install_reducers
from . import distributed  # vmm_torch.distributed: broadcast, all_gather across ranks
from .sharing import (ImportedBuffer, SharedTensor, export_tensor, import_buffer, in_vmm_pool,
                      set_send_budget, set_send_lease, wait_for_sends)

__all__ = [
    "BufferDescriptor",
    "FabricBufferDescriptor",
    "ImportedBuffer",
    "MemPool",
    "Pool",
    "PosixFdBufferDescriptor",
    "SharedTensor",
    "VmmError",
    "backend",
    "dump_stats",
    "empty_cache",
    "enable",
    "enabled_hooks",
    "export_tensor",
    "full_allocator_available",
    "import_buffer",
    "in_vmm_pool",
    "install_reducers",
    "is_enabled",
    "library_dir",
    "load",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "parse_size",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "send_stats",
    "set_per_process_memory_fraction",
    "set_send_budget",
    "set_send_lease",
    "wait_for_sends",
]

__version__ = "0.1.0"
