"""Parameters freed and made again by resizing their storage across streams, as FSDP does at
every step (FlatParamHandle's _free_storage / _alloc_storage; fully_shard's unsharded
parameters): the unsharded flat parameter is made on the all-gather stream (a
high-priority stream, as FSDP's) with `untyped_storage().resize_(nbytes)` and the gather's
copy, read by the compute stream through per-parameter views made once, recorded with
record_stream(compute stream) and freed with `untyped_storage().resize_(0)` as soon as the
compute is queued, while the compute stream, held back by a GPU sleep, has not read it yet;
the all-gather stream then allocates and writes a scratch buffer of the same size at once.

With PyTorch's allocator the freed block carries an event of the compute stream, so the
all-gather stream's scratch buffer never gets it before the delayed reads: each of 12 steps
reads its own values through the views (which follow every new allocation and have 0 bytes
between steps), for a 16 MiB flat parameter and a 96 KiB one (small blocks); at the end
memory_allocated() is back at the baseline.

Why vmm may differ: the block is freed by a storage resize (resize_bytes_cuda swaps the
DataPtr) rather than by a tensor's death, after record_stream reached vmm through
CUDAPluggableAllocator's recordStream; vmm decides when the all-gather stream may reuse it.
"""
import torch
from dropin_report import report

STEPS = 12


def run(n, errors):
    ag = torch.cuda.Stream(priority=-1)  # FSDP's unshard stream has a high priority
    compute = torch.cuda.current_stream()
    shard = torch.arange(n, dtype=torch.float32, device="cuda").remainder_(1000.0)
    flat = torch.empty(n, device="cuda")
    nbytes = flat.untyped_storage().nbytes()
    q = n // 4
    views = [flat[i * q:(i + 1) * q].view(16, -1) for i in range(4)]
    flat.untyped_storage().resize_(0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    sums = []
    for step in range(STEPS):
        ag.wait_stream(compute)
        with torch.cuda.stream(ag):
            flat.untyped_storage().resize_(nbytes)
            flat.copy_(shard)
            flat.add_(float(step))
        if views[2].data_ptr() != flat.data_ptr() + 2 * q * 4:
            errors.append(f"n={n} step {step}: a view made once does not follow the new block")
        compute.wait_stream(ag)
        torch.cuda._sleep(20_000_000)  # the compute stream lags behind
        sums.append([v.sum(dtype=torch.float64) for v in views])
        flat.record_stream(compute)
        flat.untyped_storage().resize_(0)
        if views[0].untyped_storage().nbytes() != 0:
            errors.append(f"n={n} step {step}: after resize_(0) a view still has bytes")
        with torch.cuda.stream(ag):
            scratch = torch.full((n,), -1.0, device="cuda")
            scratch.mul_(3.0)
            del scratch
    torch.cuda.synchronize()
    got = [[float(s.item()) for s in row] for row in sums]
    del sums
    ref = torch.arange(n, dtype=torch.float64).remainder_(1000.0)
    for step, row in enumerate(got):
        want = [float(ref[i * q:(i + 1) * q].sum()) + step * q for i in range(4)]
        if row != want:
            errors.append(f"n={n} step {step}: the compute stream read {row}, expected {want} "
                          f"(the freed block was written before the delayed reads)")
            break
    if torch.cuda.memory_allocated() != base:
        errors.append(f"n={n}: memory_allocated() is {torch.cuda.memory_allocated()} at the "
                      f"end, {base} before the steps")


def main():
    torch.empty(1, device="cuda")
    errors = []
    for n in (4 << 20, 24 << 10):
        run(n, errors)
    report(errors)


if __name__ == "__main__":
    main()
