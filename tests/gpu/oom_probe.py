#!/usr/bin/env python3
"""Does an out-of-memory error from vmm's allocator hook reach Python, and does the process go
on? (GPU)

    python3 tests/gpu/oom_probe.py

enable(memory_limit="1G"), then 2 GiB asked for: PyTorch's CUDAPluggableAllocator does not
check for a null pointer, so the hook throws OutOfMemoryError through PyTorch. Prints what was
raised and whether a later allocation works; exit status 0 when both hold. A hang prints the
Python stacks after 30 s (faulthandler), a crash the stack of the crashing thread.
"""
import faulthandler
import sys

import torch

import vmm_torch


def main():
    faulthandler.enable()
    faulthandler.dump_traceback_later(30, exit=True)
    vmm_torch.enable(memory_limit="1G")
    print("allocating 2 GiB under a 1 GiB limit", flush=True)
    try:
        torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        print("allocated: the limit did not hold")
        return 1
    except Exception as e:  # the hook's error
        print(f"raised {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        raised = type(e).__name__ == "OutOfMemoryError"
    t = torch.ones(1 << 20, device="cuda")
    ok = float(t.sum()) == float(1 << 20)
    print(f"afterwards: 4 MiB allocated and summed {'correctly' if ok else 'WRONGLY'}", flush=True)
    return 0 if raised and ok else 1


if __name__ == "__main__":
    sys.exit(main())
