"""torch.multiprocessing.spawn with CUDA tensors and a CUDA module as arguments (PyTorch's
Hogwild pattern: model.share_memory(), then workers update the shared parameters in place).

With PyTorch's allocator: share_memory() on a CUDA module changes nothing (CUDA tensors need
no move: same data_ptr, is_shared() True); spawn pickles the arguments once per child; each
child receives the module's parameters as nn.Parameter (requires_grad kept) over the parent's
memory and writes its own row of the weight, its own slice of a flat buffer and one element
of a view with a storage offset; after the children exit, the parent reads every write and
its untouched rows are unchanged.

Why vmm may differ: Process arguments are pickled in the caller (two sends of the same
storages, one per child), held until each child acknowledges; each child maps the memory,
writes and exits, releasing its imports at exit.
"""
import time

import torch
import torch.multiprocessing as mp
from dropin_report import report

NPROCS = 2


def worker(rank, model, buf, view):
    if not isinstance(model.weight, torch.nn.Parameter) or not model.weight.requires_grad:
        raise RuntimeError(f"weight arrived as {type(model.weight).__name__}, requires_grad "
                           f"{model.weight.requires_grad}")
    with torch.no_grad():
        model.weight[rank].add_(float(rank + 1))
        buf[rank * 4096:(rank + 1) * 4096].fill_(float(rank + 1))
        view[rank] = 100.0 + rank
    torch.cuda.synchronize()


def main():
    torch.manual_seed(0)
    errors = []
    model = torch.nn.Linear(32, 4).cuda()
    ptr = model.weight.data_ptr()
    model.share_memory()
    if model.weight.data_ptr() != ptr or not model.weight.is_shared():
        errors.append(f"share_memory() on a CUDA module moved it or is_shared() is "
                      f"{model.weight.is_shared()}")
    w0 = model.weight.detach().clone()
    buf = torch.zeros(NPROCS * 4096, device="cuda")
    base = torch.zeros(1000, device="cuda")
    view = base[500:510]
    torch.cuda.synchronize()
    ctx = mp.spawn(worker, args=(model, buf, view), nprocs=NPROCS, join=False)
    deadline = time.monotonic() + 45
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                errors.append("the spawned children did not finish in 45 s")
                for p in ctx.processes:
                    p.kill()
                break
    except Exception as e:  # noqa: BLE001 (ProcessRaisedException / ProcessExitedException)
        errors.append(f"a spawned child failed: {str(e)[-800:]}")
    torch.cuda.synchronize()
    want = w0.clone()
    for r in range(NPROCS):
        want[r] += r + 1
    if not torch.equal(model.weight.detach(), want):
        errors.append(f"the weight rows the children updated (or the others) differ: max diff "
                      f"{float((model.weight.detach() - want).abs().max().item())}")
    for r in range(NPROCS):
        got = buf[r * 4096:(r + 1) * 4096]
        if not bool((got == r + 1).all().item()):
            errors.append(f"child {r}'s slice of the buffer is not {r + 1}")
    want_base = torch.zeros(1000, device="cuda")
    want_base[500:500 + NPROCS] = torch.arange(NPROCS, device="cuda") + 100.0
    if not torch.equal(base, want_base):
        errors.append(f"the children's writes through a view at offset 500: "
                      f"{base[498:504].tolist()}")
    report(errors)


if __name__ == "__main__":
    main()
