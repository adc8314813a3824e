"""torch.distributed over Gloo with CUDA tensors: two spawned ranks on one GPU (a machine
without NCCL, a CPU-fallback process group, the unit tests of distributed code) run
all_reduce, broadcast and all_gather on CUDA tensors, blocking and with async_op=True.

ProcessGroupGloo's CUDA work makes an event on the caller's stream, moves to a high-priority
stream of PyTorch's pool, calls the allocator's recordStream for every tensor on that stream,
copies to pinned host memory, reduces on the CPU in its worker thread and copies back
(wait() makes the caller's stream wait for the copy). With PyTorch's allocator, in each rank:
15 blocking all_reduces of fresh tensors of 4 B to 16 MiB (each dropped at once, a tensor of
its size made right after on the default stream and another on a side stream) give the sums
of both ranks' values; 5 async all_reduces queued behind a GPU sleep, with tensors allocated
while they run, give them too; a 64 MiB broadcast from rank 0 and an all_gather of 1 MiB
tensors deliver rank 0's and each rank's values; the side stream's tensors keep theirs; once
everything is dropped memory_allocated() is back at its value after a warm-up all_reduce.

Why vmm may differ: each rank enables vmm (VMM_TORCH_ENABLE reaches spawned children);
Gloo's recordStream calls reach vmm's record_stream for streams that neither allocated the
block nor are current, from Gloo's threads; a block freed while Gloo's copy back still runs
must not be handed to another stream before that copy is done.
"""
import datetime
import gc
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dropin_report import report

WORLD = 2
SIZES = (1, 1000, 1 << 16, 1 << 20, 4 << 20)  # float32 elements: 4 B .. 16 MiB


def both(n, k):
    """The sum over a tensor of n elements after an all_reduce of rank r's value r + 1 + k."""
    return float(n * sum(r + 1 + k for r in range(WORLD)))


def collectives(rank, errors):
    w = torch.ones(8, device="cuda")
    dist.all_reduce(w)
    del w
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    side = torch.cuda.Stream()
    checks, side_tensors = [], []
    for k in range(3 * len(SIZES)):
        n = SIZES[k % len(SIZES)]
        t = torch.full((n,), float(rank + 1 + k), device="cuda")
        dist.all_reduce(t)
        checks.append((t.sum(dtype=torch.float64), both(n, k), f"all_reduce {k}"))
        del t
        torch.full((n,), -1.0, device="cuda")
        with torch.cuda.stream(side):
            side_tensors.append(torch.full((n,), 9.0, device="cuda"))
    pending = []
    for k, n in enumerate(SIZES):
        torch.cuda._sleep(2_000_000)
        t = torch.full((n,), float(rank + 1 + k), device="cuda")
        pending.append((dist.all_reduce(t, async_op=True), t, both(n, k), f"async all_reduce {k}"))
        torch.full((n,), -2.0, device="cuda")
    for work, t, want, name in pending:
        work.wait()
        checks.append((t.sum(dtype=torch.float64), want, name))
    del pending, work, t
    big = torch.full((16 << 20,), float(rank + 5), device="cuda")
    dist.broadcast(big, src=0)
    checks.append((big.sum(dtype=torch.float64), float(5 * (16 << 20)), "broadcast"))
    del big
    mine = torch.full((1 << 18,), float(10 + rank), device="cuda")
    outs = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(outs, mine)
    for r, o in enumerate(outs):
        checks.append((o.sum(dtype=torch.float64), float((10 + r) * (1 << 18)), f"all_gather {r}"))
    del mine, outs, o  # (o: the loop's last tensor)
    torch.cuda.synchronize()
    for got, want, name in checks:
        if float(got.item()) != want:
            errors.append(f"rank {rank}: {name}: sum {float(got.item())}, expected {want}")
    if any(bool((s != 9.0).any()) for s in side_tensors):
        errors.append(f"rank {rank}: a side stream's tensor changed while Gloo copied")
    del checks, side_tensors, got  # (got: the loop's last sum)
    dist.barrier()
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"rank {rank}: memory_allocated() is {torch.cuda.memory_allocated()} at "
                      f"the end, {base} after the warm-up")


def rank_main(rank, init, out):
    errors = []
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=25))
        collectives(rank, errors)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        errors.append(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    out.put((rank, errors))


def main():
    errors = []
    if not dist.is_available() or not dist.is_gloo_available():
        print("no Gloo in this torch: nothing to check")
        report(errors)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both ranks are on this machine
    folder = tempfile.mkdtemp(prefix="dropin_gloo_")
    out = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(rank_main, args=("file://" + os.path.join(folder, "store"), out),
                 nprocs=WORLD, join=True)
    except Exception as e:  # noqa: BLE001
        errors.append(f"spawn: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seen = set()
    while not out.empty():
        rank, errs = out.get()
        seen.add(rank)
        errors.extend(errs)
    if seen != set(range(WORLD)):
        errors.append(f"ranks {sorted(set(range(WORLD)) - seen)} reported nothing")
    report(errors)


if __name__ == "__main__":
    main()
