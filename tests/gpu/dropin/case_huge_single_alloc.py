"""One tensor of most of the GPU (a KV cache or flat parameter buffer sized from
mem_get_info(), as serving engines do).
# EXCLUSIVE (uses ~85% of the GPU: run alone)

With PyTorch's allocator a single torch.empty of 85% of the free memory succeeds (one
cudaMalloc), holds what is written at both ends and in the middle, counts in
memory_allocated(), and after del + empty_cache() mem_get_info() is back near the start. Then
the same once more with a slightly larger size (the cached block does not fit it).

Why vmm may differ: a device pool grows by single chunks of at most max_chunk (64 GiB by
default, docs/DESIGN.md §7) inside one reserved virtual range; a request above max_chunk or
near the reservation's size takes another path.
"""
import sys

import torch

MIB = 1 << 20


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    errors = []
    for frac in (0.85, 0.87):
        n = int(free0 * frac) // 4 * 4
        try:
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            errors.append(f"{frac:.0%} of the free memory ({n} bytes) in one tensor: OOM: "
                          f"{str(e)[:300]}")
            continue
        if torch.cuda.memory_allocated() < n:
            errors.append(f"memory_allocated {torch.cuda.memory_allocated()} < {n}")
        view = t.view(torch.int32)
        m = view.numel()
        idx = torch.tensor([0, m // 3, m // 2, m - 1], device="cuda")
        view[idx] = torch.tensor([11, 22, 33, 44], dtype=torch.int32, device="cuda")
        view[m // 2 + 1: m // 2 + (64 << 20) // 4].fill_(5)
        got = view[idx].tolist()
        if got != [11, 22, 33, 44]:
            errors.append(f"{frac:.0%}: read back {got}")
        if int(view[m // 2 + 1: m // 2 + (64 << 20) // 4].sum().item()) != 5 * ((64 << 20) // 4 - 1):
            errors.append(f"{frac:.0%}: 64 MiB filled in the middle do not read back")
        del t, view
    torch.cuda.empty_cache()
    free1, _ = torch.cuda.mem_get_info()
    if free1 < free0 - 256 * MIB:
        errors.append(f"after del + empty_cache: {free1} free, {free0} at the start")
    if errors:
        for e in errors:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print(f"ok ({free0 / 2**30:.1f} GiB free at start)")


if __name__ == "__main__":
    main()
