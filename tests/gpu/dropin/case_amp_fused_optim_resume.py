"""A mixed-precision training loop that checkpoints and resumes: float16 autocast with
torch.amp.GradScaler, unscale_ + clip_grad_norm_, AdamW in its three implementations
(for-loop, foreach, fused=True), an overflow that makes the scaler skip a step, a deepcopy of
the model kept as a snapshot, and a checkpoint (model, optimizer and scaler state_dicts)
saved with torch.save to memory, everything dropped, and training resumed in a new model.

With PyTorch's allocator, for each implementation: the step whose gradient was set to inf
leaves every parameter unchanged and halves the scale; 10 steps run straight through and the
same 10 steps run as 5, a checkpoint round trip into a differently initialised model and 5
more give the same losses and final parameters (within 1e-4: the same kernels on the same
inputs); the deepcopy made at the checkpoint shares no memory with the model and is still
equal to the checkpointed weights at the end; and once every model, optimizer, scaler and
checkpoint is dropped, memory_allocated() is back at its value after a warm-up run.

Why vmm may differ: the foreach and fused optimizers, the scaler's
_amp_foreach_non_finite_check_and_unscale_ and the foreach norms of clip_grad_norm_
allocate lists of outputs of many sizes at once, autocast keeps a cache of float16 weight
copies for the step, torch.load allocates every tensor of the checkpoint anew while the old
ones are being freed: a block handed out twice or a free lost shows as a diverging resume or
memory not coming back.
"""
import copy
import gc
import io

import torch
import torch.nn.functional as F
from dropin_report import report

STEPS, SAVE_AT, INF_AT = 10, 5, 3
IMPLS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def build(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
        torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()


def make(model, impl):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **IMPLS[impl])
    return opt, torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=4)


def step(model, opt, scaler, data, i):
    xs, ys = data
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.mse_loss(model(xs[i]).float(), ys[i])
    scaler.scale(loss).backward()
    if i == INF_AT:
        model[0].weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return float(loss.item())


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def run(impl, data, errors):
    model = build()
    opt, scaler = make(model, impl)
    straight = []
    for i in range(STEPS):
        before, scale = (params(model), scaler.get_scale()) if i == INF_AT else (None, None)
        straight.append(step(model, opt, scaler, data, i))
        if before is not None:
            if not all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
                errors.append(f"{impl}: the step with an inf gradient changed parameters")
            if scaler.get_scale() != scale * 0.5:
                errors.append(f"{impl}: the scale went {scale} -> {scaler.get_scale()} at "
                              f"the step with an inf gradient")
    final = params(model)
    del model, opt, scaler

    model = build()
    opt, scaler = make(model, impl)
    resumed = [step(model, opt, scaler, data, i) for i in range(SAVE_AT)]
    snapshot = copy.deepcopy(model)
    saved = params(model)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, buf)
    del model, opt, scaler
    gc.collect()
    model = build(seed=7)
    opt, scaler = make(model, impl)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    scaler.load_state_dict(ckpt["scaler"])
    del ckpt, buf
    resumed += [step(model, opt, scaler, data, i) for i in range(SAVE_AT, STEPS)]
    for i, (a, b) in enumerate(zip(straight, resumed)):
        if abs(a - b) > 1e-4 * abs(a) + 1e-6:
            errors.append(f"{impl}: step {i} loss {b} after resuming, {a} straight through")
            break
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(final,
                                                                          model.parameters())):
        errors.append(f"{impl}: the resumed run's parameters differ from the straight run's")
    ptrs = {p.data_ptr() for p in model.parameters()}
    if any(p.data_ptr() in ptrs for p in snapshot.parameters()):
        errors.append(f"{impl}: the deepcopy shares memory with the model")
    if not all(torch.equal(a, b) for a, b in zip(saved, snapshot.parameters())):
        errors.append(f"{impl}: the deepcopy changed while the model trained on")


def main():
    errors = []
    gen = torch.Generator().manual_seed(1)
    data = (torch.randn(STEPS, 128, 256, generator=gen).cuda(),
            torch.randn(STEPS, 128, 64, generator=gen).cuda())
    warm = build()
    wopt, wscaler = make(warm, "fused")
    for i in range(2):
        step(warm, wopt, wscaler, data, i)
    del warm, wopt, wscaler
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for impl in IMPLS:
        try:
            run(impl, data, errors)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{impl}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        gc.collect()
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() != base:
            errors.append(f"after the {impl} runs memory_allocated() is "
                          f"{torch.cuda.memory_allocated()}, was {base} after a warm-up run")
    report(errors)


if __name__ == "__main__":
    main()
