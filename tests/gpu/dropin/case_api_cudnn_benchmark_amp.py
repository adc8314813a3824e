"""A convolutional network trained with torch.backends.cudnn.benchmark = True, float16
autocast with a GradScaler, channels_last, activation checkpointing and empty_cache() every
few steps, against the same network trained plainly.

cuDNN's benchmark mode sizes the workspaces it tries by asking the allocator for the largest
block it could hand out (CUDAAllocator::cacheInfo), then allocates them through the
allocator and catches out-of-memory to skip an algorithm. With PyTorch's allocator: nine
steps over three input shapes (each new shape is benchmarked: forward, backward data and
backward filter) give per-step losses within 3 % of the same steps run with benchmark off,
contiguous memory and no checkpointing (both from the same weights and batches), and within
that both runs' losses are finite; max_memory_allocated() >= memory_allocated() after every
step; after both runs, their models, optimizers and scalers are dropped, memory_allocated() is
back at what it was after a warm-up step.

Why vmm may differ: VmmAllocator overrides cacheInfo (cudaMemGetInfo within the memory
fraction, minus what vmm reserves), so the workspaces cuDNN tries, and the out-of-memory it
may meet while trying them, are vmm's; workspaces come and go in bursts of odd sizes.
"""
import copy
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from dropin_report import report

SHAPES = ((32, 64), (16, 96), (8, 128))  # (batch, side)


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv2d(128, 128, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def forward(model, x, ckpt):
    if not ckpt:
        return model(x)
    blocks = (model[0:3], model[3:6], model[6:10], model[10:])
    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if i < 3 else block(x)
    return x


def make_scaler():
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1000)
    return torch.cuda.amp.GradScaler(init_scale=1024.0, growth_interval=1000)


def train(model, batches, *, benchmark, channels_last, ckpt, empty_every, errors, name):
    torch.backends.cudnn.benchmark = benchmark
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scaler = make_scaler()
    losses = []
    for i, (x, y) in enumerate(batches):
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = forward(model, x, ckpt)
            loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.item()))
        if torch.cuda.max_memory_allocated() < torch.cuda.memory_allocated():
            errors.append(f"{name} step {i}: max_memory_allocated() "
                          f"{torch.cuda.max_memory_allocated()} < memory_allocated() "
                          f"{torch.cuda.memory_allocated()}")
        if empty_every and i % empty_every == empty_every - 1:
            torch.cuda.empty_cache()
        del x, y, out, loss
    del opt, scaler, model
    return losses


def main():
    torch.manual_seed(0)
    errors = []
    g = torch.Generator().manual_seed(1)
    batches = []
    for b, s in SHAPES:
        for _ in range(3):
            batches.append((torch.randn(b, 3, s, s, generator=g).cuda(),
                            torch.randint(0, 10, (b,), generator=g).cuda()))
    init = make_model()
    # Warm-up: the per-stream cuBLAS workspaces of the Linear layer and cuDNN's handle.
    train(copy.deepcopy(init).cuda(), batches[:1], benchmark=False, channels_last=False,
          ckpt=False, empty_every=0, errors=errors, name="warm-up")
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    a = train(copy.deepcopy(init).cuda(), batches, benchmark=True, channels_last=True,
              ckpt=True, empty_every=3, errors=errors, name="benchmark run")
    b = train(copy.deepcopy(init).cuda(), batches, benchmark=False, channels_last=False,
              ckpt=False, empty_every=0, errors=errors, name="plain run")
    torch.backends.cudnn.benchmark = False
    for i, (la, lb) in enumerate(zip(a, b)):
        if not (la == la and lb == lb and abs(la) < 1e4 and abs(lb) < 1e4):
            errors.append(f"step {i}: losses {la} (benchmark run) and {lb} (plain run)")
        elif abs(la - lb) > 0.03 * max(abs(lb), 1e-3):
            errors.append(f"step {i}: benchmark run's loss {la} differs from the plain run's "
                          f"{lb} by more than 3 %")
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after both runs memory_allocated is {torch.cuda.memory_allocated()}, "
                      f"{base} after the warm-up")
    torch.cuda.empty_cache()
    report(errors)


if __name__ == "__main__":
    main()
