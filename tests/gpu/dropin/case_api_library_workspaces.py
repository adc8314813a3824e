"""Library workspaces: the scratch memory that cuBLAS/cuBLASLt, cuFFT, cuSOLVER, cuSPARSE,
cub/thrust and the fused attention kernels take from PyTorch's CUDA allocator (DataPtrs from
allocate(), raw_alloc/raw_delete, per-handle workspaces kept between calls), with
CUBLAS_WORKSPACE_CONFIG set as deterministic training scripts set it.

With PyTorch's allocator: float32/bfloat16/float16 matmuls (mm, addmm with bias, bmm, linear +
gelu), rfft2/irfft2 and an FFT of odd length, cholesky, solve, eigvalsh, svdvals and QR,
sparse CSR @ dense, sort, stable argsort, unique with counts, topk, cumsum and nonzero, and
scaled_dot_product_attention forward and backward (causal, float16) agree with CPU references
(float64 where rounding matters, exactly for integer and ordering results); three rounds of
them leave memory_allocated() the same after the second and the third round (the workspaces
kept per handle and stream are made once, every other scratch block is given back), and
clearing the cuFFT plan cache and the cuBLAS workspaces frees and does not add.

Why vmm may differ: these requests come through allocate() and raw_alloc()/raw_delete() of
CUDAPluggableAllocator (VmmAllocator::Malloc/Free), with sizes, streams and lifetimes the
libraries choose; a leak, a block handed out twice or a wrong size shows as a wrong result or
a growing memory_allocated().
"""
import gc
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dropin_report import check_level, level, report  # noqa: E402


def rel(got, want):
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.is_complex() or want.is_complex():
        got = torch.view_as_real(got.to(torch.complex128))
        want = torch.view_as_real(want.to(torch.complex128))
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def make_data():
    g = torch.Generator().manual_seed(0)
    d = {}
    d["A"] = torch.randn(512, 384, generator=g)
    d["B"] = torch.randn(384, 256, generator=g)
    d["bias"] = torch.randn(256, generator=g)
    d["Ab"] = torch.randn(8, 128, 192, generator=g)
    d["Bb"] = torch.randn(8, 192, 64, generator=g)
    d["X"] = torch.randn(256, 512, generator=g)
    d["W"] = torch.randn(384, 512, generator=g) / 16
    d["bl"] = torch.randn(384, generator=g)
    d["img"] = torch.randn(16, 96, 80, generator=g)
    d["sig"] = torch.randn(4, 1001, generator=g)
    m = torch.randn(192, 192, generator=g, dtype=torch.float64)
    d["spd"] = (m @ m.T / 192 + torch.eye(192, dtype=torch.float64)).float()
    d["sym"] = ((m + m.T) / 2).float()
    d["M"] = torch.randn(160, 96, generator=g)
    d["rhs"] = torch.randn(192, 8, generator=g)
    dense = torch.randn(300, 400, generator=g)
    dense[torch.rand(300, 400, generator=g) > 0.05] = 0
    d["sp"] = dense
    d["rhs_sp"] = torch.randn(400, 64, generator=g)
    d["v"] = torch.randn(1 << 20, generator=g)
    d["vi"] = torch.randint(0, 5000, (1 << 20,), generator=g)
    d["q"] = torch.randn(2, 8, 256, 64, generator=g)
    d["k"] = torch.randn(2, 8, 256, 64, generator=g)
    d["vv"] = torch.randn(2, 8, 256, 64, generator=g)
    d["go"] = torch.randn(2, 8, 256, 64, generator=g)
    return d


