"""Requests far beyond the GPU, through every entry point: a batch-size or sequence-length
finder that starts absurdly high, a shape computed from a corrupt config (2**50 or 2**62
bytes), a storage resized to a size read from a broken checkpoint header, and raw buffers
asked of the allocator for another library; each caught, after which the program goes on.

With PyTorch's allocator a request that cannot be served raises torch.OutOfMemoryError
(torch.cuda.OutOfMemoryError): the GPU's total memory plus 1 MiB, 1.5 times it, 2**44, 2**50
and 2**62 bytes through torch.empty, torch.empty on a side stream, torch.UntypedStorage(n,
device="cuda"), untyped_storage().resize_(n) of a live tensor and
torch.cuda.caching_allocator_alloc(n); for 2**50 and 2**62 bytes a RuntimeError is accepted
too (a size check may refuse such a request before the allocator is asked). memory_stats()'s
num_ooms (documented: "number of out-of-memory errors thrown") grows by exactly one per
request refused for the two sizes near the GPU's memory (the allocator tries cudaMalloc,
which fails); for 2**44 bytes and more it is only required never to decrease and to grow by at
most one per refusal: with torch 2.11 on an H100 the five 2**62-byte requests raised
OutOfMemoryError but num_ooms grew by one only (such a request is refused before the
allocator's out-of-memory path counts it). A storage whose resize_ failed keeps its size,
address and bytes; memory_allocated() is unchanged by all of it; a size whose byte count overflows int64 (2**62 float32 elements)
raises RuntimeError before the allocator is asked (the case checks only that it raises); and
afterwards 1 GiB and then a tensor of a quarter of the free memory (at most 4 GiB) can be
allocated and written.

Why vmm may differ: vmm rounds a request up to its chunk granularity and reserves virtual
address ranges sized from the request; a size near 2**62 may overflow its arithmetic, ask the
driver for an address range it refuses with another error (not out of memory), or be
refused as an invalid argument (another exception type); a refusal must leave its pools and
statistics as they were.
"""
import torch
from dropin_report import report

MIB, GIB = 1 << 20, 1 << 30


def ooms():
    return torch.cuda.memory_stats().get("num_ooms", 0)


def expect_oom(what, fn, errors, runtime_ok=False):
    """Whether fn() raised torch.OutOfMemoryError, or with `runtime_ok` any RuntimeError (adds
    the difference to errors if not)."""
    try:
        fn()
    except torch.cuda.OutOfMemoryError:
        return True
    except RuntimeError as e:
        if runtime_ok:
            return True
        errors.append(f"{what}: raised {type(e).__name__} (not OutOfMemoryError): "
                      f"{str(e)[:200]}")
        return False
    except Exception as e:  # noqa: BLE001
        errors.append(f"{what}: raised {type(e).__name__} (not OutOfMemoryError): "
                      f"{str(e)[:200]}")
        return False
    errors.append(f"{what}: succeeded")
    return False


def main():
    errors = []
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    keep = torch.arange(MIB, dtype=torch.float32, device="cuda")
    victim = torch.full((4 * MIB,), 6.0, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    sizes = [total + MIB, total * 3 // 2, 1 << 44, 1 << 50, 1 << 62]
    for n in sizes:
        absurd = n >= 1 << 50  # may be refused before the allocator's out-of-memory path
        n0 = ooms()
        tries = [
            (f"torch.empty({n} bytes)",
             lambda: torch.empty(n, dtype=torch.uint8, device="cuda")),
            (f"torch.empty({n} bytes) on a side stream",
             lambda: torch.empty(n, dtype=torch.uint8, device="cuda")),
            (f"torch.UntypedStorage({n}, device='cuda')",
             lambda: torch.UntypedStorage(n, device="cuda")),
            (f"untyped_storage().resize_({n})",
             lambda: victim.untyped_storage().resize_(n)),
            (f"caching_allocator_alloc({n})",
             lambda: torch.cuda.caching_allocator_alloc(n)),
        ]
        for i, (what, fn) in enumerate(tries):
            ptr, nbytes = victim.data_ptr(), victim.untyped_storage().nbytes()
            k0 = ooms()
            if i == 1:
                with torch.cuda.stream(side):
                    expect_oom(what, fn, errors, absurd)
            else:
                expect_oom(what, fn, errors, absurd)
            if not k0 <= ooms() <= k0 + 1:
                errors.append(f"{what}: num_ooms went from {k0} to {ooms()} for one request")
            if (victim.data_ptr(), victim.untyped_storage().nbytes()) != (ptr, nbytes):
                errors.append(f"{what}: the storage's address or size changed")
        got = ooms() - n0
        if n <= total * 3 // 2 and got != len(tries):
            errors.append(f"{n} bytes: num_ooms grew by {got} for {len(tries)} refused requests")
        if torch.cuda.memory_allocated() != base:
            errors.append(f"after the requests of {n} bytes memory_allocated() is "
                          f"{torch.cuda.memory_allocated()}, {base} before")
    try:
        torch.empty(1 << 62, dtype=torch.float32, device="cuda")
        errors.append("torch.empty(2**62 float32 elements) (2**64 bytes) succeeded")
    except Exception:  # noqa: BLE001  (RuntimeError: storage size overflow, either way)
        pass

    if float(victim.min().item()) != 6.0 or float(victim.max().item()) != 6.0:
        errors.append("the storage whose resize_ failed lost its bytes")
    if float(keep[-1].item()) != float(MIB - 1):
        errors.append("a tensor made before lost its value")
    torch.cuda.empty_cache()
    try:
        t = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        t.fill_(9)
        if int(t[-1].item()) != 9:
            errors.append("a 1 GiB tensor after the refusals does not hold its value")
        del t
        # A quarter of the free memory, at most 4 GiB: other programs of the suite may run
        # beside this one.
        n = min(torch.cuda.mem_get_info()[0] // 4, 4 * GIB)
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t[-1] = 4
        if int(t[-1].item()) != 4:
            errors.append(f"a tensor of {n} bytes does not hold its value")
        del t
    except torch.cuda.OutOfMemoryError as e:
        errors.append(f"after the refusals an allocation that fits raised OutOfMemoryError: "
                      f"{str(e)[:200]}")
    del keep, victim
    report(errors)


if __name__ == "__main__":
    main()
