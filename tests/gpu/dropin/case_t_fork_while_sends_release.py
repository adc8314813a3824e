"""os.fork() in a process that streams CUDA tensors to a consumer process which keeps letting
go of them: a pre-fork server or a training script that forks short-lived helpers (a
checkpoint compressor, a metrics uploader, `subprocess` without exec) while it feeds a
logger or evaluator process through a torch.multiprocessing queue. Each helper inherits the
parent's Python heap, CUDA tensors included, and collects the inherited garbage (cycles that
hold CUDA tensors the parent never collected), drops an inherited list of CUDA tensors, and
ends with os._exit(0).

Note: the helpers are forked on purpose after CUDA is in use. PyTorch supports that as long
as the child makes no CUDA call; dropping a CUDA tensor makes none with PyTorch's allocator
(the blocks here have no recorded streams: the freed block only goes back to the child's copy
of the allocator's bookkeeping). Forks happen only while no thread of the parent is inside
the allocator: after the consumer has answered, so the queue's feeder thread has pickled
everything.

With PyTorch's allocator: 24 rounds of (8 CUDA tensors of 4 KiB to 6 MiB put on the queue and
dropped; the consumer answers once it has read them; a helper forked and waited for) give
helpers that all exit with status 0 within 10 s, while the consumer's own thread drops the
tensors it keeps (a window of the last 16, one every 2 ms); every tensor arrives with its
values, and once the consumer has dropped everything the parent's memory_allocated() comes
back (ipc_collect() polled, sender_memory.py).

Why vmm may differ: while the consumer drops what it received, the parent's vmm is busy in
background threads (its fd server takes the consumer's release reports, its release thread
frees held blocks and settles exported chunks, holding the pool's lock); a fork at that
moment must leave the child with every lock it may take free (vmm's pthread_atfork gates and
handlers), or the helper's first free hangs; and a helper must not run or disturb its
parent's releases (its copy of the send ledger, the parent's fd server socket).
"""
import gc
import os
import sys
import threading
import time
from collections import deque

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20
ROUNDS = 24
PER_ROUND = 8
TIMEOUT = 60


class Cycle:
    def __init__(self, t):
        self.t = t
        self.me = self


def consumer(q, reply, done):
    try:
        window = deque()
        lock = threading.Lock()
        stop = threading.Event()

        def dropper():
            while not stop.is_set():
                with lock:
                    if len(window) > 16:
                        window.popleft()
                time.sleep(0.002)
        th = threading.Thread(target=dropper, daemon=True)
        th.start()
        bad = 0
        while True:
            msg = q.get(timeout=TIMEOUT)
            if msg is None:
                break
            r, items = msg
            for j, t in items:
                if float(t[0].item()) != float(j) or float(t[-1].item()) != float(j):
                    bad += 1
            with lock:
                window.extend(t for _, t in items)
            reply.put((r, bad))
            del msg, items, t
        stop.set()
        th.join()
        window.clear()
        gc.collect()
        torch.cuda.synchronize()
        reply.put(("dropped", bad))
        done.wait(TIMEOUT)
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {str(e)[:400]}"))


def helper(inherited):
    """In the forked child: no CUDA call; drop the inherited CUDA tensors and garbage."""
    try:
        collected = gc.collect()
        n = len(inherited)
        del inherited[:]
        gc.collect()
        os._exit(0 if collected > 0 and n > 0 else 3)
    except BaseException:  # noqa: BLE001
        os._exit(4)


def wait_child(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


def main():
    errors = []
    ctx = mp.get_context("spawn")
    q, reply, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=consumer, args=(q, reply, done), daemon=True)
    p.start()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    inherited = [torch.full((n,), 1.0, device="cuda") for n in (100, 300_000, 2 * MIB)]
    gc.disable()  # the cycles below stay for the helpers' collector to find
    try:
        statuses = []
        for r in range(ROUNDS):
            items = []
            for j in range(PER_ROUND):
                n = 1024 * (1 + (r * PER_ROUND + j) * 37 % 1536)  # 4 KiB to 6 MiB
                items.append((r * PER_ROUND + j,
                              torch.full((n,), float(r * PER_ROUND + j), device="cuda")))
            torch.cuda.synchronize()
            q.put((r, items))
            del items
            for k in range(3):
                Cycle(torch.full((1000 * (k + 1),), float(k), device="cuda"))
            try:
                answer = reply.get(timeout=TIMEOUT)
            except Exception:  # noqa: BLE001
                print(f"FAIL: round {r}: no answer from the consumer (alive: {p.is_alive()})",
                      file=sys.stderr)
                sys.exit(1)
            if answer[0] == "error":
                errors.append(f"the consumer failed in round {r}: {answer[1]}")
                break
            if answer != (r, 0):
                errors.append(f"round {r}: the consumer read {answer[1]} tensors wrong")
                break
            pid = os.fork()
            if pid == 0:
                helper(inherited)
            statuses.append(wait_child(pid, 10))
        gc.enable()
        gc.collect()
        wrong = [(i, s) for i, s in enumerate(statuses) if s != 0]
        if wrong:
            errors.append(f"forked helpers ended with {wrong[:6]} ({len(wrong)} of "
                          f"{len(statuses)}; 'hung': still running after 10 s)")
    finally:
        gc.enable()
    q.put(None)
    try:
        answer = reply.get(timeout=TIMEOUT)
    except Exception:  # noqa: BLE001
        answer = ("error", "no answer")
    if answer[0] != "dropped":
        errors.append(f"the consumer did not drop what it kept: {answer}")
    elif answer[1]:
        errors.append(f"the consumer read {answer[1]} tensors wrong")
    del inherited
    err = memory_back_error(base, "consumer")
    if err:
        errors.append(err)
    done.set()
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
