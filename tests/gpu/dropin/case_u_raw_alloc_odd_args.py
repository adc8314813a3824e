"""torch.cuda.caching_allocator_alloc / caching_allocator_delete with unusual arguments, as
bridges to other libraries (CuPy's, Numba's, TensorRT's and custom kernels' workspace hooks)
call them: size 0 and 1, streams given as 0, 1 (cudaStreamLegacy), 2 (cudaStreamPerThread),
True, a torch.cuda.Stream and its int handle, a string, a float and an Event; devices as
"cuda:0", torch.device and "cpu"; deleting 0, a pointer inside a block, a pointer freed
already, an address never allocated and -1; and the statistics a raw block
moves (allocation.all.current +1 for a 1-byte block).

What each call does with PyTorch's allocator is not written here: the same probe runs in a
child with PyTorch's allocator (VMM_TORCH_ENABLE removed from its environment) and in this
process, and the outcomes must agree: returned (a pointer summarised as "null" or
"pointer") or raised (the exception's type; the message is printed, not compared: PyTorch
says "invalid device pointer", CUDAPluggableAllocator "Trying to free a pointer not
allocated here", and programs do not match either). Negative sizes are not tried: PyTorch
reads the size as ssize_t and hands it on as size_t, where its own rounding overflows.

Why vmm may differ: a raw request goes through CUDAPluggableAllocator's bookkeeping to vmm's
Malloc and PoolStream (which treats streams 0, 1 and 2 apart), and a delete through vmm's
raw_delete (null and restored blocks first).
"""

from outcome_compare import a_tensor_works, against_native, outcome

MIB = 1 << 20


def probes():
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]
    alloc = torch.cuda.caching_allocator_alloc
    delete = torch.cuda.caching_allocator_delete
    side = torch.cuda.Stream()

    def rec(name, fn):
        res.append([name, outcome(fn)])

    def kind(p):
        if not isinstance(p, int):
            return type(p).__name__
        return "null" if p == 0 else "pointer"

    def alloc_delete(n, **kw):
        p = alloc(n, **kw)
        k = kind(p)
        if p:
            torch.cuda.synchronize()
            delete(p)
        return k

    rec("alloc(0)", lambda: kind(alloc(0)))
    rec("alloc(0, stream=side)", lambda: kind(alloc(0, stream=side)))
    rec("delete(0)", lambda: delete(0))
    rec("delete(0) again", lambda: delete(0))
    rec("alloc(1) + delete", lambda: alloc_delete(1))
    for label, stream in (("0", 0), ("1 (legacy)", 1), ("2 (per-thread)", 2), ("True", True),
                          ("side Stream", side), ("side.cuda_stream", side.cuda_stream),
                          ("'x'", "x"), ("1.5", 1.5), ("an Event", torch.cuda.Event())):
        rec(f"alloc(4096, stream={label}) + delete",
            lambda stream=stream: alloc_delete(4096, stream=stream))
    rec("alloc(3 MiB, stream=side) + delete", lambda: alloc_delete(3 * MIB, stream=side))
    for label, device in (("'cuda:0'", "cuda:0"), ("torch.device('cuda')", torch.device("cuda")),
                          ("0", 0), ("'cpu'", "cpu")):
        rec(f"alloc(4096, device={label}) + delete",
            lambda device=device: alloc_delete(4096, device=device))

    def under_side_stream():
        with torch.cuda.stream(side):
            return alloc_delete(8192)
    rec("alloc(8192) under torch.cuda.stream(side)", under_side_stream)

    def interior():
        p = alloc(MIB)
        try:
            delete(p + 256)
        finally:
            torch.cuda.synchronize()
            delete(p)
    rec("delete(a pointer 256 bytes into a block)", interior)

    def twice():
        p = alloc(4096)
        delete(p)
        delete(p)
    rec("delete(p) twice (the second)", twice)
    rec("delete(0x3039, never allocated)", lambda: delete(12345))
    rec("delete(-1)", lambda: delete(-1))
    # Not probed: delete(None) and delete(1.5). With PyTorch's allocator (torch 2.11) the
    # binding returns with a Python error still set ("an integer is required"), which surfaces
    # as a SystemError in whatever C call comes next: not an outcome a program can rely on.

    def counted():
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.current"]
        alloc_before = torch.cuda.memory_allocated()
        p = alloc(1)
        during = torch.cuda.memory_stats()["allocation.all.current"]
        grew = torch.cuda.memory_allocated() > alloc_before
        delete(p)
        after = torch.cuda.memory_stats()["allocation.all.current"]
        return [during - before, grew, after - before]
    rec("allocation.all.current +, allocated grew, back (1-byte raw block)", counted)

    def zero_counted():
        before = torch.cuda.memory_stats()["allocation.all.current"]
        p = alloc(0)
        delete(p)
        return torch.cuda.memory_stats()["allocation.all.current"] - before
    rec("allocation.all.current after alloc(0) + delete", zero_counted)

    rec("a tensor afterwards", a_tensor_works)
    return res


if __name__ == "__main__":
    against_native(probes)
