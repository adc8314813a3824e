"""CUDA graphs that share one private memory pool: two graphs captured with
pool=g1.pool() (the second reads the first's output and may reuse memory the first freed
during its capture), and torch.cuda.make_graphed_callables over two modules trained with
backward and SGD (four graphs, forward and backward of each, in one pool).

With PyTorch's allocator (its documented rules: graphs sharing a pool are replayed in the
order they were captured): replays of g1 then g2 give the eager values for every refilled
input; after the graphs and their outputs are dropped memory_allocated() is back at the
baseline; six training steps through the graphed modules give the same losses and weights as
the same steps run eagerly on copies of the modules.

Why vmm may differ: a capture routes allocations to a vmm private pool named by the graph's
MempoolId (beginAllocateToPool), used by several graphs at once (a use count), whose blocks
freed during one capture are handed to the next and kept mapped while any graph lives.
"""
import copy
import gc

import torch
from dropin_report import report


def main():
    torch.manual_seed(0)
    errors = []
    x = torch.zeros(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture, as PyTorch's docs ask
        ((x * 2 + 1) * 3 - x).sum()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        tmp = x * 2
        a = tmp + 1
        del tmp
    with torch.cuda.graph(g2, pool=g1.pool()):
        b = a * 3
        c = b - x
    for v in (1.0, -2.0, 0.5):
        x.fill_(v)
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        want = (2 * v + 1, 3 * (2 * v + 1), 3 * (2 * v + 1) - v)
        for name, t, w in zip("abc", (a, b, c), want):
            wrong = t[t != w]
            if wrong.numel():
                errors.append(f"input {v}: after replays of g1 and g2 (one pool) {wrong.numel()} "
                              f"elements of {name} are not {w} (e.g. {float(wrong[0].item())})")
    del g1, g2, a, b, c, t, wrong
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after the shared-pool graphs went: memory_allocated "
                      f"{torch.cuda.memory_allocated()} != {base}")

    m1 = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU()).cuda()
    m2 = torch.nn.Linear(128, 32).cuda()
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    sx = torch.randn(16, 64, device="cuda")
    sh = torch.randn(16, 128, device="cuda", requires_grad=True)
    g1m, g2m = torch.cuda.make_graphed_callables((m1, m2), ((sx,), (sh,)))
    opt = torch.optim.SGD(list(m1.parameters()) + list(m2.parameters()), lr=0.1)
    ropt = torch.optim.SGD(list(r1.parameters()) + list(r2.parameters()), lr=0.1)
    data = [(torch.randn(16, 64, device="cuda"), torch.randn(16, 32, device="cuda"))
            for _ in range(6)]
    for step, (inp, target) in enumerate(data):
        losses = []
        for f1, f2, o in ((g1m, g2m, opt), (r1, r2, ropt)):
            o.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(f2(f1(inp)), target)
            loss.backward()
            o.step()
            losses.append(float(loss.item()))
        if abs(losses[0] - losses[1]) > 1e-3 * max(1.0, abs(losses[1])):
            errors.append(f"step {step}: graphed loss {losses[0]}, eager loss {losses[1]}")
    for p, q in zip(list(m1.parameters()) + list(m2.parameters()),
                    list(r1.parameters()) + list(r2.parameters())):
        if not torch.allclose(p, q, rtol=1e-3, atol=1e-4):
            errors.append(f"after 6 steps a graphed weight differs from eager by "
                          f"{float((p - q).abs().max().item())}")
            break
    report(errors)


if __name__ == "__main__":
    main()
