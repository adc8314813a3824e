"""Tensors that are views of one large storage and tensors moved between storages: flat
parameter buffers with per-parameter views (FSDP's and DeepSpeed's flat params, Megatron's
contiguous gradient buffer), `param.data = other`, `Tensor.set_(storage, offset, size,
stride)` to re-point a tensor at another buffer, `set_()` to detach one from its memory,
`as_strided` windows, torch.utils.swap_tensors, and empty_strided tensors whose storage is
smaller than their shape (stride 0).

With PyTorch's allocator a block is freed when the last tensor that uses its storage goes,
and only then (the storage holds the DataPtr): dropping the base of a 64 MiB buffer while a
view lives changes memory_allocated() by nothing; dropping the last view frees at least
64 MiB; set_() of a tensor onto another tensor's storage frees the tensor's own storage (if
nothing else holds it) and leaves data_ptr() == the other storage's address + offset *
element size, with writes through either tensor seen by the other; set_() with no argument
leaves a tensor of 0 elements and frees its storage; `p.data = q` frees p's old storage;
swap_tensors swaps the memory two tensors use (data_ptr() swapped, values swapped);
untyped_storage().resize_(0) and back, with views set_() onto the storage again, reads what is
written after; as_strided windows into a buffer read and write the bytes they name, up to the
buffer's last element; torch.empty_strided((4096, 4096), (0, 1)) allocates at least 16 KiB
but far less than 64 MiB (the case allows up to 2 MiB); and after all of it (every name bound
to a tensor dropped, loop variables included) memory_allocated() and allocation.all.current
are back at their baseline and, after empty_cache(), memory_reserved() is no higher than it
was.

Why vmm may differ: its blocks are found by address (a free looks up the pointer the DataPtr
holds); views, offsets into blocks and blocks freed while another tensor points into the
same chunk test that lookup and the moment a block goes back.
"""
import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20
N = 16 * MIB  # float32 elements: 64 MiB


