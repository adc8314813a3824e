"""What a serving engine's memory profiling reads before it sizes its KV cache (vLLM's and
SGLang's): torch.cuda.mem_get_info() before and after loading weights and running a forward
pass, against memory_reserved() and max_memory_allocated().
# EXCLUSIVE (reads mem_get_info(), which other processes would disturb)

With PyTorch's allocator every byte of memory_reserved() is device memory the process holds
(cudaMalloc'd segments), so the engines' "non-torch memory", the growth of the GPU's used
memory (total - free) minus the growth of memory_reserved(), stays small: after a warm-up of
the same kernels, loading 1.5 GiB of weights and running a pass that keeps 1 GiB of
activations each move used memory by what memory_reserved() moved, within 256 MiB + 2 %
(what CUDA itself may take meanwhile); memory_reserved() <= total - free at every point;
max_memory_allocated() during the pass is at least the weights plus the activations kept;
after the activations go and empty_cache() runs, memory_reserved() is no more than after the
weights were loaded; after the weights go too, memory_reserved() is no more than at the start
and used memory is back at the start within the same slack.

Why vmm may differ: vmm reserves large virtual ranges, maps physical chunks into them, keeps
chunks it could give back (parked, retired, kept for sharing) and reports its own
reserved_bytes; if what it counts is not what it maps, a program that sizes a cache from
mem_get_info() and memory_reserved() takes too much or too little.
"""
import gc

import torch
import torch.nn.functional as F
from dropin_report import report

MIB = 1 << 20
SLACK = 256 * MIB
LAYERS, D, ROWS = 24, 4096, 8192  # weights 24 x 64 MiB; activations 8192 x 4096 x 4 = 128 MiB


def used():
    free, total = torch.cuda.mem_get_info()
    return total - free


def check_point(where, errors):
    torch.cuda.synchronize()
    u = used()
    if torch.cuda.memory_reserved() > u:
        errors.append(f"{where}: memory_reserved() {torch.cuda.memory_reserved()} > device memory "
                      f"in use {u}")
    return u, torch.cuda.memory_reserved()


def compare(where, u0, r0, u1, r1, errors):
    du, dr = u1 - u0, r1 - r0
    if abs(du - dr) > SLACK + 0.02 * abs(dr):
        errors.append(f"{where}: device memory in use moved by {du / MIB:.1f} MiB but "
                      f"memory_reserved() by {dr / MIB:.1f} MiB")


def main():
    torch.manual_seed(0)
    errors = []
    # Warm-up: the kernels, the cuBLAS handle and workspace, at full size.
    w = torch.randn(D, D, device="cuda")
    x = torch.randn(ROWS, D, device="cuda")
    y = F.gelu(x @ w)
    torch.cuda.synchronize()
    del w, x, y
    gc.collect()
    torch.cuda.empty_cache()
    u0, r0 = check_point("at the start", errors)

    weights = [torch.randn(D, D, device="cuda") / 64 for _ in range(LAYERS)]
    u1, r1 = check_point("after loading the weights", errors)
    compare("loading 1.5 GiB of weights", u0, r0, u1, r1, errors)

    torch.cuda.reset_peak_memory_stats()
    a_before = torch.cuda.memory_allocated()
    x = torch.randn(ROWS, D, device="cuda")
    acts = [x]
    for i in range(7):
        x = F.gelu(x @ weights[i])
        acts.append(x)
    kept = sum(t.numel() * t.element_size() for t in acts)
    peak = torch.cuda.max_memory_allocated()
    u2, r2 = check_point("after the forward pass", errors)
    compare("a forward pass keeping 1 GiB", u1, r1, u2, r2, errors)
    if peak < a_before + kept:
        errors.append(f"max_memory_allocated() {peak} during the pass < weights and kept "
                      f"activations {a_before + kept}")

    del acts, x
    gc.collect()
    torch.cuda.empty_cache()
    u3, r3 = check_point("after the activations went and empty_cache()", errors)
    if r3 > r1:
        errors.append(f"after the activations went and empty_cache() memory_reserved() is {r3}, "
                      f"{r1} with the weights alone before the pass")
    compare("dropping the activations and empty_cache()", u2, r2, u3, r3, errors)

    del weights
    gc.collect()
    torch.cuda.empty_cache()
    u4, r4 = check_point("at the end", errors)
    if r4 > r0:
        errors.append(f"at the end memory_reserved() is {r4}, {r0} at the start")
    if abs(u4 - u0) > SLACK:
        errors.append(f"at the end device memory in use is {(u4 - u0) / MIB:.1f} MiB away from "
                      f"the start")
    report(errors)


if __name__ == "__main__":
    main()
