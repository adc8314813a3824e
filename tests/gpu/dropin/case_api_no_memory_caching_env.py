"""PYTORCH_NO_CUDA_MEMORY_CACHING=1: the switch PyTorch documents for debugging memory errors
with compute-sanitizer / cuda-memcheck (the caching allocator foils them) and that programs
sharing a GPU with other processes set so that freed memory goes back at once. Set here in
os.environ before torch is imported, as launch scripts do.
# EXCLUSIVE (reads mem_get_info(), which other processes would disturb)

With PyTorch's allocator (forceUncachedAllocator() reads the variable at the first allocation;
then every allocation is a cudaMalloc of its own and every free a cudaFree): a 2 GiB tensor
takes at least 2 GiB of the GPU's free memory (mem_get_info) and gives it back as soon as it
is deleted, without empty_cache(); so do 200 tensors of 1 KiB to 8 MiB, a tensor of a side
stream deleted while that stream still computes on it (the cudaFree waits for the device; the
result is right) and raw blocks of caching_allocator_alloc / caching_allocator_delete; every
tensor holds what was written.

Why vmm may differ: the variable is read by PyTorch's own allocator only; vmm's allocator, current
instead, keeps freed blocks cached in its chunks, so the GPU's free memory comes back only
at empty_cache().
"""

import os

os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"

import torch  # noqa: E402
from dropin_report import free_bytes, freed_memory_goes_back, report  # noqa: E402

MIB = 1 << 20
SLACK = 64 * MIB


def main():
    errors = []
    w = torch.empty(4096, dtype=torch.uint8, device="cuda")
    w.fill_(1)  # kernels loaded before the first reading of free memory
    int(w[0].item())
    f = torch.ones(4096, dtype=torch.int32, device="cuda")
    int((f * 3).sum().item())
    torch.cuda._sleep(1000)

    freed_memory_goes_back(errors, SLACK)

    side = torch.cuda.Stream()

    def deleted_while_read():
        """1 GiB on a side stream, deleted while that stream still reads it: the sum."""
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a = torch.ones(256 * MIB, dtype=torch.int32, device="cuda")  # 1 GiB
            torch.cuda._sleep(200_000_000)
            total = (a * 3).sum()
        del a  # its stream still reads it
        torch.cuda.synchronize()
        return int(total.item())

    # Once first, so that what the driver keeps for the stream and the kernels (about 70 MiB
    # in the native run of this program) is held before the free memory is read.
    deleted_while_read()
    free3 = free_bytes()
    total = deleted_while_read()
    if total != 3 * 256 * MIB:
        errors.append(f"a tensor deleted while its stream still read it: the stream computed "
                      f"{total}, expected {3 * 256 * MIB}")
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