def alloc_now():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main():
    errors = []
    torch.empty(1, device="cuda")
    base, res0, count0 = baseline()

    # Views keep the storage: dropping the base changes nothing, dropping the last view frees.
    flat = torch.arange(N, dtype=torch.float32, device="cuda")
    views = [flat[i * MIB:(i + 1) * MIB].view(1024, 1024) for i in range(0, 16, 5)]
    tail = flat.narrow(0, N - 10, 10)
    held = alloc_now()
    del flat
    if alloc_now() != held:
        errors.append(f"dropping the base of live views changed memory_allocated() from {held} to "
                      f"{alloc_now()}")
    if tail.tolist() != [float(N - 10 + i) for i in range(10)]:
        errors.append(f"the last elements read through a view after the base went: "
                      f"{tail.tolist()}")
    for i, v in zip(range(0, 16, 5), views):
        if float(v[-1, -1].item()) != float((i + 1) * MIB - 1):
            errors.append(f"view {i} lost its values after the base went")
    del views, v  # the loop variable still held the last of them
    if alloc_now() != held:
        errors.append("dropping some views while one lives changed memory_allocated()")
    del tail
    if held - alloc_now() < N * 4:
        errors.append(f"dropping the last view freed {held - alloc_now()} bytes, the storage has "
                      f"{N * 4}")

    # set_ onto another tensor's storage.
    a = torch.full((N,), 1.0, device="cuda")
    b = torch.full((N,), 2.0, device="cuda")
    before = alloc_now()
    a.set_(b.untyped_storage(), 1000, (1024, 1024), (1024, 1))
    if before - alloc_now() < N * 4:
        errors.append(f"set_ onto another storage freed {before - alloc_now()} bytes of a's own "
                      f"{N * 4}")
    if a.data_ptr() != b.data_ptr() + 1000 * 4:
        errors.append(f"after set_ a.data_ptr() is b's + {a.data_ptr() - b.data_ptr()}, not 4000")
    a.fill_(5.0)
    if float(b[1000].item()) != 5.0 or float(b[999].item()) != 2.0 or \
            float(b[1000 + 1024 * 1024].item()) != 2.0:
        errors.append("writes through a set_ tensor are not where its offset says in the other")
    b[1000 + 1024 * 1024 - 1] = 7.0
    if float(a[-1, -1].item()) != 7.0:
        errors.append("a write to the storage is not seen through the set_ tensor")
    a.set_()
    if a.numel() != 0 or b.untyped_storage().nbytes() != N * 4:
        errors.append("set_() with no argument did not leave an empty tensor alone")
    del a
    if alloc_now() > before - N * 4:
        errors.append(f"with a's storage given up memory_allocated() is {alloc_now()}, more than "
                      f"{before - N * 4} (b's storage and what was there before)")
    held = alloc_now()
    del b
    if held - alloc_now() < N * 4:
        errors.append("b's storage was not freed with the last tensor on it")

    # p.data = q, and swap_tensors.
    p = torch.nn.Parameter(torch.full((N,), 3.0, device="cuda"))
    q = torch.full((N,), 4.0, device="cuda")
    held = alloc_now()
    p.data = q
    if held - alloc_now() < N * 4:
        errors.append(f"`p.data = q` freed {held - alloc_now()} bytes of p's {N * 4}")
    if p.data_ptr() != q.data_ptr() or float(p[123].item()) != 4.0:
        errors.append("`p.data = q` did not point p at q's memory")
    del p, q
    x = torch.full((MIB,), 8.0, device="cuda")
    y = torch.full((MIB,), 9.0, device="cuda")
    px, py = x.data_ptr(), y.data_ptr()
    torch.utils.swap_tensors(x, y)
    if (x.data_ptr(), y.data_ptr()) != (py, px) or float(x[0].item()) != 9.0 or \
            float(y[-1].item()) != 8.0:
        errors.append("swap_tensors did not swap the tensors' memory")
    del x, y

    # resize_(0) and back, with a view set_ onto the storage again.
    buf = torch.zeros(N, device="cuda")
    st = buf.untyped_storage()
    held = alloc_now()
    st.resize_(0)
    if held - alloc_now() < N * 4:
        errors.append(f"storage.resize_(0) freed {held - alloc_now()} bytes of {N * 4}")
    st.resize_(N * 4)
    buf.set_(st, 0, (N,), (1,))
    part = torch.empty(0, device="cuda").set_(st, N // 2, (4, 1024), (1024, 1))
    buf.copy_(torch.arange(N, dtype=torch.float32, device="cuda"))
    if part.data_ptr() != buf.data_ptr() + N // 2 * 4 or \
            float(part[3, 1023].item()) != float(N // 2 + 4095):
        errors.append("a tensor set_ onto a storage resized back reads the wrong place")

    # as_strided windows, up to the last element.
    win = buf.as_strided((1024, 8), (MIB // 64, 1), N - 1 - (1023 * (MIB // 64) + 7))
    want = torch.tensor([[float(win.storage_offset() + r * (MIB // 64) + c) for c in range(8)]
                         for r in (0, 1023)])
    if not torch.equal(win[[0, 1023]].cpu(), want):
        errors.append("an as_strided window does not read the bytes it names")
    win.fill_(-1.0)
    if float(buf[-1].item()) != -1.0 or float(buf[win.storage_offset() - 1].item()) == -1.0:
        errors.append("a write through an as_strided window missed its bytes")
    del buf, st, part, win

    # A tensor with stride 0 has a storage of its last dimension only.
    held = alloc_now()
    e = torch.empty_strided((4096, 4096), (0, 1), device="cuda")
    grew = alloc_now() - held
    if not 4096 * 4 <= grew <= 2 * MIB:
        errors.append(f"empty_strided((4096, 4096), (0, 1)) grew memory_allocated() by {grew}")
    e[0].fill_(1.5)  # row 0 covers the whole storage (no in-place op on overlapping memory)
    if float(e.min().item()) != 1.5 or float(e.max().item()) != 1.5:
        errors.append("the stride-0 tensor does not read what was written")
    del e

    settle()  # memory_back() reads the statistics as they are: the cache is emptied here
    memory_back(errors, base, res0, "with every tensor dropped", count0)
    report(errors)


if __name__ == "__main__":
    main()
