"""DataLoader with spawned workers whose Dataset builds CUDA tensors (default collate stacks
them in the worker and the batch travels to the main process as a CUDA tensor).

With PyTorch's allocator this works (CUDA in workers needs "spawn"): two epochs with
persistent workers give every sample once per epoch with the right values.

Why vmm may differ: each batch is a vmm send from a worker (its own vmm pool, enabled
through VMM_TORCH_ENABLE at its start) through the worker's result queue; the collate
output comes from UntypedStorage._new_shared on CUDA; the worker processes exit while
acknowledgements are in flight.
"""
import sys

import torch
from torch.utils.data import DataLoader, Dataset


class CudaDataset(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        x = torch.full((64,), float(i), device="cuda")
        return x * 2, torch.tensor(i)


def main():
    loader = DataLoader(CudaDataset(), batch_size=8, num_workers=2, shuffle=False,
                        multiprocessing_context="spawn", persistent_workers=True)
    errors = []
    for epoch in range(2):
        seen = []
        for xb, ib in loader:
            if not xb.is_cuda or tuple(xb.shape) != (8, 64):
                errors.append(f"epoch {epoch}: batch {tuple(xb.shape)} on {xb.device}")
                continue
            if not torch.equal(xb[:, 0].cpu(), ib.float() * 2) or \
                    not bool((xb == xb[:, :1]).all().item()):
                errors.append(f"epoch {epoch}: batch values differ for {ib.tolist()}")
            seen.extend(ib.tolist())
            del xb
        if seen != list(range(96)):
            errors.append(f"epoch {epoch}: samples {seen[:10]}... ({len(seen)})")
    del loader
    if errors:
        for e in errors[:10]:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
