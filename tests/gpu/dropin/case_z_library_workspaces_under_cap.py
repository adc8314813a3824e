"""cuDNN convolutions (torch.backends.cudnn.benchmark on and off), cuBLAS matrix products and
scaled_dot_product_attention under a tight torch.cuda.set_per_process_memory_fraction: a
vision or speech model trained on a GPU shared with another job, with only a few hundred MiB
of room above its tensors, where the libraries' workspaces must fit or be given up.

With PyTorch's allocator a request above the cap raises c10::OutOfMemoryError, which the
libraries catch: cuDNN's benchmark mode (Conv_v8.cpp generate_and_filter_plans) sizes its
workspace by CUDACachingAllocator::cacheInfo, tries to allocate it and halves it on
OutOfMemoryError, dropping the plans that do not fit; the heuristic mode tries plan after
plan and skips one whose workspace raises OutOfMemoryError. cuBLAS's and cuBLASLt's
workspaces are made once per handle and stream (here during a warm-up before the cap).
So with the cap at what the process holds after the warm-up plus 256 MiB (all inputs made
before the cap): conv2d forward and backward (3x3, 1x1, strided 5x5, grouped/depthwise,
conv_transpose2d), float32 with TF32 off, in both benchmark modes, agree with float64 CPU
references (max error <= 2e-3 of the reference's largest magnitude, 5e-3 for the gradients:
FFT and Winograd algorithms are less exact than direct ones); float16 channels_last conv
agrees within 2e-2; mm, addmm, bmm and baddbmm in float32 and bfloat16 agree with float64
CPU references; scaled_dot_product_attention (float16 causal, flash; float32, efficient or
math) forward and backward agree with a float32 CPU reference computed from the formula;
the whole set runs twice and memory_allocated() after the second run equals that after the
first (no workspace kept per run); with the cap lifted and the cache emptied,
memory_allocated() is within 64 MiB of its value before the capped phase (the warm-up made
the workspaces; the slack is for one made on first use that PyTorch does not promise to have
made earlier), and a 512 MiB tensor fits again. Assumed: that every op
here has a plan or algorithm whose workspace fits in the 256 MiB (implicit-GEMM convolution
needs none) and that the outputs themselves (at most 25 MiB each) fit beside it.

Why vmm may differ: vmm enforces the fraction with its own cap (device_cap.h) and answers
cacheInfo itself (the smaller of the GPU's free memory and what the cap leaves, or its
largest cached block): the workspace requests of cuDNN's search must fail with
c10::OutOfMemoryError (a different c10::Error is not caught and fails the convolution), a
failed request must leave nothing behind, and the cap's accounting (chunks mapped, not
blocks) must leave the room PyTorch's allocator leaves.
"""
import gc

import torch
import torch.nn.functional as F
from dropin_report import report

MIB = 1 << 20
HEADROOM = 256 * MIB


def rel_err(got, want):
    got = got.detach().double().cpu()
    want = want.detach().double().cpu()
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) / scale


def make_inputs():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    cpu = {
        "x": r(8, 64, 56, 56), "w3": r(64, 64, 3, 3) / 24, "w1": r(128, 64, 1, 1) / 8,
        "w5": r(96, 64, 5, 5) / 40, "wg": r(64, 1, 3, 3) / 3, "wt": r(64, 32, 4, 4) / 16,
        "a": r(1024, 1536), "b": r(1536, 768), "bias": r(768), "ba": r(16, 256, 320),
        "bb": r(16, 320, 192), "bc": r(16, 256, 192),
        "q": r(2, 8, 512, 64), "k": r(2, 8, 512, 64), "v": r(2, 8, 512, 64),
    }
    return cpu


def conv_set(x, p, dtype, channels_last=False):
    """conv2d forward and backward of every kind on x; {name: tensor}."""
    x = x.to(dtype).detach()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    ws = {k: p[k].to(dtype).detach().requires_grad_(True) for k in ("w3", "w1", "w5", "wg", "wt")}
    y3 = F.conv2d(x, ws["w3"], padding=1)
    y1 = F.conv2d(x, ws["w1"])
    y5 = F.conv2d(x, ws["w5"], stride=2, padding=2)
    yg = F.conv2d(x, ws["wg"], padding=1, groups=64)
    yt = F.conv_transpose2d(x[:, :, :28, :28], ws["wt"], stride=2, padding=1)
    # Sums, not means: the gradients stay far from float16's subnormal range.
    loss = (y3.float().square().sum() + y1.float().square().sum() + y5.float().square().sum()
            + yg.float().square().sum() + yt.float().square().sum()) / 64
    loss.backward()
    out = {"conv3x3": y3, "conv1x1": y1, "conv5x5s2": y5, "depthwise": yg, "transpose": yt,
           "dx": x.grad}
    out.update({f"d{k}": w.grad for k, w in ws.items()})
    return {k: v.detach() for k, v in out.items()}


