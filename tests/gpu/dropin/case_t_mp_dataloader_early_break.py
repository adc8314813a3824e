"""A loop that stops early over a DataLoader whose worker processes build CUDA tensors:
`for i, batch in enumerate(loader): ... if i == 2: break`, as validation with a batch limit
(Lightning's limit_val_batches), max_steps, or a quick sanity check over the first batches
writes it, with spawned workers (CUDA in DataLoader workers needs spawn) that prefetch batches
(prefetch_factor=4) and are not persistent, so each pass starts its workers and shuts them
down when the iterator is dropped.

The batches the main process has not read yet when it breaks (about 8 of them, prefetched by
the workers) are never unpickled: no receiver ever takes them.

With PyTorch's allocator, for 2 passes: the three batches read hold the right samples
(sample i is a 64 KiB tensor filled with i, made on the GPU in the worker); dropping the
iterator (DataLoader's _shutdown_workers: the workers are told to stop, exit, and are joined
with a timeout of 5 s, past which they are terminated) returns within 4 s, and every worker
exits by itself with status 0: a worker's CUDA IPC sends that nobody received are only a
warning at its exit ("Producer process has been terminated before all shared CUDA tensors
released").

Why vmm may differ: a vmm sender waits at exit (up to VMM_SEND_EXIT_WAIT_S, 10 s by default)
for the receivers of its sends to acknowledge them, after joining its queues' feeder threads;
the prefetched batches never are, so each worker outlives DataLoader's 5 s join and is
killed with SIGTERM, and every early stop costs seconds.
"""
import gc
import sys
import time

import torch
import torch.multiprocessing as mp
from dropin_report import report
from torch.utils.data import DataLoader, Dataset

PASSES = 2
STOP_AFTER = 2
SAMPLE = 1 << 14  # float32 elements: 64 KiB


class CudaSamples(Dataset):
    def __len__(self):
        return 128

    def __getitem__(self, i):
        return torch.full((SAMPLE,), float(i), device="cuda")


def main():
    errors = []
    ctx = mp.get_context("spawn")
    torch.ones(1, device="cuda")
    for epoch in range(PASSES):
        loader = DataLoader(CudaSamples(), batch_size=4, num_workers=2, prefetch_factor=4,
                            multiprocessing_context=ctx, persistent_workers=False)
        it = iter(loader)
        for i, batch in enumerate(it):
            want = torch.arange(4 * i, 4 * i + 4, dtype=torch.float32, device="cuda")
            if tuple(batch.shape) != (4, SAMPLE) or not batch.is_cuda or \
                    not torch.equal(batch[:, 0], want) or not torch.equal(batch[:, -1], want):
                errors.append(f"pass {epoch}, batch {i}: wrong samples "
                              f"{batch[:, 0].tolist() if batch.dim() == 2 else batch.shape}")
            if i == STOP_AFTER:
                break
        workers = list(getattr(it, "_workers", []))
        del batch, want
        start = time.monotonic()
        del it  # DataLoader's iterator shuts its workers down here
        gc.collect()
        took = time.monotonic() - start
        for w in workers:
            w.join(30)
        codes = [w.exitcode for w in workers]
        print(f"pass {epoch}: shutting the workers down took {took:.2f} s; their exit "
              f"statuses {codes}")
        if took > 4.0:
            errors.append(f"pass {epoch}: dropping the iterator after an early break took "
                          f"{took:.1f} s (DataLoader joins each worker for up to 5 s)")
        if any(c != 0 for c in codes):
            errors.append(f"pass {epoch}: the workers ended with statuses {codes} (negative: "
                          f"killed by that signal; DataLoader terminates a worker still alive "
                          f"after its join)")
        del loader
    report(errors)


if __name__ == "__main__":
    sys.exit(main())
