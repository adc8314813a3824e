"""max_memory_allocated() as training code reads it to choose an activation-memory strategy:
the same step of a 12-layer MLP run plainly, with torch.utils.checkpoint (non-reentrant, every
3 layers) and under torch.autograd.graph.save_on_cpu(pin_memory=True).

With PyTorch's allocator, after reset_peak_memory_stats() the peak of a step minus
memory_allocated() before it is at least the activations the plain step keeps for backward
(two 64 MiB tensors a layer: the Linear's input and the GELU's input, 1.5 GiB in all), while
checkpointing keeps four segment inputs and recomputes one segment at a time and save_on_cpu
keeps them on the host, so each of those peaks is lower than the plain one by more than a
quarter of those activations; the three give the same gradients (float32, the same kernels:
within 1e-5); after each step, with the gradients set to None, memory_allocated() is back where
it was before the step; max_memory_allocated() >= memory_allocated() throughout and
reset_peak_memory_stats() makes them equal.

Why vmm may differ: vmm's peaks are its own pool bookkeeping mapped onto PyTorch's
DeviceStats (vmm_device_torch_stats, resetPeakStats), fed here by allocations and frees in
the order autograd, checkpoint recomputation and host offload make them.
"""
import gc

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from dropin_report import report

LAYERS, WIDTH, ROWS = 12, 2048, 8192  # activations 8192 x 2048 x 4 bytes = 64 MiB


def make_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers).cuda()


def run(model, x, mode):
    if mode == "plain":
        out = model(x)
    elif mode == "checkpoint":
        out = x
        for s in range(0, 2 * LAYERS, 6):
            out = checkpoint(model[s:s + 6], out, use_reentrant=False)
    else:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            out = model(x)
    out.square().mean().backward()


def main():
    errors = []
    model = make_model()
    x = torch.randn(ROWS, WIDTH, device="cuda")
    # Warm-up: kernels, the cuBLAS/cuBLASLt workspaces of this thread and of autograd's (a
    # checkpoint recomputes the forward there), pinned host blocks.
    for mode in ("plain", "checkpoint", "save_on_cpu"):
        run(model, x, mode)
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    acts = 2 * LAYERS * ROWS * WIDTH * 4
    peaks, grads = {}, {}
    for mode in ("plain", "checkpoint", "save_on_cpu"):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        if torch.cuda.max_memory_allocated() != before:
            errors.append(f"{mode}: after reset_peak_memory_stats() max_memory_allocated() "
                          f"{torch.cuda.max_memory_allocated()} != memory_allocated() {before}")
        run(model, x, mode)
        torch.cuda.synchronize()
        if torch.cuda.max_memory_allocated() < torch.cuda.memory_allocated():
            errors.append(f"{mode}: max_memory_allocated() < memory_allocated() after the step")
        peaks[mode] = torch.cuda.max_memory_allocated() - before
        grads[mode] = [p.grad.detach().cpu() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() != before:
            errors.append(f"{mode}: after the step (gradients None) memory_allocated is "
                          f"{torch.cuda.memory_allocated()}, {before} before it")
    if peaks["plain"] < acts:
        errors.append(f"the plain step's peak {peaks['plain'] >> 20} MiB is below the "
                      f"activations it keeps, {acts >> 20} MiB")
    for mode in ("checkpoint", "save_on_cpu"):
        if peaks[mode] > peaks["plain"] - acts // 4:
            errors.append(f"{mode}: step peak {peaks[mode] >> 20} MiB is not below the plain "
                          f"step's {peaks['plain'] >> 20} MiB by a quarter of its "
                          f"{acts >> 20} MiB of activations")
        for i, (g, ref) in enumerate(zip(grads[mode], grads["plain"])):
            if not torch.allclose(g, ref, rtol=1e-5, atol=1e-7):
                errors.append(f"{mode}: gradient of parameter {i} differs from the plain step's "
                              f"by {float((g - ref).abs().max())}")
                break
    report(errors)


if __name__ == "__main__":
    main()
