"""Processes under a per-process memory cap that exchange CUDA tensors, the receiver keeping
everything it is sent: an actor that sends each observation to a learner and waits for its
answer (one tensor per message, request and reply), the learner keeping every observation in
a replay buffer; before that, the learner, itself capped, is handed the weights.

Phase 1: the learner caps itself with set_per_process_memory_fraction at what it holds plus
256 MiB, receives four 256 MiB weight tensors (1 GiB), checks them, then allocates 192 MiB of
its own. Phase 2: the actor caps itself at what it holds plus 1 GiB, then 1,500 times makes a
16 KiB tensor, puts it on a torch.multiprocessing Queue, drops it and waits for the learner's
answer (the learner reads it and keeps it), then does the same 40 times with 3 MiB tensors.

With PyTorch's allocator a received tensor maps the sender's memory (CUDA IPC), which is not
the receiver's allocator's memory, so the learner's cap leaves room for its own 192 MiB; and a
sent block stays allocated in the actor while the learner holds it, and nothing else of its
segment is held back: 1,500 blocks of 16 KiB take 24 MiB of 2 MiB segments, 40 of 3 MiB take
120 MiB of 20 MiB segments, far below the actor's cap. So every step succeeds and every kept
tensor holds its values at the end; once the learner drops everything, the actor's
memory_allocated() comes back to where it was (ipc_collect() polled, sender_memory.py).

Why vmm may differ: a send exports the physical chunks its block lies in, and their free space
is retired while any receiver maps them (docs/DESIGN.md section 3b): when each send is
exported before the next tensor is made, every kept 16 KiB send can hold a 2 MiB small chunk
and every 3 MiB one a growth chunk, which the cap counts, so the actor may run out of memory
long before PyTorch's would; and imports might count against the learner's own cap.
"""
import gc
import sys

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20
WEIGHTS = 4
WEIGHT_NUMEL = 64 * MIB  # float32: 256 MiB each
RECEIVER_ROOM = 256 * MIB
OWN_BYTES = 192 * MIB
SENDER_ROOM = 1 << 30
SIZES = [4096] * 1500 + [3 * MIB // 4] * 40  # float32 elements: 16 KiB, then 3 MiB
TIMEOUT = 60


def cap(room):
    """Caps this process at what its allocator holds now plus `room` bytes."""
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, (torch.cuda.memory_reserved() + room) / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def learner(q, reply, drop):
    try:
        torch.cuda.init()
        torch.ones(1, device="cuda")
        cap(RECEIVER_ROOM)
        errs = []
        weights = [q.get(timeout=TIMEOUT) for _ in range(WEIGHTS)]
        for k, w in enumerate(weights):
            if w.numel() != WEIGHT_NUMEL or float(w.min()) != k + 1.0 or float(w.max()) != k + 1.0:
                errs.append(f"weight {k} arrived with {w.numel()} elements, values "
                            f"{float(w.min())}..{float(w.max())}")
        try:
            own = torch.empty(OWN_BYTES, dtype=torch.uint8, device="cuda")
            own.fill_(5)
            if int(own[-1].item()) != 5:
                errs.append("the learner's own 192 MiB tensor does not hold what was written")
            del own
        except torch.cuda.OutOfMemoryError as e:
            errs.append(f"holding 1 GiB of received weights under its cap (what it held plus "
                        f"256 MiB), the learner could not allocate 192 MiB of its own: "
                        f"{str(e).splitlines()[0][:300]}")
        del weights, w
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.set_per_process_memory_fraction(1.0)
        reply.put(("weights", errs))

        kept = []
        while True:
            msg = q.get(timeout=TIMEOUT)
            if msg is None:
                break
            i, t = msg
            good = (t.numel() == SIZES[i] and float(t[0].item()) == float(i)
                    and float(t[-1].item()) == float(i))
            kept.append((i, t))
            reply.put((i, good))
            del msg, t
        bad = [i for i, t in kept if not bool((t == float(i)).all().item())]
        reply.put(("kept", len(kept), bad[:5]))
        drop.wait(TIMEOUT)
        del kept
        gc.collect()
        torch.cuda.synchronize()
        reply.put(("dropped",))
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {str(e)[:500]}"))


def answer(reply, p, what):
    try:
        return reply.get(timeout=TIMEOUT)
    except Exception:  # noqa: BLE001
        print(f"FAIL: no answer from the learner ({what}); it is "
              f"{'alive' if p.is_alive() else f'gone, exit status {p.exitcode}'}",
              file=sys.stderr)
        p.kill()
        sys.exit(1)


def main():
    errors = []
    ctx = mp.get_context("spawn")
    q, reply, drop = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=learner, args=(q, reply, drop), daemon=True)
    p.start()
    torch.cuda.init()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    start_alloc = torch.cuda.memory_allocated()

    weights = [torch.full((WEIGHT_NUMEL,), float(k + 1), device="cuda") for k in range(WEIGHTS)]
    torch.cuda.synchronize()
    for w in weights:
        q.put(w)
    got = answer(reply, p, "the weights")
    if got[0] == "error":
        print(f"FAIL: the learner failed: {got[1]}", file=sys.stderr)
        sys.exit(1)
    errors += got[1]
    del weights, w
    err = memory_back_error(start_alloc, "learner")
    if err:
        errors.append(f"after the weights: {err}")
    torch.cuda.empty_cache()

    base = torch.cuda.memory_allocated()
    reserved0 = torch.cuda.memory_reserved()
    fraction = cap(SENDER_ROOM)
    print(f"actor: {reserved0 / MIB:.0f} MiB reserved, capped at fraction {fraction:.4f} "
          f"(+{SENDER_ROOM / MIB:.0f} MiB)")
    torch.cuda.reset_peak_memory_stats()
    sent = 0
    for i, numel in enumerate(SIZES):
        try:
            t = torch.full((numel,), float(i), device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            kept_bytes = sum(4 * n for n in SIZES[:i])
            errors.append(f"send {i}: out of memory making a {4 * numel}-byte tensor with "
                          f"{i} sends ({kept_bytes / MIB:.1f} MiB) kept by the learner, under a "
                          f"cap of what the actor held plus 1 GiB "
                          f"(max_memory_reserved grew by "
                          f"{(torch.cuda.max_memory_reserved() - reserved0) / MIB:.0f} MiB): "
                          f"{str(e).splitlines()[0][:200]}")
            break
        q.put((i, t))
        del t
        got = answer(reply, p, f"send {i}")
        if got[0] == "error":
            errors.append(f"the learner failed at send {i}: {got[1]}")
            break
        sent += 1
        if got != (i, True):
            errors.append(f"send {i}: the learner read it wrong ({got})")
            break
    q.put(None)
    print(f"actor: {sent} sends kept by the learner; max_memory_reserved() grew by "
          f"{(torch.cuda.max_memory_reserved() - reserved0) / MIB:.1f} MiB, "
          f"memory_allocated() by {(torch.cuda.memory_allocated() - base) / MIB:.1f} MiB")
    got = answer(reply, p, "the kept tensors")
    if got[0] == "error":
        errors.append(f"the learner failed: {got[1]}")
    elif got[1] != sent or got[2]:
        errors.append(f"the learner kept {got[1]} of {sent} tensors; wrong values in "
                      f"{got[2]}")
    drop.set()
    got = answer(reply, p, "the drop")
    if got[0] != "dropped":
        errors.append(f"the learner failed dropping what it kept: {got}")
    err = memory_back_error(base, "learner")
    if err:
        errors.append(err)
    torch.cuda.set_per_process_memory_fraction(1.0)
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
