"""Memory a process sent to another and then freed goes back to the GPU while DataLoader
workers it forked after the send are alive.

A training process sends a 256 MiB CUDA tensor to a spawned consumer through a
torch.multiprocessing queue, then starts persistent DataLoader workers (fork, Linux's default
start method before Python 3.14) over a CPU dataset and takes a batch. With the workers still
alive, the consumer has dropped the tensor and exited, and the producer drops it too and empties
the cache: torch.cuda.mem_get_info() must show at least 224 MiB more free memory than while the
tensor lived.

With PyTorch's allocator the tensor is sent as a CUDA IPC handle; the forked workers hold no
reference to the memory, so empty_cache() (after ipc_collect()) frees it.

Why vmm may differ: with POSIX-fd handles (a machine without an IMEX channel, or
handle_type=posix_fd) a sent chunk is exported as an fd that the process's fd server keeps
open, and fork() copies every open fd into each worker; a CUDA allocation stays on the GPU
while any copy of its fd is open, whatever the owner released.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error
from torch.utils.data import DataLoader, Dataset

MIB = 1 << 20
SIZE = 256 * MIB


class Numbers(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i))


def consumer(q, reply):
    t = q.get(timeout=90)
    total = float(t.double().sum().item())
    del t
    torch.cuda.synchronize()
    reply.put(total)


def main():
    errors = []
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, reply), daemon=True)
    p.start()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    t = torch.full((SIZE // 4,), 2.0, device="cuda")
    q.put(t)
    total = reply.get(timeout=90)
    if total != 2.0 * (SIZE // 4):
        errors.append(f"the consumer summed {total}, expected {2.0 * (SIZE // 4)}")
    p.join(60)
    # Workers forked while the tensor is live and sent; kept alive while it is released.
    loader = DataLoader(Numbers(), batch_size=8, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    batches = iter(loader)
    first = next(batches)
    if first[0].tolist() != [0.0] * 4:
        errors.append(f"the first batch begins {first[0].tolist()}")
    torch.cuda.synchronize()
    free_live = torch.cuda.mem_get_info()[0]
    del t
    error = memory_back_error(base, "consumer")
    if error:
        errors.append(error)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    back = free_after - free_live
    if back < SIZE - 32 * MIB:
        errors.append(f"with the forked workers alive, releasing the {SIZE // MIB} MiB tensor "
                      f"gave back {back / MIB:.1f} MiB of GPU memory")
    rest = sum(1 for _ in batches)
    if rest != 7:
        errors.append(f"{rest} more batches, expected 7")
    del batches, loader
    report(errors)


if __name__ == "__main__":
    main()