def blas_set(p, dtype):
    a, b, bias = p["a"].to(dtype), p["b"].to(dtype), p["bias"].to(dtype)
    ba, bb, bc = p["ba"].to(dtype), p["bb"].to(dtype), p["bc"].to(dtype)
    return {"mm": a @ b, "addmm": torch.addmm(bias, a, b), "bmm": torch.bmm(ba, bb),
            "baddbmm": torch.baddbmm(bc, ba, bb, beta=0.5, alpha=2.0)}


def sdpa_set(p, dtype):
    q, k, v = (p[n].to(dtype).detach().requires_grad_(True) for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().square().sum().backward()
    return {"sdpa": out.detach(), "sdpa_dq": q.grad, "sdpa_dk": k.grad, "sdpa_dv": v.grad}


def sdpa_reference(p):
    q, k, v = (p[n].float().detach().requires_grad_(True) for n in ("q", "k", "v"))
    s = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
    mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
    out.square().sum().backward()
    return {"sdpa": out.detach(), "sdpa_dq": q.grad, "sdpa_dk": k.grad, "sdpa_dv": v.grad}


def compare(where, got, want, tol, errors):
    for name, ref in want.items():
        if name not in got:
            continue
        t = tol(name)
        e = rel_err(got[name], ref)
        if not e <= t:
            errors.append(f"{where}: {name} differs from the CPU reference by {e:.2e} of its "
                          f"largest value (allowed {t:.0e})")


def run_all(gpu, refs, where, errors):
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        tag = f"{where}, cudnn.benchmark={bench}"
        try:
            compare(tag, conv_set(gpu["x"], gpu, torch.float32), refs["conv"],
                    lambda n: 5e-3 if n.startswith("d") else 2e-3, errors)
            compare(f"{tag}, float16 channels_last",
                    conv_set(gpu["x"], gpu, torch.float16, channels_last=True), refs["conv"],
                    lambda n: 3e-2 if n.startswith("d") else 2e-2, errors)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{tag}: convolutions raised {type(e).__name__}: {str(e)[:300]}")
    torch.backends.cudnn.benchmark = False
    try:
        compare(f"{where}, float32", blas_set(gpu, torch.float32), refs["blas"],
                lambda n: 1e-4, errors)
        compare(f"{where}, bfloat16", blas_set(gpu, torch.bfloat16), refs["blas"],
                lambda n: 3e-2, errors)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{where}: matrix products raised {type(e).__name__}: {str(e)[:300]}")
    try:
        compare(f"{where}, float16", sdpa_set(gpu, torch.float16), refs["sdpa"],
                lambda n: 2e-2 if n == "sdpa" else 5e-2, errors)
        compare(f"{where}, float32", sdpa_set(gpu, torch.float32), refs["sdpa"],
                lambda n: 1e-3, errors)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{where}: scaled_dot_product_attention raised {type(e).__name__}: "
                      f"{str(e)[:300]}")
    torch.cuda.synchronize()


def settle_all():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    errors = []
    cpu = make_inputs()
    refs = {"conv": conv_set(cpu["x"], cpu, torch.float64),
            "blas": blas_set(cpu, torch.float64), "sdpa": sdpa_reference(cpu)}
    gpu = {k: v.float().cuda() for k, v in cpu.items()}

    # Warm-up without a cap, on inputs of other shapes (cuDNN's plan cache is keyed by shape,
    # so the capped runs below search again): handles, cuBLAS/cuBLASLt workspaces of this
    # thread and of the autograd engine's, kernels.
    small = dict(gpu, x=gpu["x"][:2], q=gpu["q"][:1], k=gpu["k"][:1], v=gpu["v"][:1])
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        conv_set(small["x"], small, torch.float32)
        conv_set(small["x"], small, torch.float16, channels_last=True)
    torch.backends.cudnn.benchmark = False
    blas_set(gpu, torch.float32)
    blas_set(gpu, torch.bfloat16)
    sdpa_set(small, torch.float16)
    sdpa_set(small, torch.float32)
    settle_all()
    base = torch.cuda.memory_allocated()

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = min(1.0, (torch.cuda.memory_reserved() + HEADROOM) / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        run_all(gpu, refs, "first run under the cap", errors)
        gc.collect()
        torch.cuda.synchronize()
        after1 = torch.cuda.memory_allocated()
        run_all(gpu, refs, "second run under the cap", errors)
        gc.collect()
        torch.cuda.synchronize()
        after2 = torch.cuda.memory_allocated()
        if after2 != after1:
            errors.append(f"memory_allocated() after the second capped run is {after2}, "
                          f"{after1} after the first (something kept per run)")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    settle_all()
    # Within 64 MiB: room for a library workspace made on first use under the cap (none is
    # expected after the warm-up, but PyTorch does not promise it).
    if torch.cuda.memory_allocated() > base + 64 * MIB:
        errors.append(f"with the cap lifted and the cache emptied memory_allocated() is "
                      f"{torch.cuda.memory_allocated()}, {base} before the capped runs")
    # The allocator serves a large request again once the cap is lifted.
    t = torch.empty(HEADROOM * 2, dtype=torch.uint8, device="cuda")
    t.fill_(3)
    if int(t[-1].item()) != 3:
        errors.append("a 512 MiB tensor after the cap was lifted does not hold its value")
    del t
    report(errors)


if __name__ == "__main__":
    main()
