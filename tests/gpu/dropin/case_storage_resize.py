"""Resizing CUDA storages in place: FSDP frees and re-allocates unsharded parameters with
`tensor.untyped_storage().resize_(0)` / `.resize_(nbytes)`, and growing buffers use
Tensor.resize_.

With PyTorch's allocator (resize_bytes_cuda: a new block from the storage's allocator, the old
bytes copied on the current stream, the old block freed): storage.resize_(0) drops
memory_allocated() by at least the storage's bytes and leaves nbytes() 0 in every tensor
sharing it; resize_(n) brings the memory back and the parameter (a view made before) reads
what is copied in; Tensor.resize_ to more elements keeps the existing elements ("Existing
elements are preserved"), also across 13 doublings from 1 KiB to 8 MiB and with views made
before the growth following the new memory; resize_ to fewer elements changes no memory; after
del memory_allocated() is back at the baseline.

Why vmm may differ: the storage's allocator (vmm's) is asked for the new block and frees the
old one while a copy from it is queued on the stream; a growth may move blocks between arenas
(the small arena below 1 MiB).
"""

import torch
from dropin_report import report


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    base = torch.cuda.memory_allocated()
    flat = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    param = flat[1000:2000].view(10, 100)
    nbytes = flat.untyped_storage().nbytes()
    for rnd in range(3):
        held = torch.cuda.memory_allocated()
        flat.untyped_storage().resize_(0)
        if held - torch.cuda.memory_allocated() < nbytes:
            errors.append(f"round {rnd}: storage.resize_(0) freed "
                          f"{held - torch.cuda.memory_allocated()} bytes < {nbytes}")
        if param.untyped_storage().nbytes() != 0:
            errors.append(f"round {rnd}: after resize_(0) a view still sees "
                          f"{param.untyped_storage().nbytes()} bytes")
        junk = torch.full((1 << 20,), -5.0, device="cuda")  # may take the freed block
        flat.untyped_storage().resize_(nbytes)
        flat.copy_(torch.arange(1 << 20, dtype=torch.float32, device="cuda") * (rnd + 1))
        del junk
        want = float(sum(range(1000, 2000))) * (rnd + 1)
        if float(param.sum().item()) != want or param.data_ptr() != flat.data_ptr() + 4000:
            errors.append(f"round {rnd}: after resize_({nbytes}) the parameter view reads "
                          f"{float(param.sum().item())}, expected {want}")
    del flat, param
    n = 256
    t = torch.arange(n, dtype=torch.float32, device="cuda")
    head = t[:n]
    for _ in range(13):
        t.resize_(2 * n)
        if not torch.equal(t[:n], torch.arange(n, dtype=torch.float32, device="cuda")):
            errors.append(f"Tensor.resize_({2 * n}) lost the {n} existing elements")
            break
        if head.data_ptr() != t.data_ptr() or not torch.equal(head, t[:256]):
            errors.append(f"at {2 * n} elements a view made before the growth no longer follows")
            break
        t[n:] = torch.arange(n, 2 * n, dtype=torch.float32, device="cuda")
        n *= 2
    before = torch.cuda.memory_allocated()
    t.resize_(10)
    if torch.cuda.memory_allocated() != before or t.tolist() != [float(i) for i in range(10)]:
        errors.append("Tensor.resize_ to fewer elements changed memory or values")
    del t, head
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after del: memory_allocated {torch.cuda.memory_allocated()} != {base}")
    report(errors)


if __name__ == "__main__":
    main()
