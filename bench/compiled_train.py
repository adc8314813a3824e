#!/usr/bin/env python3
"""A training loop under torch.compile(mode="reduce-overhead") (CUDA graph trees), per
allocator: step time and peak memory side by side (GPU).

    python3 bench/compiled_train.py --steps 200 --out r.jsonl [--snapshot vmm.pickle]

Runs PyTorch's own allocator ("native") and vmm ("vmm": vmm_torch.enable(), vmm's whole CUDA
allocator) each in a fresh process, one after the other, with the same seed, model and
batches: an MLP block stack on fixed shapes (what reduce-overhead records once and replays).
Reports per allocator the median step time after warm-up (compile and recording excluded),
torch.cuda.max_memory_allocated / max_memory_reserved (answered by vmm under vmm), the first
and last loss, and the ratio vmm / native. With --snapshot, the vmm run records the memory
history (torch.cuda.memory._record_memory_history) for its last steps and writes
torch.cuda.memory._dump_snapshot to that path: the input of PyTorch's memory viewer and of
``python -m vmm_torch.stats timeline``.
"""
import argparse
import json
import multiprocessing
import statistics
import sys
import time


def run(allocator, steps, snapshot, out):
    import torch

    if allocator == "vmm":
        import vmm_torch

        vmm_torch.enable()
    torch.manual_seed(0)
    d = 1024
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                                      torch.nn.Linear(4 * d, d))
                                  for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, mode="reduce-overhead")
    batches = [torch.randn(256, d, device="cuda") for _ in range(4)]

    def step(i):
        x = batches[i % len(batches)]
        loss = compiled(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses, times = [], []
    warmup = 10
    for i in range(steps):
        if snapshot and i == steps - 5:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    out.put({"allocator": allocator, "step_ms": statistics.median(times[warmup:]) * 1e3,
             "peak_allocated": torch.cuda.max_memory_allocated(),
             "peak_reserved": torch.cuda.max_memory_reserved(),
             "first_loss": losses[0], "last_loss": losses[-1], "steps": steps})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="")
    p.add_argument("--snapshot", default="")
    a = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    rows = {}
    for allocator in ("native", "vmm"):
        q = ctx.Queue()
        proc = ctx.Process(target=run, args=(allocator, a.steps,
                                             a.snapshot if allocator == "vmm" else "", q))
        proc.start()
        rows[allocator] = q.get(timeout=600)
        proc.join(60)
        print(json.dumps(rows[allocator]), flush=True)
    ratio = {"bench": "compiled_train_ratio",
             "step_time": rows["vmm"]["step_ms"] / rows["native"]["step_ms"],
             "peak_reserved": rows["vmm"]["peak_reserved"] / rows["native"]["peak_reserved"],
             "peak_allocated": rows["vmm"]["peak_allocated"] / rows["native"]["peak_allocated"]}
    print(json.dumps(ratio), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            for row in list(rows.values()) + [ratio]:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
