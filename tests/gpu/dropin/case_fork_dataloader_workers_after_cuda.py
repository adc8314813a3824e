"""DataLoader workers started with fork (Linux's default start method before Python 3.14) by
a training process that already uses CUDA: the usual `DataLoader(dataset, num_workers=2,
pin_memory=True)` over a CPU dataset, started after the model is on the GPU.

Note: the workers are forked on purpose, after CUDA is in use. PyTorch supports this as long
as the workers do not use CUDA; they do not here, but they inherit the parent's Python heap,
CUDA tensors included: the dataset holds a CUDA tensor whose metadata it reads, and cyclic
garbage holding CUDA tensors (1 MiB to 64 MiB) that the parent made and never collected is
collected in each worker (gc.collect() in worker_init_fn), which drops those tensors there.

With PyTorch's allocator a forked worker that drops an inherited CUDA tensor only updates its
copy of the allocator's bookkeeping (no CUDA call: the block has no recorded streams), so:
every batch of two epochs (the workers are forked again for the second, and exit at the end
of each) arrives in order with its values; each worker's gc collected the inherited cycles;
training a linear model on the batches gives the losses and weights of the same training
with num_workers=0; the workers print nothing on stderr (no warning, error or traceback,
while they drop the tensors or exit); once the parent collects the same garbage,
memory_allocated() is back at its baseline.

Why vmm may differ: in a forked child vmm refuses to use its parent's pools (fork_guard.h:
the bookkeeping of memory the child cannot use), so a free there takes an error path
(VmmAllocator::Free warns "free failed"); vmm also registers at-fork handlers and exit
finalizers (the send ledger, the exit wait for receivers) that run in every forked worker.
"""
import gc
import os
import tempfile

import torch
from dropin_report import report
from torch.utils.data import DataLoader, Dataset

SAMPLES = 256
BATCH = 16
MIB = 1 << 20
_state = {"freed": -1}


class Cycle:
    def __init__(self, t):
        self.t = t
        self.me = self


class CpuDataset(Dataset):
    def __init__(self, cuda_scale):
        self.cuda_scale = cuda_scale  # a CUDA tensor the workers inherit, metadata read only

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        x = torch.full((32,), float(i % 17) / 17.0) * float(self.cuda_scale.numel())
        return x, i, _state["freed"]


def worker_init(worker_id):
    _state["freed"] = gc.collect()


def make_garbage():
    for i in range(20):
        Cycle(torch.full((1 << 18,), float(i), device="cuda"))
    Cycle(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))


def train(loader, model, errors, where):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target_w = torch.linspace(-1, 1, 32 * 8, device="cuda").view(8, 32)
    losses = []
    for epoch in range(2):
        seen = []
        for xb, ib, freed in loader:
            xb = xb.cuda(non_blocking=True)
            if loader.num_workers and bool((freed < 21).any()):
                errors.append(f"{where} epoch {epoch}: a worker's gc collected "
                              f"{freed.min().item()} objects, fewer than the 21 inherited cycles")
            want = torch.stack([torch.full((32,), float(i % 17) / 17.0) for i in ib.tolist()])
            if not torch.equal(xb.cpu(), want):
                errors.append(f"{where} epoch {epoch}: the batch of samples {ib.tolist()[:4]}... "
                              f"has other values")
            seen.extend(ib.tolist())
            loss = torch.nn.functional.mse_loss(model(xb), xb @ target_w.t())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
        if seen != list(range(SAMPLES)):
            errors.append(f"{where} epoch {epoch}: samples {seen[:6]}... ({len(seen)} of "
                          f"{SAMPLES})")
    return losses


def main():
    torch.manual_seed(0)
    errors = []
    warm = torch.nn.Linear(32, 8).cuda()  # cuBLAS keeps its workspaces (forward, backward)
    train(DataLoader(CpuDataset(torch.ones(1, device="cuda")), batch_size=BATCH,
                     num_workers=0), warm, [], "warm-up")
    del warm
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = torch.nn.Linear(32, 8).cuda()
    reference = torch.nn.Linear(32, 8).cuda()
    reference.load_state_dict(model.state_dict())
    scale = torch.ones(1, device="cuda")
    dataset = CpuDataset(scale)

    gc.collect()
    gc.disable()
    make_garbage()
    torch.cuda.synchronize()

    loader = DataLoader(dataset, batch_size=BATCH, shuffle=False, num_workers=2,
                        pin_memory=True, multiprocessing_context="fork", timeout=120,
                        worker_init_fn=worker_init)
    captured = tempfile.TemporaryFile(mode="w+b")
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
        losses = train(loader, model, errors, "fork workers")
    except Exception as e:  # noqa: BLE001
        losses = []
        errors.append(f"training with forked workers raised {type(e).__name__}: {e}")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    del loader
    captured.seek(0)
    text = captured.read().decode("utf-8", "replace")
    captured.close()
    noise = [line for line in text.splitlines()
             if any(w in line for w in ("Warning", "Error", "Traceback", "Exception", "error",
                                        "failed"))
             and "DeprecationWarning" not in line]
    if noise:
        errors.append(f"the forked workers wrote to stderr: {noise[:3]}")

    ref_losses = train(DataLoader(dataset, batch_size=BATCH, shuffle=False, num_workers=0),
                       reference, errors, "no workers")
    if len(losses) != len(ref_losses):
        errors.append(f"{len(losses)} steps with workers, {len(ref_losses)} without")
    else:
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            if abs(a - b) > 1e-5 * max(1.0, abs(b)):
                errors.append(f"step {step}: loss {a} with forked workers, {b} without")
                break
    for p, q in zip(model.parameters(), reference.parameters()):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
            errors.append("after training the weights differ from the run without workers")
            break

    gc.enable()
    del model, reference, dataset, scale
    gc.collect()
    torch.cuda.synchronize()
    # Within 1 MiB: PyTorch keeps a few small tensors of its own (2 KiB with its allocator).
    if abs(torch.cuda.memory_allocated() - base) > MIB:
        errors.append(f"after the parent collected its garbage memory_allocated() is "
                      f"{torch.cuda.memory_allocated()}, {base} at the start")
    report(errors)


if __name__ == "__main__":
    main()
