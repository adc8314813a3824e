"""torch.compile in its default mode (Inductor's generated Triton kernels and aten calls, no
CUDA graphs) training a small model for a few steps with a batch size that changes every
step (dynamic shapes, the batch dimension marked dynamic), and a compiled function called on
inputs of changing length: what most compiled training and inference code runs.

The compiled code allocates its buffers through the CUDA allocator (empty_strided_cuda in
Inductor's wrapper, freed by `del` as soon as the last kernel reading them is queued and
reused by size), Triton's launcher checks every pointer argument with cuPointerGetAttribute,
and the compile workers are subprocesses that import torch (with VMM_TORCH_ENABLE set, vmm
is enabled in them too).

With PyTorch's allocator: 8 SGD steps over batch sizes 8, 24, 13, 64, 40, 7, 33, 64 give the
losses of an eager copy of the model within 1e-3 (relative) and weights within 1e-4; the
compiled function matches eager on lengths 1000 to 3,000,000; at the end, with the compiled
code dropped, memory_allocated() is back at its baseline (up to 64 MiB a library handle's
workspace may keep).

Why vmm may differ: every buffer of Inductor's code is a vmm block handed out and freed in
quick succession by size (dynamic shapes give new sizes each step), Triton must accept vmm's
pointers, and vmm's enabling runs in every compile worker, which must neither fail nor hang
at its start or exit.
"""
import copy

import torch
import torch._dynamo
from dropin_report import baseline, compile_ready, compile_unavailable, memory_back, report, settle

BATCHES = (8, 24, 13, 64, 40, 7, 33, 64)
LENGTHS = (1000, 4097, 123_457, 3_000_000)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.norm = torch.nn.LayerNorm(256)
        self.fc2 = torch.nn.Linear(256, 16)

    def forward(self, x):
        return self.fc2(self.norm(torch.nn.functional.gelu(self.fc1(x))))


def fused(x, y):
    return torch.softmax(x * 2.0 + y.sin(), dim=0) * 1000.0 + (x - y).abs().mean()


def batch(step, n):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 64, generator=g), torch.randn(n, 16, generator=g)


def main():
    errors = []
    if not compile_ready(Net().cuda(), *(t.cuda() for t in batch(99, 16))):
        return
    base, res0, _ = baseline()

    torch.manual_seed(0)
    model = Net().cuda()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05)
    try:
        for step, n in enumerate(BATCHES):
            x, y = batch(step, n)
            x, y = x.cuda(), y.cuda()
            torch._dynamo.mark_dynamic(x, 0)
            loss = torch.nn.functional.mse_loss(compiled(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            want = torch.nn.functional.mse_loss(eager(x), y)
            eager_opt.zero_grad(set_to_none=True)
            want.backward()
            eager_opt.step()
            a, b = float(loss.item()), float(want.item())
            if abs(a - b) > 1e-3 * max(1e-3, abs(b)):
                errors.append(f"step {step} (batch {n}): compiled loss {a}, eager {b}")
                break
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if not torch.allclose(p, q, rtol=1e-3, atol=1e-4):
                errors.append(f"after {len(BATCHES)} steps {name} differs from eager")
                break

        cfused = torch.compile(fused, dynamic=True)
        for n in LENGTHS:
            g = torch.Generator(device="cuda").manual_seed(n)
            x = torch.randn(n, device="cuda", generator=g)
            y = torch.randn(n, device="cuda", generator=g)
            got, want = cfused(x, y), fused(x, y)
            if not torch.allclose(got, want, rtol=1e-3, atol=1e-5):
                errors.append(f"the compiled function differs from eager at length {n}")
                break
    except Exception as e:  # noqa: BLE001
        if compile_unavailable(e):
            return
        errors.append(f"torch.compile: {type(e).__name__}: {str(e)[:400]}")

    del model, eager, compiled, opt, eager_opt
    torch._dynamo.reset()
    settle()
    alloc = torch.cuda.memory_allocated()
    if alloc > base:
        # What compiled code may keep beyond its tensors (a workspace of a library handle) is
        # not a leak of tensors: reported only past 64 MiB.
        if alloc - base > 64 << 20:
            errors.append(f"memory_allocated() is {alloc - base} bytes above its baseline "
                          f"after training and dropping the compiled model")
    else:
        memory_back(errors, base, res0, "after dropping the compiled model")
    report(errors)


if __name__ == "__main__":
    main()
