"""torch.multiprocessing.spawn with nprocs=2, where the two workers hand CUDA tensors to each
other and both hand tensors to the parent, over multiprocessing SimpleQueues (no
torch.distributed): the pattern of hand-written pipeline or actor/learner setups in one
script (a rank sends its activations or rollouts to the other rank, both report results to
the launcher), with each worker logging torch.cuda.memory_stats() as training scripts do.

With PyTorch's allocator each worker's CUDA tensors, put on a SimpleQueue (pickled in the
putting thread) and then deleted, stay valid for both of their receivers (CUDA IPC: the
block waits in the sender until every receiver released it); the peer worker and the parent
read the values written (a float32 tensor, a float16 one, a 1 KiB one, a strided view, a
0-element tensor), and a receiver's own memory_allocated() does not grow by receiving
(opened IPC memory is not the receiver's allocation: cudaIpcOpenMemHandle, outside the
caching allocator's statistics; it may fall meanwhile, where the rank's own sends come back:
with vmm once their receivers acknowledge them, which a first run saw, 13 MiB); in each worker memory_stats() is consistent with
memory_allocated() and memory_reserved() (allocated_bytes.all.current / reserved_bytes.
all.current), allocation.all.current grows by exactly the number of non-empty tensors made
(0-element tensors take no block), and reset_peak_memory_stats() makes the peak the current
value; once the peer and the parent have dropped everything a worker sent, the worker's
memory_allocated() comes back to its value before the sends (torch.cuda.ipc_collect()
polled, up to 15 s: sender_memory.py); both workers return normally, so spawn's join
succeeds and their exit codes are 0.

Why vmm may differ: vmm sends a block through its own reducer, holds it until each receiver
acknowledges, and maps received chunks into the receiver (imports, which must not count as
the receiver's allocations); here a process is sender and receiver at once, towards a
sibling that is not its parent, and its statistics are read meanwhile.
"""
import time

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20


def payload(rank):
    """The tensors rank `rank` sends: (tensors, what the receiver checks)."""
    v = float(rank + 1)
    f32 = torch.full((3 * MIB,), v, device="cuda")
    f16 = torch.full((1000, 513), v * 10, dtype=torch.float16, device="cuda")
    small = torch.full((256,), v * 100, device="cuda")
    base = torch.arange(4096, dtype=torch.float32, device="cuda") + 1000 * rank
    strided = base.view(64, 64)[::3, 1::2]
    empty = torch.empty(0, device="cuda")
    return [f32, f16, small, strided, empty]


def expected(rank):
    v = float(rank + 1)
    base = torch.arange(4096, dtype=torch.float32) + 1000 * rank
    return [torch.full((3 * MIB,), v), torch.full((1000, 513), v * 10, dtype=torch.float16),
            torch.full((256,), v * 100), base.view(64, 64)[::3, 1::2], torch.empty(0)]


def check_received(who, got, rank, errs):
    want = expected(rank)
    if len(got) != len(want):
        errs.append(f"{who} got {len(got)} tensors from rank {rank}, expected {len(want)}")
        return
    for i, (g, w) in enumerate(zip(got, want)):
        if not g.is_cuda or g.dtype != w.dtype or g.shape != w.shape or \
                not torch.equal(g.cpu(), w):
            errs.append(f"{who}: tensor {i} from rank {rank} differs (shape {tuple(g.shape)}, "
                        f"dtype {g.dtype})")


def get_within(queue, seconds, what):
    """SimpleQueue.get with a deadline (it has none): a peer that failed before its put must
    not hold the program past the runner's limit."""
    deadline = time.monotonic() + seconds
    while queue.empty():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing came from {what} in {seconds} s")
        time.sleep(0.02)
    return queue.get()


