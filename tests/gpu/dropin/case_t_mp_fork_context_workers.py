"""Worker processes started with the "fork" start method before the parent first uses CUDA,
which then exchange CUDA tensors with it both ways through torch.multiprocessing queues: a
script that creates its pool of GPU workers at the top (Linux's default start method before
Python 3.14), then builds its model on the GPU and hands work to them.

Note: the workers are forked on purpose: PyTorch supports CUDA in a forked child as long as
the parent had not initialised CUDA when it forked, which is the case here (the parent checks
torch.cuda.is_initialized() before forking).

With PyTorch's allocator each worker initialises CUDA at its first CUDA use (unpickling the
first tensor it is sent) and has an allocator of its own; each of 5 rounds the parent sends
every worker a fresh 4 MiB tensor filled with r + 1; the worker reads its sum, writes -r into
its own 16 elements of it (the parent sees the write once the worker answered), makes a
tensor of its own filled with 100 * k + r and sends it back (`put`, then `del`); the parent
reads it and keeps the last two rounds' answers. At the end the workers report, wait until the
parent has dropped their tensors and exit with status 0, and the parent's memory comes back to
where it was before the rounds once everything is dropped (ipc_collect() polled,
sender_memory.py).

Why vmm may differ: with VMM_TORCH_ENABLE, `import torch` enabled vmm in the parent before the
fork, so each worker starts as a fork child of a process that loaded libvmm and installed its
allocator and reducers (a fork generation of its own: its device pool, fd server, send ledger,
acknowledgement thread and import closer must be its own, not its parent's copies) and is both
a receiver (imports of the parent's memory) and a sender (its own memory, acknowledged and
released by the parent).
"""
import gc
import sys

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20
WORKERS = 2
ROUNDS = 5
N = MIB  # float32 elements: 4 MiB
TIMEOUT = 60


def worker(k, inbox, outbox):
    try:
        while True:
            msg = inbox.get(timeout=TIMEOUT)
            if msg is None:
                break
            r, t = msg
            total = float(t.double().sum().item())
            t[k * 16:(k + 1) * 16] = -float(r)
            mine = torch.full((N // 4,), float(100 * k + r), device="cuda")
            torch.cuda.synchronize()
            outbox.put((k, r, total, mine))
            del t, mine, msg
        gc.collect()
        torch.cuda.synchronize()
        outbox.put((k, "done", torch.cuda.memory_allocated()))
        # A producer outlives its consumer's use of what it sent: wait until the parent
        # dropped this worker's tensors.
        inbox.get(timeout=TIMEOUT)
    except Exception as e:  # noqa: BLE001
        outbox.put((k, "error", f"{type(e).__name__}: {str(e)[:400]}"))


def main():
    errors = []
    if torch.cuda.is_initialized():
        print("FAIL: CUDA is initialised right after `import torch`; the fork start method "
              "cannot be used", file=sys.stderr)
        sys.exit(1)
    ctx = mp.get_context("fork")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(WORKERS)]
    procs = [ctx.Process(target=worker, args=(k, inboxes[k], outbox), daemon=True)
             for k in range(WORKERS)]
    for p in procs:
        p.start()

    torch.ones(1, device="cuda")  # the parent's CUDA, after the fork
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    kept = []
    for r in range(ROUNDS):
        sent = [torch.full((N,), float(r + 1), device="cuda") for _ in range(WORKERS)]
        torch.cuda.synchronize()
        for k in range(WORKERS):
            inboxes[k].put((r, sent[k]))
        answers = {}
        for _ in range(WORKERS):
            try:
                msg = outbox.get(timeout=TIMEOUT)
            except Exception:  # noqa: BLE001
                alive = [p.is_alive() for p in procs]
                print(f"FAIL: round {r}: no answer from the workers (alive: {alive}, exit "
                      f"statuses {[p.exitcode for p in procs]})", file=sys.stderr)
                sys.exit(1)
            if msg[1] == "error":
                errors.append(f"worker {msg[0]} failed in round {r}: {msg[2]}")
                continue
            answers[msg[0]] = msg
        if errors:
            break
        torch.cuda.synchronize()
        for k in range(WORKERS):
            _, rr, total, mine = answers[k]
            if rr != r or total != float(r + 1) * N:
                errors.append(f"round {r}: worker {k} read sum {total}, expected "
                              f"{float(r + 1) * N}")
            if not bool((sent[k][k * 16:(k + 1) * 16] == -float(r)).all().item()) or \
                    float(sent[k][(k + 1) * 16].item()) != float(r + 1):
                errors.append(f"round {r}: worker {k}'s write into the parent's tensor is not "
                              f"(only) where it belongs")
            if not mine.is_cuda or mine.numel() != N // 4 or \
                    not bool((mine == float(100 * k + r)).all().item()):
                errors.append(f"round {r}: worker {k}'s own tensor arrived wrong")
        kept.append([answers[k][3] for k in range(WORKERS)])
        if len(kept) > 2:
            kept.pop(0)
        del sent, answers, msg
        if errors:
            break
    for q in inboxes:
        q.put(None)
    for _ in range(WORKERS):
        try:
            msg = outbox.get(timeout=TIMEOUT)
        except Exception:  # noqa: BLE001
            errors.append("a worker did not report its end")
            break
        if msg[1] != "done":
            errors.append(f"worker {msg[0]} at its end: {msg[1:]}")
    # The workers keep running (their last answers are still held here) until those go.
    del kept
    gc.collect()
    torch.cuda.synchronize()
    for q in inboxes:
        q.put("bye")
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            errors.append(f"a worker exited with status {p.exitcode}")
    err = memory_back_error(base, "workers")
    if err:
        errors.append(err)
    report(errors)


if __name__ == "__main__":
    main()
