"""Sparse CUDA tensors: COO with duplicate indices coalesced, sparse x dense products, CSR x
CSR (cuSPARSE SpGEMM, whose work buffers of sizes it computes are taken from the allocator
between its phases), sparse softmax and sum, conversions between layouts, tensors with no
stored elements (every buffer of size zero), and sparse gradients of an nn.Embedding
(sparse=True) trained with torch.optim.SparseAdam (graph neural networks, recommendation
models).

With PyTorch's allocator every result equals the same computation on the CPU (within
float32 tolerance): coalesce, to_dense, sparse.mm, sparse.addmm, CSR @ CSR, CSR @ dense,
sparse.softmax, sparse.sum; an empty COO tensor coalesces, converts to CSR and multiplies
dense matrices (as COO and as CSR) into zeros without error; five
SparseAdam steps give the CPU's embedding weights; memory_allocated() is back at its
baseline at the end.

Why vmm may differ: these ops ask the allocator for many odd and zero-byte sizes (values,
indices, row pointers, cub's and cuSPARSE's work buffers, freed inside the op), and a
zero-byte request must give a null pointer that cuSPARSE accepts; the library calls hand vmm's
pointers straight to cuSPARSE.
"""
import torch
from dropin_report import baseline, memory_back, report, settle


def close(a, b, what, errors, rtol=1e-4, atol=1e-4):
    a = a.to_dense() if a.layout != torch.strided else a
    b = b.to_dense() if b.layout != torch.strided else b
    if a.shape != b.shape or not torch.allclose(a.cpu(), b.cpu(), rtol=rtol, atol=atol):
        errors.append(f"{what}: the CUDA result differs from the CPU's")


def random_coo(rows, cols, nnz, seed, dup=True):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(0, rows, (nnz,), generator=g),
                       torch.randint(0, cols, (nnz,), generator=g)])
    if dup:
        idx = torch.cat([idx, idx[:, : nnz // 3]], dim=1)  # duplicates to sum
    vals = torch.randn(idx.shape[1], generator=g)
    return torch.sparse_coo_tensor(idx, vals, (rows, cols))


def embedding_run(device, steps):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10_000, 64, sparse=True).to(device)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 10_000, (512, 8), generator=g).to(device)
        loss = emb(ids).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return emb.weight.detach().cpu()


def main():
    errors = []
    torch.empty(1, device="cuda")
    embedding_run("cuda", 1)  # lazy state (kernels, handles) made before the baseline
    base, res0, _ = baseline()

    a_cpu = random_coo(2000, 1500, 40_000, 1)
    b_cpu = random_coo(1500, 1800, 30_000, 2)
    d_cpu = torch.randn(1500, 64, generator=torch.Generator().manual_seed(4))
    a, b, d = a_cpu.cuda(), b_cpu.cuda(), d_cpu.cuda()
    try:
        close(a.coalesce(), a_cpu.coalesce(), "coalesce", errors)
        close(a.to_dense(), a_cpu.to_dense(), "to_dense", errors)
        close(torch.sparse.mm(a, d), torch.sparse.mm(a_cpu, d_cpu), "sparse.mm COO x dense",
              errors, rtol=1e-3, atol=1e-3)
        bias = torch.randn(2000, 64, generator=torch.Generator().manual_seed(5))
        close(torch.sparse.addmm(bias.cuda(), a, d, beta=0.5, alpha=2.0),
              torch.sparse.addmm(bias, a_cpu, d_cpu, beta=0.5, alpha=2.0), "sparse.addmm",
              errors, rtol=1e-3, atol=1e-3)
        a_csr, b_csr = a.coalesce().to_sparse_csr(), b.coalesce().to_sparse_csr()
        close(a_csr @ b_csr, a_cpu.to_dense() @ b_cpu.to_dense(), "CSR @ CSR", errors,
              rtol=1e-3, atol=1e-3)
        close(a_csr @ d, a_cpu.to_dense() @ d_cpu, "CSR @ dense", errors, rtol=1e-3, atol=1e-3)
        close(torch.sparse.softmax(a.coalesce(), dim=1),
              torch.sparse.softmax(a_cpu.coalesce(), dim=1), "sparse.softmax", errors)
        close(torch.sparse.sum(a, dim=0), torch.sparse.sum(a_cpu, dim=0), "sparse.sum",
              errors, rtol=1e-3, atol=1e-3)
        close(a_csr.to_sparse_coo(), a_cpu.coalesce(), "CSR to COO", errors)
    except Exception as e:  # noqa: BLE001
        errors.append(f"sparse ops: {type(e).__name__}: {str(e)[:300]}")

    # No stored elements.
    try:
        empty = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long),
                                        torch.empty(0), (300, 200)).cuda()
        e_c = empty.coalesce()
        if e_c._nnz() != 0 or bool(e_c.to_dense().any()):
            errors.append("an empty COO tensor coalesced to something")
        r = torch.sparse.mm(empty, torch.randn(200, 16, device="cuda"))
        if r.shape != (300, 16) or bool(r.any()):
            errors.append("an empty COO tensor times dense is not zeros")
        e_csr = e_c.to_sparse_csr()
        r = e_csr @ torch.randn(200, 16, device="cuda")
        if r.shape != (300, 16) or bool(r.any()):
            errors.append("an empty CSR tensor times dense is not zeros")
    except Exception as e:  # noqa: BLE001
        errors.append(f"sparse tensors with no stored elements: {type(e).__name__}: "
                      f"{str(e)[:300]}")

    # Sparse gradients and SparseAdam.
    try:
        got, want = embedding_run("cuda", 5), embedding_run("cpu", 5)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            errors.append("SparseAdam on sparse Embedding gradients differs from the CPU's")
    except Exception as e:  # noqa: BLE001
        errors.append(f"sparse Embedding with SparseAdam: {type(e).__name__}: {str(e)[:300]}")

    a = b = d = a_csr = b_csr = empty = e_c = e_csr = r = None  # noqa: F841
    settle()
    memory_back(errors, base, res0, "after the sparse ops")
    report(errors)


if __name__ == "__main__":
    main()
