"""torch.cuda.memory.caching_allocator_enable(False) (and the caching_allocator_disabled()
context manager where torch has it): a program turns caching off around a phase whose memory
must go back to the GPU as soon as it is freed (a model loader that wants a flat, predictable
footprint; PyTorch's own inductor tests turn it off to catch illegal memory accesses), then on
again.
# EXCLUSIVE (reads mem_get_info(), which other processes would disturb)

With PyTorch's allocator (NativeCachingAllocator::allocate and raw_deleter: with caching off
each allocation is a cudaMalloc of its own and its deleter a cudaFree): after
caching_allocator_enable(False), torch._C._cuda_cudaCachingAllocator_is_enabled() says False;
a 2 GiB tensor takes at least 2 GiB of the GPU's free memory (mem_get_info) and gives it
back as soon as it is deleted, without empty_cache(); so do 200 tensors of 1 KiB to 8 MiB; every
tensor holds what was written; a tensor made while caching was on and freed while it is off,
and one made while it is off and freed once it is on again, go without error; after
caching_allocator_enable(True) the flag says True. The same holds inside
caching_allocator_disabled(), which restores the flag at its end.

Why vmm may differ: vmm's allocator (a CUDAPluggableAllocator subclass, vmm_cuda_allocator.cpp)
does not override enable() / isEnabled(): the flag may be ignored (or refused), and a freed
block stays cached in vmm's chunks, so the GPU's free memory comes back only at
empty_cache().
"""

import torch
from dropin_report import free_bytes, freed_memory_goes_back, report

MIB = 1 << 20
GIB = 1 << 30
SLACK = 64 * MIB


def main():
    errors = []
    enable = getattr(torch.cuda.memory, "caching_allocator_enable", None)
    if enable is None:
        report([f"torch {torch.__version__} has no torch.cuda.memory.caching_allocator_enable"])
    flag = getattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled", None)
    w = torch.empty(4096, dtype=torch.uint8, device="cuda")
    w.fill_(1)  # kernels loaded before the first reading of free memory
    int(w[0].item())
    made_on = torch.full((MIB,), 3, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    try:
        enable(False)
    except Exception as e:  # noqa: BLE001
        report([f"caching_allocator_enable(False) raised {type(e).__name__}: {e}"])
    if flag is not None and flag() is not False:
        errors.append(f"after caching_allocator_enable(False) the flag says {flag()!r}")

    freed_memory_goes_back(errors, SLACK)

    made_off = torch.full((MIB,), 5, dtype=torch.uint8, device="cuda")
    del made_on  # made with caching on, freed with it off
    try:
        enable(True)
    except Exception as e:  # noqa: BLE001
        report(errors + [f"caching_allocator_enable(True) raised {type(e).__name__}: {e}"])
    if flag is not None and flag() is not True:
        errors.append(f"after caching_allocator_enable(True) the flag says {flag()!r}")
    if int(made_off[-1].item()) != 5:
        errors.append("a tensor made with caching off changed once caching is on again")
    del made_off  # made with caching off, freed with it on
    y = torch.ones(1000, device="cuda")
    if float(y.sum().item()) != 1000.0:
        errors.append("with caching on again a new tensor computes wrongly")
    del y

    disabled = getattr(torch.cuda.memory, "caching_allocator_disabled", None)
    if disabled is not None:
        free4 = free_bytes()
        with disabled():
            if flag is not None and flag() is not False:
                errors.append(f"inside caching_allocator_disabled() the flag says {flag()!r}")
            u = torch.empty(GIB, dtype=torch.uint8, device="cuda")
            u.fill_(2)
            ok = int(u[-1].item()) == 2
            del u
            free5 = free_bytes()
        if not ok:
            errors.append("a tensor made inside caching_allocator_disabled() lost its values")
        if free5 < free4 - SLACK:
            errors.append(f"a 1 GiB tensor deleted inside caching_allocator_disabled() did not "
                          f"go back to the GPU: free memory {free5}, was {free4}")
        if flag is not None and flag() is not True:
            errors.append(f"after caching_allocator_disabled() the flag says {flag()!r}")
    report(errors)


if __name__ == "__main__":
    main()
