"""torch.distributed over NCCL in one process (world size 1): collectives on tensors of the
CUDA allocator, and NCCL's memory pool (a MemPool over the backend's ncclMemAlloc allocator,
registered with the communicator), as a trainer's single-GPU run of multi-GPU code does.

With PyTorch's allocator: init_process_group("nccl") over a HashStore with device_id starts
the communicator; all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor give
the expected values; where the backend offers mem_allocator (PyTorch 2.6 and later), tensors
made inside use_mem_pool(MemPool(mem_allocator)) come from NCCL's memory, register_mem_pool
registers the pool's segments (from the pool's snapshot), an all_reduce over them is right,
and deregister_mem_pool, the pool's end and destroy_process_group go without error (the
NCCL of torch 2.11's wheel has no ncclMemAlloc: there the collectives alone are checked).

Why vmm may differ: NCCL reads pointers vmm mapped (cuMem ranges of vmm's pools); the MemPool
over NCCL's allocator is a pool over another allocator (torch_plugin/csrc/foreign_segments.h)
whose segments must show in snapshot(pool.id), which register_mem_pool reads.
"""
import torch
import torch.distributed as dist
from dropin_report import report

N = 1 << 20


def main():
    errors = []
    if not dist.is_available() or not dist.is_nccl_available():
        print("no NCCL in this torch: nothing to check")
        report(errors)
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    t = torch.arange(N, device="cuda", dtype=torch.float32)
    dist.all_reduce(t)
    if not torch.equal(t.cpu(), torch.arange(N, dtype=torch.float32)):
        errors.append("all_reduce over one rank changed the tensor")
    dist.broadcast(t, 0)
    gathered = torch.empty(N, device="cuda")
    dist.all_gather_into_tensor(gathered, t)
    if not torch.equal(gathered, t):
        errors.append("all_gather_into_tensor over one rank is not the input")
    scattered = torch.empty(N, device="cuda")
    dist.reduce_scatter_tensor(scattered, t)
    if not torch.equal(scattered, t):
        errors.append("reduce_scatter_tensor over one rank is not the input")

    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    try:
        allocator = backend.mem_allocator
    except (AttributeError, RuntimeError) as e:  # no such API, or an NCCL without ncclMemAlloc
        print(f"no NCCL memory pool here ({str(e)[:80]}): collectives only")
        allocator = None
    if allocator is not None:
        pool = torch.cuda.MemPool(allocator)
        with torch.cuda.use_mem_pool(pool):
            x = torch.full((4 * N,), 2.0, device="cuda")
            y = torch.full((1000,), 3.0, device="cuda")
        segments = pool.snapshot()
        for name, tensor in (("x", x), ("y", y)):
            p = tensor.data_ptr()
            if not any(s["address"] <= p < s["address"] + s["total_size"] for s in segments):
                errors.append(f"{name}, made in NCCL's MemPool, is in none of its segments")
        registered = hasattr(backend, "register_mem_pool")
        if registered:
            backend.register_mem_pool(pool)
        dist.all_reduce(x)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        if float(x.sum().item()) != 2.0 * 4 * N or float(y.sum().item()) != 3000.0:
            errors.append("an all_reduce over NCCL's memory pool gave wrong values")
        if registered and hasattr(backend, "deregister_mem_pool"):
            backend.deregister_mem_pool(pool)
        del x, y, segments
        del pool
    torch.cuda.synchronize()
    dist.destroy_process_group()
    report(errors)


if __name__ == "__main__":
    main()
