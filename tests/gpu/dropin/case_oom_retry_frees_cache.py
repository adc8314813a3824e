"""An allocation that fits only once cached memory is given back succeeds.
# EXCLUSIVE (uses most of the GPU: run alone)

With PyTorch's allocator, memory held in the cache (freed tensors) is released and the
allocation retried before out of memory is raised: after 20 tensors of 3% of the free memory
each are freed (with small live tensors allocated between them), one tensor of 70% of the
free memory succeeds; then with 40% live and 40% cached, a 45% tensor succeeds; the
contents are right and, after del and empty_cache(), mem_get_info() is back near the start.

Why vmm may differ: vmm releases whole physical chunks only (a chunk with a live block in it
stays), trims before a failing growth's retry, and keeps a device-wide cap (device_cap.h).
"""

import torch
from dropin_report import report

MIB = 1 << 20


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    errors = []
    piece = int(free0 * 0.03) // 512 * 512
    bigs, smalls = [], []
    for i in range(20):
        bigs.append(torch.empty(piece, dtype=torch.uint8, device="cuda"))
        smalls.append(torch.full((1000 + i,), float(i), device="cuda"))
    del bigs
    try:
        t = torch.empty(int(free0 * 0.70), dtype=torch.uint8, device="cuda")
        t[0] = 1
        t[-1] = 2
        if (int(t[0].item()), int(t[-1].item())) != (1, 2):
            errors.append("the 70% tensor does not hold what was written")
        del t
    except torch.cuda.OutOfMemoryError as e:
        errors.append(f"70% after freeing 60% of cached tensors: OOM: {str(e)[:300]}")
    for i, s in enumerate(smalls):
        if float(s[0].item()) != float(i):
            errors.append(f"small tensor {i} changed")
    del smalls
    torch.cuda.empty_cache()  # PyTorch frees only whole cached segments on a retry
    a = torch.empty(int(free0 * 0.40), dtype=torch.uint8, device="cuda")
    b = torch.empty(int(free0 * 0.40), dtype=torch.uint8, device="cuda")
    del b
    try:
        c = torch.empty(int(free0 * 0.45), dtype=torch.uint8, device="cuda")
        c.fill_(5)
        if int(c[-1].item()) != 5:
            errors.append("the 45% tensor does not hold what was written")
        del c
    except torch.cuda.OutOfMemoryError as e:
        errors.append(f"45% with 40% live and 40% cached: OOM: {str(e)[:300]}")
    del a
    torch.cuda.empty_cache()
    free1, _ = torch.cuda.mem_get_info()
    if free1 < free0 - 256 * MIB:
        errors.append(f"after empty_cache: {free1} bytes free, {free0} at the start")
    report(errors)


if __name__ == "__main__":
    main()
