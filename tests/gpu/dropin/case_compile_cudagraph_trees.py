"""torch.compile with CUDA graph trees (backend="cudagraphs": dynamo and AOT autograd with
PyTorch's cudagraph trees, as mode="reduce-overhead" uses them, without compiling kernels).

With PyTorch's allocator: two compiled functions chained (f2 reads f1's output) are warmed
up, recorded and replayed; then a third compiled function is first called on f1's output
after replays, with f2's output already dropped, which makes the tree restore a checkpoint of
its private pool (setCheckpointPoolState) with one dead output, and is recorded and replayed
in the next steps; every output equals the eager result. Six training steps of a compiled
MLP (cudagraph_mark_step_begin, backward, SGD) give the same losses and weights as eager.

Why vmm may differ: graph trees use the allocator's private pools, checkPoolLiveAllocations,
getCheckpointState and setCheckpointPoolState, which vmm implements itself (vmm_pool_alloc_at
restores blocks at their addresses; raw_delete frees restored blocks).
"""
import copy

import torch
from dropin_report import report

torch.manual_seed(0)
W = torch.randn(256, 256, device="cuda") / 16


def f1(x):
    return torch.tanh(x @ W) + 1.0


def f2(a):
    return a * 2.0 - 3.0


def f3(a):
    return a.sum(dim=1, keepdim=True) * a


def close(x, y):
    return torch.allclose(x, y, rtol=1e-4, atol=1e-4)


def main():
    errors = []
    c1, c2, c3 = (torch.compile(f, backend="cudagraphs") for f in (f1, f2, f3))
    xs = [torch.randn(64, 256, device="cuda") for _ in range(7)]
    for i, x in enumerate(xs):
        torch.compiler.cudagraph_mark_step_begin()
        a = c1(x)
        b = c2(a)
        ea = f1(x)
        if not close(a, ea) or not close(b, f2(ea)):
            errors.append(f"step {i}: compiled f1/f2 differ from eager")
        if i >= 3:
            del b  # dead when c3 first runs on the replayed path
            if not close(c3(a), f3(ea)):
                errors.append(f"step {i}: compiled f3 (after a checkpoint) differs from eager")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64)).cuda()
    ref = copy.deepcopy(model)
    cm = torch.compile(model, backend="cudagraphs")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    data = [(torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda"))
            for _ in range(6)]
    for step, (x, y) in enumerate(data):
        losses = []
        for m, o in ((cm, opt), (ref, ropt)):
            torch.compiler.cudagraph_mark_step_begin()
            o.zero_grad(set_to_none=True)
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            o.step()
            losses.append(float(loss.item()))
        if abs(losses[0] - losses[1]) > 1e-3 * max(1.0, abs(losses[1])):
            errors.append(f"training step {step}: compiled loss {losses[0]}, eager {losses[1]}")
    for p, q in zip(model.parameters(), ref.parameters()):
        if not torch.allclose(p, q, rtol=1e-3, atol=1e-4):
            errors.append(f"after 6 steps a compiled weight differs from eager by "
                          f"{float((p - q).abs().max().item())}")
            break
    from torch._dynamo.utils import counters
    print(f"cudagraph skips: {counters['inductor']['cudagraph_skips']} (0: graphs were used)")
    report(errors)


if __name__ == "__main__":
    main()
