"""empty_cache() right after tensors were freed on the host while the GPU still works on them:
a kernel queued behind a long GPU sleep that reads a freed tensor, one that writes one, a
non_blocking copy from a freed tensor into pinned host memory, and a tensor freed while a
side stream it was recorded on (record_stream) still reads it; then other streams allocate and
write over the released space. (A training loop that calls empty_cache() between phases, or a
memory monitor thread that calls it, runs into this all the time: freeing on the host never
waits for the GPU.)

With PyTorch's allocator a freed block is returned to its pool at once, and empty_cache()
first waits for the events of blocks freed under record_stream (synchronize_and_free_events),
then cudaFrees whole free segments, which waits for the work queued on the device: so every
queued kernel and copy still sees its tensor, and the results are the values written (3 * N,
5 * N, 11 everywhere in the host copy, 4 * N), whatever the other streams write afterwards.

Why vmm may differ: vmm releases free chunks at empty_cache() (and past its release threshold
on a free) with cuMemUnmap / cuMemRelease, which do not wait for the device; unless the pool
synchronises first (docs/DESIGN.md: "Memory is unmapped only after the work that used it has
completed"), a queued kernel reads unmapped or reused memory (an illegal address, which
breaks the CUDA context, or wrong values).
"""

import torch
from dropin_report import report

N = 128 << 20  # int32 elements: 512 MiB
CYCLES = 1_000_000_000  # about half a second


def overwrite_elsewhere():
    """Other streams take the released space and write over it."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        junk = [torch.full((N,), 9, dtype=torch.int32, device="cuda") for _ in range(2)]
    junk.append(torch.full((N,), 9, dtype=torch.int32, device="cuda"))
    return junk


def read_then_free():
    x = torch.full((N,), 3, dtype=torch.int32, device="cuda")
    torch.cuda._sleep(CYCLES)
    total = x.sum()  # queued behind the sleep
    del x
    torch.cuda.empty_cache()
    junk = overwrite_elsewhere()
    torch.cuda.synchronize()
    del junk
    return int(total.item()), 3 * N


def write_then_free():
    y = torch.empty((N,), dtype=torch.int32, device="cuda")
    torch.cuda._sleep(CYCLES)
    y.fill_(5)  # queued behind the sleep: writes a tensor freed just below
    total = y.sum()
    del y
    torch.cuda.empty_cache()
    junk = overwrite_elsewhere()
    torch.cuda.synchronize()
    del junk
    return int(total.item()), 5 * N


def copy_to_host_then_free():
    n = N // 8
    host = torch.zeros((n,), dtype=torch.int32, pin_memory=True)
    z = torch.empty((n,), dtype=torch.int32, device="cuda")
    torch.cuda._sleep(CYCLES)
    z.fill_(11)
    host.copy_(z, non_blocking=True)
    del z
    torch.cuda.empty_cache()
    junk = overwrite_elsewhere()
    torch.cuda.synchronize()
    del junk
    return int(host.sum().item()), 11 * n


def recorded_stream_then_free():
    a = torch.full((N,), 4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(CYCLES)
        total = a.sum()
    a.record_stream(side)
    del a
    torch.cuda.empty_cache()
    junk = [torch.full((N,), 8, dtype=torch.int32, device="cuda") for _ in range(3)]
    torch.cuda.synchronize()
    del junk
    return int(total.item()), 4 * N


def main():
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    errors = []
    for scenario in (read_then_free, write_then_free, copy_to_host_then_free,
                     recorded_stream_then_free):
        try:
            got, want = scenario()
        except RuntimeError as e:  # an illegal address breaks the context: stop here
            errors.append(f"{scenario.__name__}: {type(e).__name__}: {str(e)[:300]}")
            report(errors)
        if got != want:
            errors.append(f"{scenario.__name__}: the queued work computed {got}, expected {want} "
                          f"(its tensor's memory was released or reused before it ran)")
    report(errors)


if __name__ == "__main__":
    main()