def references(d):
    r = {}
    A, B = d["A"].double(), d["B"].double()
    r["mm"] = A @ B
    r["addmm"] = d["bias"].double() + A @ B
    r["bmm_bf16"] = d["Ab"].double() @ d["Bb"].double()
    r["linear_gelu"] = F.gelu(d["X"].double() @ d["W"].double().T + d["bl"].double())
    r["fft_roundtrip"] = d["img"].double()
    r["fft_odd"] = torch.fft.fft(d["sig"].double())
    r["cholesky"] = torch.linalg.cholesky(d["spd"].double())
    r["solve"] = torch.linalg.solve(d["spd"].double(), d["rhs"].double())
    r["eigvalsh"] = torch.linalg.eigvalsh(d["sym"].double())
    r["svdvals"] = torch.linalg.svdvals(d["M"].double())
    r["qr_absdiag"] = torch.linalg.qr(d["M"].double()).R.diagonal().abs()
    r["spmm"] = d["sp"].double() @ d["rhs_sp"].double()
    r["sort"] = torch.sort(d["v"]).values
    r["topk"] = torch.topk(d["v"], 100).values
    r["argsort_stable"] = torch.argsort(d["vi"], stable=True)
    r["unique"], r["counts"] = torch.unique(d["vi"], return_counts=True)
    r["cumsum"] = torch.cumsum(d["vi"], 0)
    r["nonzero"] = torch.nonzero(d["vi"] > 4000)
    q, k, v = (d[n].clone().requires_grad_() for n in ("q", "k", "vv"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out * d["go"]).sum().backward()
    r["sdpa"], r["sdpa_dq"], r["sdpa_dk"], r["sdpa_dv"] = out.detach(), q.grad, k.grad, v.grad
    return r


TOL = {"mm": 1e-4, "addmm": 1e-4, "bmm_bf16": 3e-2, "linear_gelu": 1e-2,
       "fft_roundtrip": 1e-4, "fft_odd": 1e-4, "cholesky": 1e-4, "solve": 1e-3,
       "eigvalsh": 1e-4, "svdvals": 1e-4, "qr_absdiag": 1e-4, "spmm": 1e-4,
       "sdpa": 2e-2, "sdpa_dq": 5e-2, "sdpa_dk": 5e-2, "sdpa_dv": 5e-2}
EXACT = ("sort", "topk", "argsort_stable", "unique", "counts", "cumsum", "nonzero")


def gpu_round(g):
    o = {}
    o["mm"] = g["A"] @ g["B"]
    o["addmm"] = torch.addmm(g["bias"], g["A"], g["B"])
    o["bmm_bf16"] = torch.bmm(g["Ab"].bfloat16(), g["Bb"].bfloat16())
    o["linear_gelu"] = F.gelu(F.linear(g["X"].half(), g["W"].half(), g["bl"].half()))
    o["fft_roundtrip"] = torch.fft.irfft2(torch.fft.rfft2(g["img"]), s=g["img"].shape[-2:])
    o["fft_odd"] = torch.fft.fft(g["sig"])
    o["cholesky"] = torch.linalg.cholesky(g["spd"])
    o["solve"] = torch.linalg.solve(g["spd"], g["rhs"])
    o["eigvalsh"] = torch.linalg.eigvalsh(g["sym"])
    o["svdvals"] = torch.linalg.svdvals(g["M"])
    o["qr_absdiag"] = torch.linalg.qr(g["M"]).R.diagonal().abs()
    o["spmm"] = g["sp_csr"] @ g["rhs_sp"]
    o["sort"] = torch.sort(g["v"]).values
    o["topk"] = torch.topk(g["v"], 100).values
    o["argsort_stable"] = torch.argsort(g["vi"], stable=True)
    o["unique"], o["counts"] = torch.unique(g["vi"], return_counts=True)
    o["cumsum"] = torch.cumsum(g["vi"], 0)
    o["nonzero"] = torch.nonzero(g["vi"] > 4000)
    q, k, v = (g[n].half().requires_grad_() for n in ("q", "k", "vv"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out * g["go"].half()).sum().backward()
    o["sdpa"], o["sdpa_dq"], o["sdpa_dk"], o["sdpa_dv"] = out.detach(), q.grad, k.grad, v.grad
    return {name: t.cpu() for name, t in o.items()}


def main():
    data = make_data()
    refs = references(data)
    gpu = {n: t.cuda() for n, t in data.items()}
    gpu["sp_csr"] = gpu.pop("sp").to_sparse_csr()
    torch.cuda.synchronize()
    errors = []
    after = []
    for rnd in range(3):
        got = gpu_round(gpu)
        torch.cuda.synchronize()
        for name, t in got.items():
            if name in EXACT:
                if not torch.equal(t, refs[name]):
                    errors.append(f"round {rnd}: {name} differs from the CPU result")
            else:
                err = rel(t, refs[name])
                if not err <= TOL[name]:
                    errors.append(f"round {rnd}: {name} is off by {err:.3g} (relative; "
                                  f"tolerance {TOL[name]})")
        del got
        after.append(level())
        if errors:
            break
    check_level(after, errors)
    torch.backends.cuda.cufft_plan_cache.clear()
    torch._C._cuda_clearCublasWorkspaces()
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() > after[-1]:
        errors.append(f"clearing the cuFFT plans and cuBLAS workspaces raised memory_allocated "
                      f"from {after[-1]} to {torch.cuda.memory_allocated()}")
    torch.cuda.empty_cache()
    report(errors)


if __name__ == "__main__":
    main()
