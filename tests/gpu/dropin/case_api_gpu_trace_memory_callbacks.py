"""The GPU trace's memory callbacks: what CUDA Sanitizer (TORCH_CUDA_SANITIZER=1,
torch.cuda._sanitizer) registers through torch.cuda._gpu_trace to learn when device memory
starts and stops belonging to a tensor, so that it forgets the accesses of a freed tensor
before the memory is handed to the next one.

With PyTorch's allocator (its own test_cuda_trace: test_memory_allocation_callback,
test_memory_deallocation_callback), once torch._C._activate_gpu_trace() ran, every
allocation of the caching allocator calls the allocation callbacks with its pointer and every
free the deallocation callbacks (NativeCachingAllocator::malloc and ::free, through
c10::impl::GPUTrace): torch.empty of 10 x 4 floats reports exactly its data_ptr(), once, and
its del exactly that pointer, once; so do tensors of 1 byte to 256 MiB, a raw block of
torch.cuda.caching_allocator_alloc / caching_allocator_delete, and a tensor freed while a
side stream it was recorded on (record_stream) still runs (the callback comes at the free);
an empty tensor reports nothing; over a sort, a cumsum and a matmul every pointer reported
allocated is reported freed once it is no longer live (counted per pointer: a cached block
comes back), and the outputs still held are the ones allocated once more than freed.

Why vmm may differ: the callbacks are made by PyTorch's own allocator, not by
CUDAPluggableAllocator; VmmAllocator's Malloc and Free make none, so CUDA Sanitizer would see
no allocation or free (and report races between a freed tensor's accesses and the next
tensor given its memory).
"""
import collections
import gc

import torch
from dropin_report import gpu_trace_api, report

MIB = 1 << 20


def main():
    errors = []
    api = gpu_trace_api()
    if api is None:
        report(errors)
        return
    gpu_trace, activate = api
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    allocs, frees = [], []
    activate()
    gpu_trace.register_callback_for_memory_allocation(allocs.append)
    gpu_trace.register_callback_for_memory_deallocation(frees.append)

    def reset():
        del allocs[:]
        del frees[:]

    reset()
    t = torch.empty(10, 4, device="cuda")
    ptr = t.data_ptr()
    if allocs != [ptr]:
        errors.append(f"torch.empty(10, 4): allocation callbacks got {[hex(p) for p in allocs]}, "
                      f"expected [{ptr:#x}] once")
    reset()
    del t
    if frees != [ptr]:
        errors.append(f"del of that tensor: deallocation callbacks got "
                      f"{[hex(p) for p in frees]}, expected [{ptr:#x}] once")

    for n in (1, 4096, MIB + 1, 20 * MIB, 256 * MIB):
        reset()
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        ptr = t.data_ptr()
        got_alloc = list(allocs)
        del t
        got_free = list(frees)
        if got_alloc != [ptr] or got_free != [ptr]:
            errors.append(f"{n} bytes: allocation callbacks {[hex(p) for p in got_alloc]}, "
                          f"deallocation callbacks {[hex(p) for p in got_free]}, expected "
                          f"[{ptr:#x}] each")

    reset()
    e = torch.empty(0, device="cuda")
    e2 = torch.zeros(0, 8, device="cuda")
    del e, e2
    if allocs or frees:
        errors.append(f"empty tensors reported allocations {len(allocs)}, frees {len(frees)}")

    reset()
    raw = torch.cuda.caching_allocator_alloc(3 * MIB)
    got_alloc = list(allocs)
    torch.cuda.caching_allocator_delete(raw)
    got_free = list(frees)
    if got_alloc != [raw] or got_free != [raw]:
        errors.append(f"caching_allocator_alloc / _delete of {raw:#x}: allocation callbacks "
                      f"{[hex(p) for p in got_alloc]}, deallocation callbacks "
                      f"{[hex(p) for p in got_free]}")

    side = torch.cuda.Stream()
    x = torch.ones(4 * MIB, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        y = x * 2
    x.record_stream(side)
    ptr = x.data_ptr()
    reset()
    del x
    if frees != [ptr]:
        errors.append(f"a tensor freed while a recorded stream still ran: deallocation "
                      f"callbacks got {[hex(p) for p in frees]}, expected [{ptr:#x}] at the free")
    torch.cuda.synchronize()
    if float(y[0].item()) != 2.0:
        errors.append("the side stream's result is wrong")
    del y

    gc.collect()
    reset()
    a = torch.randn(1 << 20, device="cuda")
    m = torch.randn(512, 512, device="cuda")
    values, indices = torch.sort(a)
    c = torch.cumsum(a, 0)
    p = m @ m
    torch.cuda.synchronize()
    live = {a.data_ptr(), m.data_ptr(), values.data_ptr(), indices.data_ptr(), c.data_ptr(),
            p.data_ptr()}
    balance = collections.Counter(allocs)
    balance.subtract(collections.Counter(frees))
    held = {q for q, k in balance.items() if k == 1}
    # A pointer is allocated at most once more than it is freed; one allocated here is never
    # freed more often than allocated. (Workspaces a library keeps, cuBLAS's, may stay held.)
    odd = {q: k for q, k in balance.items() if k > 1 or (k < 0 and q in allocs)}
    if odd:
        errors.append(f"over sort, cumsum and matmul some pointers were reported allocated and "
                      f"freed out of balance: {dict(list(odd.items())[:5])}")
    if not live <= held:
        errors.append(f"{len(live - held)} of the 6 live tensors' pointers were not reported "
                      f"allocated (or were reported freed)")
    del a, m, values, indices, c, p
    torch.cuda.synchronize()
    if not allocs:
        errors.append("sort, cumsum and matmul reported no allocation at all")
    if torch.cuda.memory_allocated() < base:
        errors.append("memory_allocated() fell below its baseline")
    report(errors)


if __name__ == "__main__":
    main()
