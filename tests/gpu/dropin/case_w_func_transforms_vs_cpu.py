"""Function transforms on the GPU, as per-sample-gradient (DP-SGD), meta-learning, PINN and
Gauss-Newton code uses them: torch.func.vmap(grad(...)) over a batch with
functional_call, jacrev and jacfwd of a small network, torch.func.hessian,
vmap with chunk_size, vjp / jvp, and torch.autograd.functional.hessian and jacobian (with
vectorize=True and without), each in float64 on the GPU and on the CPU from the same inputs.

With PyTorch's allocator every result on the GPU equals the CPU's within 1e-8 relative (the
same float64 arithmetic; only the order of sums differs), across 6 repetitions with
different batch sizes, while these transforms make thousands of small and batched
temporaries (batched gradients, per-column vjps, the vectorized hessian's expanded basis)
and the autograd engine's device thread frees many of them.

Why vmm may differ: many small blocks of many sizes allocated and freed from two threads
(the caller and autograd's device thread) in quick succession; a block handed out twice or
reused too early gives a result that differs from the CPU's.
"""
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from dropin_report import report

D_IN, H, D_OUT = 13, 32, 5


def make_model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.Tanh(),
                                torch.nn.Linear(H, H), torch.nn.Tanh(),
                                torch.nn.Linear(H, D_OUT))
    return model.double().to(device)


def results(device, batch, seed):
    """Every transform's result for one batch, as a dict of CPU tensors."""
    model = make_model(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, D_IN, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(batch, D_OUT, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(D_IN, generator=g, dtype=torch.float64).to(device)
    out = {}

    def loss_one(p, xi, yi):
        pred = functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0)
        return ((pred - yi) ** 2).sum()

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    for k, t in per_sample.items():
        out[f"per_sample_grad.{k}"] = t
    chunked = vmap(grad(loss_one), in_dims=(None, 0, 0), chunk_size=7)(params, x, y)
    for k, t in chunked.items():
        out[f"per_sample_grad_chunked.{k}"] = t

    def f(xi):
        return functional_call(model, params, (xi.unsqueeze(0),)).squeeze(0)

    out["jacrev"] = vmap(jacrev(f))(x)
    out["jacfwd"] = vmap(jacfwd(f))(x)

    def scalar(xi):
        return f(xi).tanh().sum()

    out["hessian"] = vmap(hessian(scalar))(x[:8])
    out["jacfwd_jacrev"] = jacfwd(jacrev(scalar))(x[0])
    primal, tangent = jvp(f, (x[0],), (v,))
    out["jvp.primal"], out["jvp.tangent"] = primal, tangent
    _, pullback = vjp(f, x[1])
    out["vjp"] = pullback(torch.ones(D_OUT, dtype=torch.float64, device=device))[0]
    out["autograd.hessian.vectorized"] = torch.autograd.functional.hessian(
        scalar, x[2], vectorize=True)
    out["autograd.hessian.loop"] = torch.autograd.functional.hessian(scalar, x[3])
    out["autograd.jacobian.forward"] = torch.autograd.functional.jacobian(
        f, x[4], vectorize=True, strategy="forward-mode")
    out["autograd.jacobian.loop"] = torch.autograd.functional.jacobian(f, x[5])
    # A loss whose gradient needs a double backward through the batch (a gradient penalty).
    xg = x.clone().requires_grad_(True)
    pred = model(xg)
    (gx,) = torch.autograd.grad(pred.square().sum(), xg, create_graph=True)
    penalty = gx.square().sum()
    out["grad_penalty.params"] = torch.cat([p.flatten() for p in torch.autograd.grad(
        penalty, list(model.parameters()))])
    return {k: t.detach().cpu() for k, t in out.items()}


def main():
    torch.backends.cuda.matmul.allow_tf32 = False  # float64 anyway; kept explicit
    errors = []
    for rep, batch in enumerate((16, 37, 64, 9, 128, 50)):
        try:
            gpu = results("cuda", batch, 100 + rep)
        except Exception as e:  # noqa: BLE001
            errors.append(f"repetition {rep} (batch {batch}) on the GPU: {type(e).__name__}: "
                          f"{str(e)[:300]}")
            continue
        cpu = results("cpu", batch, 100 + rep)
        for k, want in cpu.items():
            got = gpu.get(k)
            if got is None or got.shape != want.shape:
                errors.append(f"rep {rep}: {k}: shape {None if got is None else got.shape}, "
                              f"the CPU's {want.shape}")
            elif not torch.allclose(got, want, rtol=1e-8, atol=1e-10):
                diff = float((got - want).abs().max())
                errors.append(f"rep {rep} (batch {batch}): {k} differs from the CPU's by up to "
                              f"{diff}")
        if len(errors) > 10:
            break
    report(errors[:12])


if __name__ == "__main__":
    main()