def worker(rank, inboxes, to_parent, reports, go_exit):
    errs = []
    try:
        torch.cuda.init()
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        count0 = torch.cuda.memory_stats()["allocation.all.current"]
        ts = payload(rank)
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        made = sum(1 for t in ts if t.numel())  # the strided view stands for its base
        if st["allocation.all.current"] - count0 != made:
            errs.append(f"rank {rank}: allocation.all.current grew by "
                        f"{st['allocation.all.current'] - count0} for {made} tensors")
        if st["allocated_bytes.all.current"] != torch.cuda.memory_allocated() or \
                st["reserved_bytes.all.current"] != torch.cuda.memory_reserved():
            errs.append(f"rank {rank}: memory_stats() disagrees with memory_allocated() / "
                        f"memory_reserved()")
        torch.cuda.reset_peak_memory_stats()
        if torch.cuda.max_memory_allocated() != torch.cuda.memory_allocated():
            errs.append(f"rank {rank}: after reset_peak_memory_stats() the peak is not the "
                        f"current value")
        inboxes[1 - rank].put((rank, ts))
        to_parent.put((rank, ts))
        del ts

        # Receiving adds nothing to the receiver's allocations. Its own sends, just dropped,
        # may come back meanwhile: vmm frees a sent block once its receivers acknowledge it
        # (here they may while this rank waits), PyTorch's allocator at a later ipc_collect().
        before = torch.cuda.memory_allocated()
        sender, got = get_within(inboxes[rank], 25, f"rank {1 - rank}")
        if torch.cuda.memory_allocated() > before:
            errs.append(f"rank {rank}: receiving rank {sender}'s tensors raised its own "
                        f"memory_allocated() by {torch.cuda.memory_allocated() - before}")
        check_received(f"rank {rank}", got, sender, errs)
        del got
        torch.cuda.synchronize()
        reports.put(("released", rank, errs))
        errs = []
        if not go_exit.wait(30):
            errs.append(f"rank {rank}: the parent never said everything was dropped")
        else:
            error = memory_back_error(base, "peer and the parent")
            if error:
                errs.append(f"rank {rank}: {error}")
        st = torch.cuda.memory_stats()
        if st["allocated_bytes.all.current"] != torch.cuda.memory_allocated():
            errs.append(f"rank {rank}: at the end memory_stats() disagrees with "
                        f"memory_allocated()")
    except Exception as e:  # noqa: BLE001
        errs.append(f"rank {rank}: {type(e).__name__}: {str(e)[:300]}")
    reports.put(("done", rank, errs))


def main():
    errors = []
    ctx = mp.get_context("spawn")
    inboxes = [ctx.SimpleQueue(), ctx.SimpleQueue()]
    to_parent = ctx.SimpleQueue()
    reports = ctx.Queue()
    go_exit = ctx.Event()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    pc = mp.spawn(worker, args=(inboxes, to_parent, reports, go_exit), nprocs=2, join=False)

    try:
        main_steps(pc, to_parent, reports, go_exit, errors)
    finally:
        for p in pc.processes:  # a worker still blocked must not outlive the program
            if p.is_alive():
                p.terminate()
    report(errors)


def main_steps(pc, to_parent, reports, go_exit, errors):
    held = []
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        try:
            rank, ts = get_within(to_parent, 25, "the workers")
        except TimeoutError as e:
            errors.append(str(e))
            return
        held.append((rank, ts))
    if torch.cuda.memory_allocated() != before:
        errors.append(f"the parent's memory_allocated() changed by "
                      f"{torch.cuda.memory_allocated() - before} by receiving")
    for rank, ts in held:
        check_received("the parent", ts, rank, errors)
    released, finished = set(), set()
    deadline = time.monotonic() + 20
    while len(released) < 2 and time.monotonic() < deadline:
        kind, rank, errs = reports.get(timeout=max(1.0, deadline - time.monotonic()))
        errors += errs
        released.add(rank)
        if kind == "done":  # it failed before it got to release
            finished.add(rank)
            errors.append(f"rank {rank} ended before it released what it received")
    del held, ts
    torch.cuda.synchronize()
    go_exit.set()
    while len(finished) < 2:
        kind, rank, errs = reports.get(timeout=20)
        errors += errs
        if kind == "done":
            finished.add(rank)
    try:
        deadline = time.monotonic() + 20
        while not pc.join(5) and time.monotonic() < deadline:
            pass
    except Exception as e:  # noqa: BLE001
        errors.append(f"spawn's join raised {type(e).__name__}: {str(e)[:300]}")
    codes = [p.exitcode for p in pc.processes]
    if codes != [0, 0]:
        errors.append(f"the workers' exit codes are {codes}")


if __name__ == "__main__":
    main()
