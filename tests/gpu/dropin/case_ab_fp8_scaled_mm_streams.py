"""float8 matrix products (torch._scaled_mm: cuBLASLt's FP8 kernels, as torchao's float8
training and the FP8 linear layers of serving engines call them) run at once on four streams,
two of them of high priority, beside bfloat16 matmuls, over three rounds, then again after
the cuBLAS workspaces are cleared.

With PyTorch's allocator: e4m3 x e4m3 and e5m2 x e4m3 products with tensorwise scales, with
a bfloat16 output and bias and with a float32 output, equal the product of the dequantized
operands computed in float64 on the CPU (within bfloat16 rounding), on every stream and in
every round; the second and third rounds end with the same memory_allocated() (each stream's
workspace is made once); torch._C._cuda_clearCublasWorkspaces() does not raise it and a
round after it is right; float8 tensors round-trip bit for bit through uint8 views and
bfloat16. (Skipped where the GPU or torch has no FP8: compute capability below 8.9.)

Why vmm may differ: each stream's first cuBLASLt call takes a workspace from the allocator on
that stream (kept per handle and stream), and the products are queued behind GPU sleeps so
that the four streams allocate, compute and free at the same time.
"""

import torch
from dropin_report import check_level, level, report

M, K, N = 256, 512, 384


def quant(x, dtype):
    scale = (x.abs().max() / torch.finfo(dtype).max).float()
    return (x / scale).to(dtype), scale


def rel(got, want):
    got = got.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max())


def one_round(cases, streams, mats, errors, tag):
    outs = []
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            torch.cuda._sleep(10_000_000)
            for a8, sa, b8, sb, ref, bias in cases:
                o1 = torch._scaled_mm(a8, b8.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16)
                o2 = torch._scaled_mm(a8, b8.t(), sa, sb, out_dtype=torch.float32)
                o1, o2 = (o[0] if isinstance(o, tuple) else o for o in (o1, o2))
                outs.append((o1, ref + bias.double().cpu(), o2, ref))
            outs.append((mats[0] @ mats[1].t(), mats[2], None, None))
    for st in streams:
        torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    for i, (o1, want1, o2, want2) in enumerate(outs):
        if rel(o1, want1) > 1.5e-2:
            errors.append(f"{tag}: result {i} (bfloat16) is off by {rel(o1, want1):.3g}")
        if o2 is not None and rel(o2, want2) > 1e-3:
            errors.append(f"{tag}: result {i} (float32 output) is off by {rel(o2, want2):.3g}")


def main():
    errors = []
    torch.empty(1, device="cuda")
    if (torch.cuda.get_device_capability() < (8, 9) or not hasattr(torch, "float8_e4m3fn")
            or not hasattr(torch, "_scaled_mm")):
        print("no FP8 matrix products on this GPU or torch; nothing checked")
        report(errors)
        return
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g).cuda().bfloat16()
    cases = []
    for adt in (e4, e5):
        a8, sa = quant(A.cuda(), adt)
        b8, sb = quant(B.cuda(), e4)
        ref = (a8.float().double().cpu() * sa.item()) @ (b8.float().double().cpu() * sb.item()).T
        cases.append((a8, sa, b8, sb, ref, bias))
    mats = (A.cuda().bfloat16(), B.cuda().bfloat16(), A.double() @ B.double().T)
    streams = [torch.cuda.Stream(), torch.cuda.Stream(priority=-1), torch.cuda.Stream(),
               torch.cuda.Stream(priority=-1)]
    after = []
    for r in range(3):
        one_round(cases, streams, mats, errors, f"round {r}")
        after.append(level())
    check_level(after, errors)
    torch._C._cuda_clearCublasWorkspaces()
    cleared = level()
    if cleared > after[2]:
        errors.append(f"clearing the cuBLAS workspaces raised memory_allocated() from "
                      f"{after[2]} to {cleared}")
    one_round(cases, streams, mats, errors, "after the workspaces were cleared")
    for a8, *_ in cases:
        bits = a8.view(torch.uint8)
        back = bits.view(a8.dtype).to(torch.bfloat16).to(a8.dtype).view(torch.uint8)
        if not torch.equal(bits, back):
            errors.append(f"{a8.dtype} does not round-trip through uint8 and bfloat16")
    report(errors)


if __name__ == "__main__":
    main()
