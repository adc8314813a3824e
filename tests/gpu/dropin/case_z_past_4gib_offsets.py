"""Tensors larger than 4 GiB and more than 2**31 elements, used at offsets past 2**31 and
2**32 bytes: a KV cache or an embedding table of several GiB whose last rows are read and
written by index, sliced and fed to a matrix product, copied to and from the host, cloned
and reduced (kernels that switch to 64-bit indexing, cuBLAS on a pointer far into a block,
cudaMemcpy of a slice at the end).
# EXCLUSIVE (allocates about 11 GiB: run alone)

With PyTorch's allocator such a tensor is one cudaMalloc'd block, so every byte of it can be
addressed: a 5 GiB + 4 KiB uint8 tensor filled with 1 sums to its size (sum as int64, taken
over slices of 32 MiB: a sum with dtype=int64 converts its input to int64 first, 8 bytes an
element, and the whole tensor would need a 40 GiB temporary; no step of the case needs more
than about 512 MiB beside its tensors); bytes
written at 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1 and the last index read back (and
their neighbours keep the fill); its bfloat16 view (more than 2**31 elements) after add_(1)
holds 2.0 everywhere (min and max) and at indices past 2**31; a float32 view of rows of 1024
elements gets rows near the end written with their row numbers, read back with index_select
and through a matrix product of a 256-row slice starting past 4 GiB (against the same product
on the CPU); a host tensor copied into the last 64 MiB and back is unchanged; clone() of the
whole tensor equals it at the sampled offsets, slice by slice of 256 MiB (torch.equal) and in
its int64 sum; after del and empty_cache() memory_allocated() is back at its baseline and
memory_reserved() no higher than it was. Where the GPU has less than 16 GiB
free, nothing is checked (the case says so and exits 0).

Why vmm may differ: vmm maps a large block as several physical chunks (at most max_chunk each,
docs/DESIGN.md §7) inside one reserved virtual range; an address past a chunk boundary or past
4 GiB into the block must be mapped, with access set, like every other, and the block's
bookkeeping (size, offset arithmetic) must not wrap at 32 bits.
"""
import torch
from dropin_report import baseline, memory_back, report, settle

MIB, GIB = 1 << 20, 1 << 30
SIZE = 5 * GIB + 4096
ROW = 1024  # float32 elements per row: 4 KiB


def int64_sum(t, chunk=32 * MIB):
    """The sum of uint8 tensor `t` as int64, over slices of `chunk` bytes (each converted to
    int64 is 8 times its size: 256 MiB)."""
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for i in range(0, t.numel(), chunk):
        total += t[i:i + chunk].sum(dtype=torch.int64)
    return int(total.item())


def equal_by_slices(a, b, chunk=256 * MIB):
    """torch.equal of two 1-D tensors of one size, over slices of `chunk` elements."""
    return all(torch.equal(a[i:i + chunk], b[i:i + chunk]) for i in range(0, a.numel(), chunk))


def main():
    errors = []
    torch.empty(1, device="cuda")
    a = torch.randn(256, ROW, device="cuda")
    (a @ a.T).sum().item()  # cuBLAS's workspace before the baseline
    del a
    base, res0, count0 = baseline()
    free = torch.cuda.mem_get_info()[0]
    if free < 16 * GIB:
        print(f"only {free / GIB:.1f} GiB free; nothing checked")
        report([])
        return

    t = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    total = int64_sum(t)
    if total != SIZE:
        errors.append(f"a {SIZE}-byte tensor filled with 1 sums to {total}")
    marks = [(1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, SIZE - 1]
    idx = torch.tensor(marks, device="cuda")
    vals = torch.tensor([11, 22, 33, 44, 55, 66], dtype=torch.uint8, device="cuda")
    t[idx] = vals
    got = t[idx].tolist()
    if got != [11, 22, 33, 44, 55, 66]:
        errors.append(f"bytes written past 2**31 / 2**32 read back as {got}")
    near = t[(1 << 32) - 3:(1 << 32) + 4].tolist()
    if near != [1, 1, 33, 44, 55, 1, 1]:
        errors.append(f"the bytes around 2**32 read {near}")

    # The bfloat16 view: more than 2**31 elements.
    b = t.view(torch.bfloat16)
    b.fill_(1.0)
    b.add_(1.0)
    lo, hi = float(b.min().item()), float(b.max().item())
    if (lo, hi) != (2.0, 2.0):
        errors.append(f"the bfloat16 view ({b.numel()} elements) after add_(1) spans {lo}..{hi}")
    far = [(1 << 31) + 5, b.numel() - 1]
    if [float(b[i].item()) for i in far] != [2.0, 2.0]:
        errors.append("bfloat16 elements past 2**31 do not read 2.0")
    del b

    # A float32 view by rows: rows near the end written with their numbers.
    f = t.view(torch.float32)[: (SIZE // 4) // ROW * ROW].view(-1, ROW)
    rows = f.shape[0]
    start = rows - 4096
    f[start:] = torch.arange(start, rows, dtype=torch.float32, device="cuda").unsqueeze(1)
    pick = torch.tensor([start, start + 1, rows - 2, rows - 1], device="cuda")
    got = f.index_select(0, pick)[:, [0, ROW - 1]].tolist()
    want = [[float(r), float(r)] for r in pick.tolist()]
    if got != want:
        errors.append(f"index_select of rows past 4 GiB read {got}, expected {want}")
    first = ((1 << 32) // (ROW * 4)) + 7  # a row starting past 4 GiB
    f[first:first + 256] = torch.randn(256, ROW, device="cuda")
    w = torch.randn(ROW, 64, device="cuda")
    prod = (f[first:first + 256] @ w).cpu()
    ref = f[first:first + 256].cpu() @ w.cpu()
    if not torch.allclose(prod, ref, rtol=1e-3, atol=1e-3):
        errors.append(f"a matrix product of a slice past 4 GiB differs from the CPU's by "
                      f"{float((prod - ref).abs().max())}")
    del f, w, prod, ref

    # Host to the last 64 MiB and back.
    host = torch.randint(0, 255, (64 * MIB,), dtype=torch.uint8)
    t[-64 * MIB:].copy_(host)
    back = t[-64 * MIB:].cpu()
    if not torch.equal(back, host):
        errors.append("64 MiB copied from the host into the tensor's end came back different")
    del host, back

    # clone() of the whole tensor.
    t[idx] = vals
    c = t.clone()
    if c[idx].tolist() != [11, 22, 33, 44, 55, 66]:
        errors.append(f"clone() of the {SIZE}-byte tensor reads {c[idx].tolist()} at the marks")
    if not equal_by_slices(t, c):
        errors.append("clone() of the whole tensor differs from it (compared by 256 MiB slices)")
    s_t, s_c = int64_sum(t), int64_sum(c)
    if s_t != s_c:
        errors.append(f"clone() sums to {s_c}, the original to {s_t}")
    del c, t, idx, vals, pick
    settle()  # memory_back() reads the statistics as they are: the cache is emptied here
    memory_back(errors, base, res0, "with the large tensors dropped", count0)
    report(errors)


if __name__ == "__main__":
    main()
