"""A CUDA tensor with a DLPack alias (what CuPy / JAX / Triton interop keeps) is sent to
another process; the program then writes through the alias.

With PyTorch's allocator sending does not move the tensor: the alias and the tensor remain
the same memory (same data_ptr), so a write through the alias shows in the tensor.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): Queue.put moves a small tensor that shares a physical chunk into memory
of its own (swapping the storage of the tensor and its views); a DLPack alias has a storage of
its own and keeps the old address, which is freed: the two stop aliasing, and the alias
points at freed memory that later allocations may take.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report


def child(q, reply):
    t = q.get(timeout=60)
    reply.put(float(t.sum().item()))
    del t


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    neighbours = [torch.ones(2048, device="cuda") for _ in range(4)]
    t = torch.full((4096,), 2.0, device="cuda")
    more = [torch.ones(2048, device="cuda") for _ in range(4)]
    alias = torch.from_dlpack(t)
    errors = []
    if alias.data_ptr() != t.data_ptr():
        errors.append("from_dlpack did not alias")
    q.put(t)
    got = reply.get(timeout=90)
    if got != 2.0 * 4096:
        errors.append(f"the receiver got sum {got}")
    alias.fill_(7.0)
    fresh = [torch.zeros(4096, device="cuda") for _ in range(16)]  # may reuse freed memory
    torch.cuda.synchronize()
    if t.data_ptr() != alias.data_ptr():
        errors.append(f"after the send the tensor moved: data_ptr {t.data_ptr():#x}, its DLPack "
                      f"alias {alias.data_ptr():#x}")
    if float(t.sum().item()) != 7.0 * 4096:
        errors.append(f"a write through the DLPack alias is not in the tensor (sum "
                      f"{float(t.sum().item())})")
    p.join(30)
    del neighbours, more, fresh
    report(errors)


if __name__ == "__main__":
    main()
