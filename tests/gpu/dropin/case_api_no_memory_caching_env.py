"""PYTORCH_NO_CUDA_MEMORY_CACHING=1: the switch PyTorch documents for debugging memory errors
with compute-sanitizer / cuda-memcheck (the caching allocator foils them) and that programs
sharing a GPU with other processes set so that freed memory goes back at once. Set here in
os.environ before torch is imported, as launch scripts do.
# EXCLUSIVE (reads mem_get_info(), which other processes would disturb)

With PyTorch's allocator (forceUncachedAllocator() reads the variable at the first allocation;
then every allocation is a cudaMalloc of its own and every free a cudaFree): a 2 GiB tensor
takes at least 2 GiB of the device's free memory (mem_get_info) and gives it back as soon as it
is deleted, without empty_cache(); so do 200 tensors of 1 KiB to 8 MiB, a tensor of a side
stream deleted while that stream still computes on it (the cudaFree waits for the device; the
result is right) and raw blocks of caching_allocator_alloc / caching_allocator_delete; every
tensor holds what was written.

Why vmm may differ: the variable is read by PyTorch's own allocator only; vmm's allocator, current
instead, keeps freed blocks cached in its chunks, so the device's free memory comes back only
at empty_cache().
"""

import os

os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"

import torch  # noqa: E402
from dropin_report import report  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
SLACK = 64 * MIB


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def main():
    errors = []
    w = torch.empty(4096, dtype=torch.uint8, device="cuda")
    w.fill_(1)  # kernels loaded before the first reading of free memory
    int(w[0].item())
    f = torch.ones(4096, dtype=torch.int32, device="cuda")
    int((f * 3).sum().item())
    torch.cuda._sleep(1000)

    free0 = free_bytes()
    t = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    t.fill_(7)
    free1 = free_bytes()
    if free0 - free1 < 2 * GIB:
        errors.append(f"a 2 GiB tensor took {free0 - free1} bytes of the device's free memory")
    if int(t[0].item()) != 7 or int(t[-1].item()) != 7:
        errors.append("the 2 GiB tensor does not hold what was written")
    del t
    free2 = free_bytes()
    if free2 < free0 - SLACK:
        errors.append(f"a 2 GiB tensor deleted did not go back to the GPU: free memory {free2} "
                      f"after, {free0} before it (no empty_cache)")

    sizes = [1024 * (1 + (i * 37) % 8192) for i in range(200)]
    ts = [torch.full((n,), i % 251, dtype=torch.uint8, device="cuda")
          for i, n in enumerate(sizes)]
    bad = [i for i, x in enumerate(ts) if int(x[-1].item()) != i % 251]
    if bad:
        errors.append(f"{len(bad)} of 200 small tensors lost their values")
    del ts
    free3 = free_bytes()
    if free3 < free2 - SLACK:
        errors.append(f"200 tensors of 1 KiB to 8 MiB ({sum(sizes)} bytes) deleted left the "
                      f"device's free memory at {free3}, was {free2}")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = torch.ones(256 * MIB, dtype=torch.int32, device="cuda")  # 1 GiB
        torch.cuda._sleep(200_000_000)
        total = (a * 3).sum()
    del a  # its stream still reads it
    torch.cuda.synchronize()
    if int(total.item()) != 3 * 256 * MIB:
        errors.append(f"a tensor deleted while its stream still read it: the stream computed "
                      f"{int(total.item())}, expected {3 * 256 * MIB}")
    del total
    free4 = free_bytes()
    if free4 < free3 - SLACK:
        errors.append(f"a 1 GiB tensor deleted while its stream used it did not go back to "
                      f"the GPU: free memory {free4}, was {free3}")

    ptrs = [torch.cuda.caching_allocator_alloc(n) for n in (512, 3 * MIB, 300 * MIB)]
    if any(p == 0 for p in ptrs):
        errors.append(f"caching_allocator_alloc returned a null pointer: {ptrs}")
    for p in ptrs:
        torch.cuda.caching_allocator_delete(p)
    free5 = free_bytes()
    if free5 < free4 - SLACK:
        errors.append(f"raw blocks of 512 B, 3 MiB and 300 MiB deleted did not go back to the "
                      f"GPU: free memory {free5}, was {free4}")
    report(errors)


if __name__ == "__main__":
    main()
