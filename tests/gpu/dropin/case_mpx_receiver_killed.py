"""A receiving process is killed (SIGKILL) while it holds CUDA tensors it received, with
more sends queued for it that it never read; the sender carries on.

With PyTorch's allocator the sender is unaffected: the tensors it kept still hold their
values and take writes, it can drop everything, call torch.cuda.ipc_collect() (blocks whose
dead receiver never released them stay in the sender's limbo: a leak PyTorch accepts, not
checked here), allocate 256 MiB and free it, and share with a new process, including a
tensor the dead process had received: the new receiver reads it and its write shows in the
sender.

Why vmm may differ: the dead receiver never acknowledges the queued sends (held until their
lease or the sender's exit wait) nor reports unmapping what it imported (its chunks stay
exported in the sender); the sender must not block or fail on either, and the same storage
must go out again to the next receiver.
"""
import time

import torch
import torch.multiprocessing as mp
from dropin_report import report

MIB = 1 << 20
SIZES = [1000, 5000, 300_000, MIB, 2 * MIB]  # float32 elements
UNREAD = 8


def holder(q, reply):
    held = [q.get(timeout=60) for _ in range(len(SIZES) * 2)]
    torch.cuda.synchronize()
    reply.put([float(t.double().sum().item()) for t in held])
    time.sleep(600)  # killed here, holding them


def reader(q, reply):
    try:
        old, fresh = q.get(timeout=60)
        out = (float(old.double().sum().item()), float(fresh.double().sum().item()))
        old[0] = 5.0
        torch.cuda.synchronize()
        reply.put(("ok", out))
        del old, fresh
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {e}"))


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=holder, args=(q, reply), daemon=True)
    p.start()
    kept, expect = [], []
    for i, n in enumerate(SIZES * 2):
        t = torch.full((n,), float(i + 1), device="cuda")
        expect.append(float(i + 1) * n)
        q.put(t)
        if i % 2 == 0:
            kept.append((i, t))
        del t
    errors = []
    got = reply.get(timeout=90)
    if got != expect:
        errors.append(f"the first receiver read sums {got}, expected {expect}")
    for i in range(UNREAD):  # never read: still in the pipe when the receiver dies
        t = torch.full((4096,), -1.0, device="cuda")
        q.put(t)
        del t
    deadline = time.monotonic() + 30
    while q._buffer and time.monotonic() < deadline:  # the feeder thread sent them
        time.sleep(0.01)
    p.kill()
    p.join(30)
    if p.exitcode != -9:
        errors.append(f"the receiver's exit code is {p.exitcode}, expected -9")
    torch.cuda.synchronize()
    for i, t in kept:
        if float(t.double().sum().item()) != expect[i]:
            errors.append(f"after the receiver was killed, kept tensor {i} sums to "
                          f"{float(t.double().sum().item())}")
        t.add_(1.0)
    torch.cuda.synchronize()
    for i, t in kept:
        if float(t[0].item()) != float(i + 2):
            errors.append(f"after the receiver was killed, a write to kept tensor {i} is lost")
    survivor = kept[0][1]
    del kept, t
    try:
        torch.cuda.ipc_collect()
        big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        big.fill_(7)
        torch.cuda.synchronize()
        if int(big[-1].item()) != 7:
            errors.append("a 256 MiB buffer allocated after the kill reads wrong")
        del big
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        errors.append(f"after the receiver was killed: {type(e).__name__}: {str(e)[:300]}")
    q2, reply2 = ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=reader, args=(q2, reply2), daemon=True)
    r.start()
    fresh = torch.full((3000,), 2.0, device="cuda")
    q2.put((survivor, fresh))
    status, out = reply2.get(timeout=90)
    if status != "ok":
        errors.append(f"the next receiver failed: {out[:400]}")
    elif out != (2.0 * SIZES[0], 6000.0):
        errors.append(f"the next receiver read sums {out}, expected {(2.0 * SIZES[0], 6000.0)} "
                      f"(a tensor the killed process had received, and a fresh one)")
    torch.cuda.synchronize()
    if status == "ok" and float(survivor[0].item()) != 5.0:
        errors.append("the next receiver's write is not in the sender's tensor")
    r.join(30)
    report(errors)


if __name__ == "__main__":
    main()
