"""Workers started with the "forkserver" start method (Python 3.14's default on Linux, and what
launchers choose to start workers fast: torch is preloaded once in the fork server with
set_forkserver_preload(["torch"]), and every worker is forked from that server, which never
used CUDA) exchanging CUDA tensors with the parent both ways through torch.multiprocessing
queues.

Note: the workers use CUDA although they are forked: the fork server is a fresh interpreter
that only imported torch, which PyTorch supports (CUDA is initialised in neither the server
nor, before the fork, the worker).

With PyTorch's allocator each worker is a process of its own whose allocator starts empty at
its first CUDA use: two workers at once each receive the parent's 8 MiB tensor (CUDA IPC), read
its values, write 16 values into their own slice of it, compute a result tensor of their own
and send it back (CUDA IPC from the worker), keep it until the parent says it is done (a
producer must outlive its consumers' use), and exit with status 0; the parent reads each
result, sees both workers' writes in its tensor, and a second round of two new workers does
the same.

Why vmm may differ: with VMM_TORCH_ENABLE `import torch` enables vmm in the fork server (its
allocator installed, its reducers and exit hooks registered, its library state made) before
the fork, so every worker starts from a copy of that state: a thread, a socket (the fd
server receivers fetch handles and send acknowledgements through), a lock or a fork guard
made in the server and missing or wrong in the worker breaks the worker's own sends to the
parent, its acknowledgements of what the parent sent, or its exit.
"""
import queue as queue_mod
import sys

import torch
import torch.multiprocessing as mp
from dropin_report import report

MIB = 1 << 20
N = 2 * MIB  # float32: 8 MiB


def worker(k, q_in, q_out, done):
    try:
        torch.cuda.init()
        tag, t = q_in.get(timeout=30)
        n = t.numel()
        want = torch.arange(n, device="cuda", dtype=torch.float32) % 1000
        # The other worker's slice (its first 32 values) may be written already.
        mine = slice(k * 16, (k + 1) * 16)
        bad = int((t[32:] != want[32:]).sum().item()) + int((t[mine] != want[mine]).sum().item())
        t[k * 16:(k + 1) * 16] = 5000.0 + k
        result = t[:1024] * 2 + k
        torch.cuda.synchronize()
        q_out.put((tag, k, bad, result))
        del t
        if not done.wait(40):
            print(f"worker {k}: the parent never said it was done", file=sys.stderr)
        del result
    except Exception as e:  # noqa: BLE001
        q_out.put(("error", k, f"{type(e).__name__}: {e}", None))


def one_round(ctx, rnd, errors):
    t = torch.arange(N, device="cuda", dtype=torch.float32) % 1000
    q_in, q_out = ctx.Queue(), ctx.Queue()
    done = ctx.Event()
    procs = [ctx.Process(target=worker, args=(k, q_in, q_out, done)) for k in range(2)]
    for p in procs:
        p.start()
    for k in range(2):
        q_in.put((f"round {rnd}", t))
    got = {}
    for _ in range(2):
        try:
            tag, k, bad, result = q_out.get(timeout=45)
        except queue_mod.Empty:
            errors.append(f"round {rnd}: a worker sent nothing within 45 s")
            break
        except Exception as e:  # noqa: BLE001
            errors.append(f"round {rnd}: receiving a worker's result raised {type(e).__name__}: "
                          f"{str(e)[:300]}")
            continue
        if tag == "error":
            errors.append(f"round {rnd}: worker {k}: {bad}")
            continue
        if bad:
            errors.append(f"round {rnd}: worker {k} read {bad} wrong values in the parent's "
                          f"tensor")
        got[k] = result.clone()
        del result
    torch.cuda.synchronize()
    done.set()
    for k, p in enumerate(procs):
        p.join(30)
        if p.is_alive():
            errors.append(f"round {rnd}: worker {k} did not exit")
            p.kill()
        elif p.exitcode != 0:
            errors.append(f"round {rnd}: worker {k} exited with status {p.exitcode}")
    base = torch.arange(1024, device="cuda", dtype=torch.float32) % 1000
    for k, r in got.items():
        want = base.clone()
        want[k * 16:(k + 1) * 16] = 5000.0 + k
        # The other worker may or may not have written its slice before this one read.
        other = 1 - k
        lo, hi = other * 16, (other + 1) * 16
        if not (torch.equal(r[lo:hi], base[lo:hi] * 2 + k) or
                torch.equal(r[lo:hi], torch.full((16,), (5000.0 + other) * 2 + k,
                                                 device="cuda"))):
            errors.append(f"round {rnd}: worker {k}'s result has wrong values where the other "
                          f"worker writes")
        keep = torch.ones(1024, dtype=torch.bool, device="cuda")
        keep[lo:hi] = False
        if not torch.equal(r[keep], (want * 2 + k)[keep]):
            errors.append(f"round {rnd}: worker {k}'s result tensor has wrong values")
    for k in range(2):
        if not torch.equal(t[k * 16:(k + 1) * 16], torch.full((16,), 5000.0 + k,
                                                             device="cuda")):
            errors.append(f"round {rnd}: worker {k}'s write is not in the parent's tensor")
    if not torch.equal(t[32:], (torch.arange(N, device="cuda", dtype=torch.float32) % 1000)[32:]):
        errors.append(f"round {rnd}: the parent's tensor changed outside the workers' slices")


def main():
    errors = []
    torch.empty(1, device="cuda")  # the parent uses CUDA before the workers start
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    for rnd in range(2):
        one_round(ctx, rnd, errors)
    report(errors)


if __name__ == "__main__":
    main()
