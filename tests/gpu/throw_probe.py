#!/usr/bin/env python3
"""Does an error thrown inside vmm's wrap_import op reach Python in a fresh process? (GPU)

    python3 tests/gpu/throw_probe.py [--torch-error-first]

Imports a host-pool buffer and asks the op for a view larger than the buffer, which must raise
RuntimeError. On the GPU machine a spawned receiver died (SIGSEGV) at that point although the
same call raised cleanly in the test process; this isolates it. With --torch-error-first, a
PyTorch error is raised (and caught) first. Prints one line; exit status 0 when it raised.
"""
import sys

import torch

import vmm_torch
from vmm_torch import _lib, sharing


def main():
    if "--torch-error-first" in sys.argv:
        try:
            torch.empty(2, 3).view(7)
        except RuntimeError:
            pass
    with vmm_torch.Pool("host") as pool:
        t = pool.empty((16,), dtype=torch.float32)
        data = vmm_torch.export_tensor(t).descriptor.to_bytes()
        import_id = sharing._import_id(data, None, "host")
        try:
            _lib.load().wrap_import(import_id, (1000,), (1,), 0, torch.float32)
        except RuntimeError as e:
            print(f"raised cleanly: {e}")
            return 0
        finally:
            sharing._release(import_id)
    print("no error raised")
    return 1


if __name__ == "__main__":
    sys.exit(main())
