#!/usr/bin/env python3
"""A small transformer trained with variable sequence lengths, under one allocator (GPU).

    python3 bench/train_loop.py --allocator native|expandable|vmm --steps 300 --out r.json

Each allocator runs in its own process (the allocator is chosen before CUDA starts). The
same seed gives the same batches and initial weights, so the losses of different allocators
can be compared step by step. By default every kernel is deterministic (PyTorch's
deterministic algorithms, the math attention backend, cuDNN without autotuning, a fixed cuBLAS
workspace), so that runs can be bit-identical; ops that have no deterministic implementation
are recorded as "nondeterministic_ops". Writes the per-step losses (also as float.hex() in
"losses_hex", for exact comparison), step times (median), peak reserved and peak allocated
bytes; with --dump, vmm's dump_stats of the live workload and its snapshot.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch


def make_model(vocab, d, layers, heads):
    layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
    return torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(vocab, d),
        "encoder": torch.nn.TransformerEncoder(layer, layers),
        "head": torch.nn.Linear(d, vocab),
    })


def deterministic_kernels():
    """Makes the run's kernels deterministic; ops without a deterministic implementation warn
    (called before CUDA starts: cuBLAS reads its workspace setting then)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # The flash, memory-efficient and cuDNN attention kernels may pick different algorithms
    # or split work differently from run to run; the math backend is plain matmuls.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def distinct_messages(caught, limit=200):
    """The distinct messages of warnings `caught`, in order, each cut to `limit` characters."""
    return list(dict.fromkeys(str(w.message)[:limit] for w in caught))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--allocator", choices=["native", "expandable", "vmm"], required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--dump", default="")
    p.add_argument("--label", default="", help="name of this run in the results")
    p.add_argument("--vmm-option", action="append", default=[],
                   help="KEY=VALUE passed to vmm_torch.enable (repeatable)")
    p.add_argument("--nondeterministic", action="store_true",
                   help="allow nondeterministic kernels (losses then differ run to run)")
    a = p.parse_args()
    if not a.nondeterministic:
        deterministic_kernels()

    if a.allocator == "expandable":
        assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), \
            "run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    if a.allocator == "vmm":
        import vmm_torch
        options = {}
        for item in a.vmm_option:
            key, value = item.split("=", 1)
            options[key] = float(value) if key == "growth_fraction" else value
        vmm_torch.enable(**options)

    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    model = make_model(a.vocab, a.d, a.layers, 8).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(a.seed + 1)
    lengths = [64, 128, 192, 256, 384, 512, 768, 1024]

    losses, times = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(a.steps):
            seq = lengths[int(torch.randint(len(lengths), (1,), generator=gen))]
            tokens = torch.randint(a.vocab, (a.batch, seq + 1), generator=gen).to(device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x = model["embed"](tokens[:, :-1])
            h = model["encoder"](x)
            logits = model["head"](h)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab),
                                                     tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # synchronises
            times.append(time.perf_counter() - t0)
    alert = "does not have a deterministic implementation"  # PyTorch's warn_only message
    nondeterministic_ops = distinct_messages(w for w in caught if alert in str(w.message))
    for message in distinct_messages(w for w in caught if alert not in str(w.message)):
        print(f"warning: {message}", file=sys.stderr)

    if a.allocator == "vmm":
        import vmm_torch
        stats = vmm_torch.memory_stats()
        peak_reserved = stats["reserved_bytes.all.peak"]
        peak_allocated = stats["allocated_bytes.all.peak"]
        if a.dump:
            vmm_torch.dump_stats(a.dump)
    else:
        peak_reserved = torch.cuda.max_memory_reserved()
        peak_allocated = torch.cuda.max_memory_allocated()
    warm = times[10:]
    result = {
        "allocator": a.label or a.allocator, "steps": a.steps, "losses": losses,
        "losses_hex": [l.hex() for l in losses],
        "deterministic": not a.nondeterministic, "nondeterministic_ops": nondeterministic_ops,
        "median_step_ms": statistics.median(warm) * 1e3,
        "mean_step_ms": statistics.fmean(warm) * 1e3,
        "peak_reserved": peak_reserved, "peak_allocated": peak_allocated,
        "final_loss": losses[-1], "finite": all(math.isfinite(l) for l in losses),
    }
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "losses_hex")}))


if __name__ == "__main__":
    main()
