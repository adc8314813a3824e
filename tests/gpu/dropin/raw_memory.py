"""Tensors over raw device memory (a pointer from torch.cuda.caching_allocator_alloc), as
CuPy or Numba hand it to PyTorch: through __cuda_array_interface__, no copy. For the drop-in
programs that allocate raw memory."""
import torch

_TYPESTR = {torch.float32: "<f4", torch.uint8: "|u1"}


def wrap(ptr, n, dtype=torch.float32):
    """A 1-D tensor of `n` elements of `dtype` (float32 or uint8) over the memory at `ptr`."""
    dev = torch.device("cuda", torch.cuda.current_device())
    try:
        import numpy  # noqa: F401  (torch.as_tensor reads the interface through numpy's types)
    except ImportError:
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        st = torch._C._construct_storage_from_data_pointer(ptr, dev, nbytes)
        return torch.empty(0, dtype=dtype, device=dev).set_(st, 0, (n,), (1,))
    cai = {"shape": (n,), "typestr": _TYPESTR[dtype], "data": (ptr, False), "strides": None,
           "version": 2}
    return torch.as_tensor(type("Raw", (), {"__cuda_array_interface__": cai})(), device=dev)
