"""torch.multiprocessing integration: tensors from vmm pools travel as vmm descriptors.

After :func:`install_reducers`, pickling with ``multiprocessing.reduction.ForkingPickler``
(what ``torch.multiprocessing`` queues, pipes and process arguments use) turns a tensor whose
storage lives in a vmm pool into its buffer descriptor and metadata; the receiving process
imports the descriptor, mapping the same memory. Other tensors go through PyTorch's own
reducer.

The payload is kept small and flat because it is built and rebuilt per message: the
descriptor's canonical bytes as vmm_export returned them (the receiver hands them straight
to vmm_import, which parses and validates them), then dtype, shape, strides, storage offset,
device type and the parameter / requires_grad flags as plain ints, tuples and strings. The
receiver maps the buffer on the exporting device (found by its UUID in the descriptor) and
takes the buffer's size from the import, so neither the device index nor the storage size
travels.

The receiver needs nothing installed: the rebuild functions live in this module, which
spawned processes import when unpickling. As with every vmm descriptor, the sender must keep
the tensor alive until the receiver has opened it.
"""

from multiprocessing.reduction import ForkingPickler

import torch

from . import _lib, sharing

_installed = False

# Dtypes travel as their index in this table; others as their name. A table of names keeps
# the indices the same in every process, whichever dtypes its torch has. Append only.
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32",
                "int64", "bool", "complex64", "complex128")
_DTYPES = tuple(getattr(torch, name, None) for name in _DTYPE_NAMES)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES) if dtype is not None}

# device type of the payload -> the backend that imports it.
_BACKENDS = {"cuda": "cuda", "cpu": "host"}


def _dtype_code(dtype):
    code = _DTYPE_CODES.get(dtype)
    return code if code is not None else sharing._dtype_name(dtype)


def _dtype_from_code(code):
    if type(code) is int and 0 <= code < len(_DTYPES) and _DTYPES[code] is not None:
        return _DTYPES[code]
    if isinstance(code, str):
        return sharing._dtype_from_name(code)
    raise ValueError(f"unknown dtype code {code!r}")


def _finish(tensor, parameter, requires_grad):
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def rebuild_tensor_from_bytes(descriptor, dtype, shape, stride, storage_offset, device_type,
                              parameter=False, requires_grad=False):
    """Rebuilds a tensor that reduce_tensor sent (called by unpickling): imports `descriptor`
    (canonical bytes; vmm_import rejects malformed ones with ValueError) and wraps a tensor
    over it, which keeps the mapping alive while any view of it lives."""
    dtype = _dtype_from_code(dtype)  # before the import: nothing to release on failure
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(f"device type {device_type!r} is not 'cuda' or 'cpu'")
    # Module attributes, not imported names: bench/share_latency.py times these two.
    import_id = sharing._import_id(descriptor, None, backend)
    tensor = sharing._wrap_import(import_id, shape, stride, storage_offset, dtype)
    return _finish(tensor, parameter, requires_grad)


def _torch_reduce_tensor(tensor):
    from torch.multiprocessing import reductions

    return reductions.reduce_tensor(tensor)


def reduce_tensor(tensor):
    """ForkingPickler reducer: vmm descriptors for tensors in vmm pools, else PyTorch's.

    One membership test (the storage's address, vmm_owns) and one export call; the GIL is
    kept throughout (see vmm_torch._lib), since this runs in a queue's feeder thread."""
    base = sharing._vmm_storage_address(tensor)
    if not base:
        return _torch_reduce_tensor(tensor)
    requires_grad = tensor.requires_grad
    if requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "cannot send a non-leaf tensor that requires grad between processes; "
            "send tensor.detach() instead")
    return (rebuild_tensor_from_bytes,
            (sharing._export_bytes(base), _dtype_code(tensor.dtype), tuple(tensor.shape),
             tensor.stride(), tensor.storage_offset(), "cuda" if tensor.is_cuda else "cpu",
             isinstance(tensor, torch.nn.Parameter), requires_grad))


def install_reducers():
    """Makes torch.multiprocessing carry tensors from vmm pools as vmm descriptors (CUDA
    tensors of the enabled allocator or of an explicit Pool, and CPU tensors of host pools).
    Idempotent; affects this process's pickling only."""
    global _installed
    import torch.multiprocessing  # noqa: F401  (registers PyTorch's reducers first)

    _lib.load()  # now, not in the first reducer call (a queue's feeder thread)
    for tensor_type in (torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(tensor_type, reduce_tensor)
    _installed = True


def reducers_installed():
    return _installed
