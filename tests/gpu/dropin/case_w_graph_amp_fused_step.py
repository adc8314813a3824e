"""A whole mixed-precision training step captured in one CUDA graph: float16 autocast
forward, loss, torch.amp.GradScaler's scale(loss).backward(), scaler.step(optimizer) and
scaler.update(), with the two fused optimizers GradScaler hands the inf check to
(AdamW(fused=True, capturable=True) and SGD(fused=True, momentum=0.9)), as training code
that captures its step to cut launch overhead writes it; one replay gets an input that
overflows float16, so the scaler must skip that step inside the graph.

With PyTorch's allocator (its test_graph_scaling_fused_optimizers captures scaler.step and
update of the fused optimizers; the whole-network example of the CUDA semantics notes
captures forward, backward and step): the gradients (None before the capture), the
scaler's found_inf and inverse-scale temporaries, the fused optimizer's step counters'
arithmetic and every activation live in the graph's private pool; each replay gives the
loss, the scale and the parameters that an eager copy (same seed, same optimizer, same
scaler) gets on the same batches (within 1e-3: the same kernels on the same inputs); the
overflowing step leaves every parameter as it was and halves the scale in both; eager
tensors filled between replays keep their values.

Why vmm may differ: the capture's allocations (forward on the capture stream, backward on
autograd's device thread, the scaler's and fused optimizer's tensors) route to a vmm
private pool; a block of that pool handed to an eager tensor, or an eager block handed to
the capture, shows as a loss, scale or parameter that differs from the eager copy.
"""
import copy
import math

import torch
from dropin_report import report

N, D_IN, H, D_OUT = 256, 512, 1024, 128
WARMUP, REPLAYS = 3, 8
INF_AT = WARMUP + 3  # the step whose input overflows float16
STEPS = WARMUP + REPLAYS


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, H), torch.nn.ReLU(), torch.nn.Linear(H, H), torch.nn.ReLU(),
        torch.nn.Linear(H, D_OUT)).cuda()


OPTIMIZERS = {
    "AdamW(fused, capturable)": lambda ps: torch.optim.AdamW(
        ps, lr=1e-3, eps=1e-3, weight_decay=1e-2, fused=True, capturable=True),
    "SGD(fused, momentum)": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


def step_body(model, scaler, opt, x, y):
    """Forward, scaled backward, scaler step and update; returns the (unscaled) loss tensor."""
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def batches():
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, N, D_IN, generator=gen)
    ys = torch.randn(STEPS, N, D_OUT, generator=gen)
    xs[INF_AT] *= 1e6  # float16 overflows: inf activations, a non-finite loss and gradients
    return xs.cuda(), ys.cuda()


def close(a, b):
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isfinite(a) == math.isfinite(b)
    return abs(a - b) <= 1e-3 * abs(b) + 1e-6


def run(name, make_opt, errors):
    xs, ys = batches()
    model_g = build()
    model_e = copy.deepcopy(model_g)
    opt_g, opt_e = make_opt(model_g.parameters()), make_opt(model_e.parameters())
    scaler_g = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=2)
    scaler_e = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=2)
    static_x, static_y = xs[0].clone(), ys[0].clone()
    side = torch.cuda.Stream()

    def eager(i):
        opt_e.zero_grad(set_to_none=True)
        loss = float(step_body(model_e, scaler_e, opt_e, xs[i], ys[i]).item())
        return loss, scaler_e.get_scale()

    # Warm-up (eager, on a side stream, as PyTorch asks before a capture): creates the
    # optimizer states, the scaler's scale and growth tracker and the fused SGD's momentum.
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = []
        for i in range(WARMUP):
            static_x.copy_(xs[i])
            static_y.copy_(ys[i])
            opt_g.zero_grad(set_to_none=True)
            warm.append(float(step_body(model_g, scaler_g, opt_g, static_x, static_y).item()))
    torch.cuda.current_stream().wait_stream(side)
    for i in range(WARMUP):
        want, _ = eager(i)
        if not close(warm[i], want):
            errors.append(f"{name}: warm-up step {i}: loss {warm[i]}, the eager copy's {want}")
    opt_g.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_loss = step_body(model_g, scaler_g, opt_g, static_x, static_y)
    keep = []
    for i in range(WARMUP, STEPS):
        before = [p.detach().clone() for p in model_g.parameters()]
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        graph.replay()
        got_loss = float(static_loss.item())
        got_scale = scaler_g.get_scale()
        want_loss, want_scale = eager(i)
        if not close(got_loss, want_loss):
            errors.append(f"{name}: replay {i}: loss {got_loss}, the eager copy's {want_loss}")
        if got_scale != want_scale:
            errors.append(f"{name}: replay {i}: scale {got_scale}, the eager copy's {want_scale}")
        if i == INF_AT:
            if math.isfinite(got_loss):
                errors.append(f"{name}: the overflowing step gave a finite loss {got_loss}")
            moved = [k for k, (p, q) in enumerate(zip(model_g.parameters(), before))
                     if not torch.equal(p, q)]
            if moved:
                errors.append(f"{name}: the overflowing replay changed parameters {moved} "
                              f"(the scaler should have skipped the step)")
        for k, (p, q) in enumerate(zip(model_g.parameters(), model_e.parameters())):
            if not torch.allclose(p, q, rtol=1e-3, atol=1e-4):
                diff = float((p - q).abs().max().item())
                errors.append(f"{name}: after replay {i} parameter {k} differs from the eager "
                              f"copy's by up to {diff}")
                break
        fresh = [torch.full((4096 << (k % 10),), 7.0, device="cuda") for k in range(i, i + 10)]
        keep = (keep + fresh[::3])[-6:]
        del fresh, before
        if any(bool((t != 7).any()) for t in keep):
            errors.append(f"{name}: replay {i}: an eager tensor filled with 7 changed")
    moved_total = sum(float((p - q).abs().sum().item())
                      for p, q in zip(model_g.parameters(), build().parameters()))
    if moved_total == 0:
        errors.append(f"{name}: the replays never changed the parameters")
    del graph, static_loss, keep
    torch.cuda.synchronize()


def main():
    errors = []
    for name, make_opt in OPTIMIZERS.items():
        n = len(errors)
        try:
            run(name, make_opt, errors)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
        del errors[n + 6:]  # a few lines per optimizer are enough
    report(errors)


if __name__ == "__main__":
    main()
