"""Processes forked before the parent uses CUDA use CUDA themselves (the default start method
on Linux; a parent that only imports torch, then forks workers that each pick a GPU task).

Note: this case uses the "fork" start method on purpose; it is what torch.multiprocessing
uses by default on Linux, and PyTorch supports CUDA in forked children as long as the
parent has not initialised CUDA.

With PyTorch's allocator: torch.cuda.is_initialized() is False in the parent after
`import torch`; three forked children each allocate, compute and report a result; the parent
then uses CUDA itself.

Why vmm may differ: VMM_TORCH_ENABLE makes `import torch` enable vmm (load libvmm.so and the
extension, install the allocator); if that initialises the CUDA driver or starts threads
that hold locks, forked children cannot use CUDA (or hang).
"""
import multiprocessing

import torch
from dropin_report import report


def child(conn, k):
    try:
        x = torch.full((1 << 20,), float(k), device="cuda")
        y = (x * 2).sum()
        big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        big.fill_(1)
        conn.send(("ok", float(y.item()), int(big.sum().item())))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}", 0))


def main():
    errors = []
    if torch.cuda.is_initialized():
        errors.append("CUDA is initialised right after `import torch`")
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    for k in range(3):
        a, b = ctx.Pipe()
        pr = ctx.Process(target=child, args=(b, k + 1), daemon=True)
        pr.start()
        procs.append(pr)
        conns.append(a)
    for k, (pr, c) in enumerate(zip(procs, conns)):
        if not c.poll(60):
            errors.append(f"child {k} did not answer (hung?)")
            pr.kill()
            continue
        status, val, bsum = c.recv()
        if status != "ok":
            errors.append(f"child {k}: {val}")
        elif val != 2.0 * (k + 1) * (1 << 20) or bsum != (256 << 20):
            errors.append(f"child {k}: results {val}, {bsum}")
        pr.join(30)
        if pr.exitcode != 0:
            errors.append(f"child {k} exited with {pr.exitcode}")
    z = torch.ones(1000, device="cuda")
    if float(z.sum().item()) != 1000.0:
        errors.append("the parent's CUDA after the children is wrong")
    report(errors)


if __name__ == "__main__":
    main()
