"""torch.multiprocessing integration: tensors from vmm pools travel as vmm descriptors.

After :func:`install_reducers`, pickling with ``multiprocessing.reduction.ForkingPickler``
(what ``torch.multiprocessing`` queues, pipes and process arguments use) turns a tensor whose
storage lives in a vmm pool into a :class:`~vmm_torch.SharedTensor`; the receiving process
opens it, mapping the same memory. Other tensors go through PyTorch's own reducer.

The receiver needs nothing installed: the rebuild function lives in this module, which
spawned processes import when unpickling. As with every vmm descriptor, the sender must keep
the tensor alive until the receiver has opened it.
"""

from multiprocessing.reduction import ForkingPickler

import torch

from .sharing import export_tensor, in_vmm_pool

_installed = False


def rebuild_tensor(shared, parameter=False, requires_grad=False):
    """Opens a SharedTensor on the receiving side (called by unpickling)."""
    tensor = shared.open()
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _torch_reduce_tensor(tensor):
    from torch.multiprocessing import reductions

    return reductions.reduce_tensor(tensor)


def reduce_tensor(tensor):
    """ForkingPickler reducer: vmm descriptors for tensors in vmm pools, else PyTorch's."""
    if not in_vmm_pool(tensor):
        return _torch_reduce_tensor(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "cannot send a non-leaf tensor that requires grad between processes; "
            "send tensor.detach() instead")
    parameter = isinstance(tensor, torch.nn.Parameter)
    return (rebuild_tensor, (export_tensor(tensor.detach()), parameter, tensor.requires_grad))


def install_reducers():
    """Makes torch.multiprocessing carry tensors from vmm pools as vmm descriptors (CUDA
    tensors of the enabled allocator or of an explicit Pool, and CPU tensors of host pools).
    Idempotent; affects this process's pickling only."""
    global _installed
    import torch.multiprocessing  # noqa: F401  (registers PyTorch's reducers first)

    for tensor_type in (torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(tensor_type, reduce_tensor)
    _installed = True


def reducers_installed():
    return _installed
