"""The storage-level CUDA IPC API called directly: the sender calls
`tensor.untyped_storage()._share_cuda_()` and sends the resulting spec (plain bytes and
ints) through a queue; the receiver calls
`torch.multiprocessing.reductions.rebuild_cuda_tensor(**spec)` (the pattern of PyTorch's own
test_multiprocessing.test_rebuild_cuda_tensor, and of frameworks that ship IPC handles
rather than tensors).

With PyTorch's allocator _share_cuda_() returns the CUDA IPC handle of the block's segment,
the storage's byte size and offset in it, a ref-counter file slot and an IPC event; the
receiver rebuilds both chunks of a two-element tensor (two specs of one storage, at
offsets 0 and 1), reads 1.0 in each, writes 2.0 and 3.0, and the sender sees the writes.

Why vmm may differ: the spec comes from the allocator's shareIpcHandle (a cudaIpcMemHandle of
a cudaMalloc segment) and is opened by getIpcDevPtr in the receiver; vmm replaces
torch.multiprocessing's reduce_tensor, but not these, and its memory is not cudaMalloc
memory.
"""

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from dropin_report import report


def child(q, reply, done):
    try:
        specs = q.get(timeout=60)
        tensors = [rebuild_cuda_tensor(**spec) for spec in specs]
        seen = [t.cpu().tolist() for t in tensors]
        for k, t in enumerate(tensors):
            t.fill_(float(k + 2))
        torch.cuda.synchronize()
        reply.put(("ok", seen))
        done.wait(60)
        del tensors
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {e}"))


def main():
    ctx = mp.get_context("spawn")
    q, reply, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, reply, done), daemon=True)
    p.start()
    whole = torch.ones(2, device="cuda")
    tensors = whole.chunk(2, dim=0)
    errors = []
    specs = []
    try:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            (storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
             ref_counter_handle, ref_counter_offset, event_handle,
             event_sync_required) = storage._share_cuda_()
            specs.append({
                "tensor_cls": type(tensor), "tensor_size": tensor.shape,
                "tensor_stride": tensor.stride(), "tensor_offset": tensor.storage_offset(),
                "dtype": tensor.dtype, "requires_grad": tensor.requires_grad,
                "storage_cls": type(storage), "storage_device": storage_device,
                "storage_handle": storage_handle, "storage_size_bytes": storage_size_bytes,
                "storage_offset_bytes": storage_offset_bytes,
                "ref_counter_handle": ref_counter_handle,
                "ref_counter_offset": ref_counter_offset, "event_handle": event_handle,
                "event_sync_required": event_sync_required,
            })
    except Exception as e:  # noqa: BLE001
        errors.append(f"untyped_storage()._share_cuda_() raised {type(e).__name__}: "
                      f"{str(e)[:300]}")
        specs = []
    q.put(specs)
    status, seen = reply.get(timeout=90)
    if not errors:
        if status != "ok":
            errors.append(f"rebuild_cuda_tensor(**spec) in the receiver failed: {seen[:400]}")
        elif seen != [[1.0], [1.0]]:
            errors.append(f"the receiver read {seen}, expected [[1.0], [1.0]]")
        else:
            torch.cuda.synchronize()
            if whole.tolist() != [2.0, 3.0]:
                errors.append(f"after the receiver's writes the sender's tensor is "
                              f"{whole.tolist()}, expected [2.0, 3.0]")
    done.set()
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
