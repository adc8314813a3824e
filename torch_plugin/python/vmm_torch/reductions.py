"""torch.multiprocessing integration: tensors from vmm pools travel as vmm descriptors.

After :func:`install_reducers`, pickling with ``multiprocessing.reduction.ForkingPickler``
(what ``torch.multiprocessing`` queues, pipes and process arguments use) turns a tensor whose
storage lives in a vmm pool into its buffer descriptor and metadata; the receiving process
imports the descriptor, mapping the same memory. Other tensors go through PyTorch's own
reducer.

The payload is the one a pickled :class:`~vmm_torch.SharedTensor` carries, small and flat
(see :mod:`vmm_torch.sharing`): the descriptor's canonical bytes as vmm_export returned them
(the receiver hands them straight to vmm_import, which decodes and checks them once), then
dtype code, shape, strides, storage offset, device, and the parameter / requires_grad flags.
The rebuild function is :func:`vmm_torch.sharing.rebuild_tensor` (also
``rebuild_tensor_from_bytes`` here, its former name). The receiver maps the buffer on the
exporting device (found by its UUID in the descriptor) and takes the buffer's size from the
import, so the storage size does not travel.

The receiver needs nothing installed: unpickling imports the rebuild function's module. As
with every vmm descriptor, the sender must keep the tensor alive until the receiver has
opened it.
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Tuple

import torch

from . import _lib, sharing

#: The rebuild function of the payload (kept under its former name).
rebuild_tensor_from_bytes = sharing.rebuild_tensor

_installed = False


def _torch_reduce_tensor(tensor: torch.Tensor) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    from torch.multiprocessing import reductions

    return reductions.reduce_tensor(tensor)


def reduce_tensor(tensor: torch.Tensor) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    """ForkingPickler reducer: vmm descriptors for tensors in vmm pools, else PyTorch's.

    One membership test (the storage's address, vmm_owns) and one export call; the GIL is
    kept throughout (see vmm_torch._lib), since this runs in a queue's feeder thread."""
    base = sharing.vmm_storage_address(tensor)
    if not base:
        return _torch_reduce_tensor(tensor)
    requires_grad = tensor.requires_grad
    if requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "cannot send a non-leaf tensor that requires grad between processes; "
            "send tensor.detach() instead")
    return (sharing.rebuild_tensor,
            sharing.tensor_payload(tensor, base, isinstance(tensor, torch.nn.Parameter),
                                   requires_grad))


def install_reducers() -> None:
    """Makes torch.multiprocessing carry tensors from vmm pools as vmm descriptors (CUDA
    tensors of the enabled allocator or of an explicit Pool, and CPU tensors of host pools).
    Idempotent; affects this process's pickling only."""
    global _installed
    import torch.multiprocessing  # noqa: F401  (registers PyTorch's reducers first)

    _lib.load()  # now, not in the first reducer call (a queue's feeder thread)
    for tensor_type in (torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(tensor_type, reduce_tensor)
    _installed = True


def reducers_installed() -> bool:
    """Whether install_reducers() ran in this process."""
    return _installed
