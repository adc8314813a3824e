"""Whole-network capture, as PyTorch's CUDA semantics notes show it: forward, loss, backward
and a capturable Adam step (torch.optim.Adam(capturable=True)) captured in one CUDA graph
after warm-up iterations on a side stream, then trained by refilling static inputs and
replaying; between replays the eager program allocates and empties the cache; then the graph
is dropped and training goes on eagerly with the gradients the capture allocated.

With PyTorch's allocator the gradients (set to None before the capture) are allocated in the
graph's private pool, with every temporary of forward, backward (autograd's device thread,
on the capture stream) and the optimizer's foreach ops; eager tensors filled with 7 and
empty_cache() between replays touch none of it. So the loss of each replay and the
parameters after the replays equal those of an eager copy of the model trained step by step
on the same batches with the same optimizer (within 1e-4), the eager tensors stay 7; after
`del graph` the gradients still live in the pool's memory, keep their data_ptr through
zero_grad(set_to_none=False), accumulate three more eager steps that again match the copy;
once the gradients are set to None and the outputs dropped, memory_allocated() is back at
its value before the capture and empty_cache() brings memory_reserved() back too.

Why vmm may differ: the capture routes to a vmm private pool by a filter on the capture
stream (beginAllocateToPool), reached from two threads; that pool must keep its blocks
mapped through empty_cache() while the graph lives, keep the blocks still live (the
gradients) after releasePool, and give everything back once they are freed.
"""
import copy

import torch
from dropin_report import memory_back, report, settle

N, D_IN, H, D_OUT = 256, 512, 1024, 128
WARMUP, REPLAYS, AFTER = 3, 8, 3
STEPS = WARMUP + REPLAYS + AFTER
loss_fn = torch.nn.MSELoss()


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, H), torch.nn.ReLU(), torch.nn.Linear(H, H), torch.nn.ReLU(),
        torch.nn.Linear(H, D_OUT)).cuda()


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-3, capturable=True)


def eager_step(model, opt, x, y, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.item())


def main():
    errors = []
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, N, D_IN, generator=gen).cuda()
    ys = torch.randn(STEPS, N, D_OUT, generator=gen).cuda()
    model_g = build()
    model_e = copy.deepcopy(model_g)
    opt_g, opt_e = adam(model_g), adam(model_e)
    static_x, static_y = xs[0].clone(), ys[0].clone()
    side = torch.cuda.Stream()

    def same_loss(i, got, want):
        if abs(got - want) > 1e-4 * abs(want) + 1e-6:
            errors.append(f"step {i}: loss {got}, the eager copy's {want}")

    def same_params(when):
        for (name, p), q in zip(model_g.named_parameters(), model_e.parameters()):
            if not torch.allclose(p, q, rtol=1e-4, atol=1e-5):
                errors.append(f"{when}: parameter {name} differs from the eager copy's")

    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = []
        for i in range(WARMUP):
            static_x.copy_(xs[i])
            static_y.copy_(ys[i])
            warm.append(eager_step(model_g, opt_g, static_x, static_y))
        g0 = torch.cuda.CUDAGraph()  # a first capture on this stream, dropped again
        with torch.cuda.graph(g0, stream=side):
            tmp = static_x * 2
        g0.replay()
    torch.cuda.current_stream().wait_stream(side)
    del g0, tmp
    for i in range(WARMUP):
        same_loss(i, warm[i], eager_step(model_e, opt_e, xs[i], ys[i]))
    opt_g.zero_grad(set_to_none=True)
    opt_e.zero_grad(set_to_none=True)
    settle()
    alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_loss = loss_fn(model_g(static_x), static_y)
        static_loss.backward()
        opt_g.step()
    grad_ptrs = [p.grad.data_ptr() for p in model_g.parameters()]
    keep = []
    for i in range(WARMUP, WARMUP + REPLAYS):
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        graph.replay()
        same_loss(i, float(static_loss.item()), eager_step(model_e, opt_e, xs[i], ys[i]))
        fresh = [torch.full((1024 << (k % 14),), 7.0, device="cuda") for k in range(i, i + 14)]
        keep = (keep + fresh[::5])[-6:]
        del fresh
        if i % 2:
            torch.cuda.empty_cache()
        if any(bool((k != 7).any()) for k in keep):
            errors.append(f"replay {i}: an eager tensor filled with 7 changed")
    same_params("after the replays")

    del graph
    for i in range(WARMUP + REPLAYS, STEPS):
        got = eager_step(model_g, opt_g, xs[i], ys[i], set_to_none=False)
        same_loss(i, got, eager_step(model_e, opt_e, xs[i], ys[i], set_to_none=False))
        torch.cuda.empty_cache()
        keep = [torch.full((3 << 20,), 7.0, device="cuda") for _ in range(4)]
    if [p.grad.data_ptr() for p in model_g.parameters()] != grad_ptrs:
        errors.append("the gradients the capture allocated moved after the graph was dropped")
    same_params("after eager steps with the graph's gradients")

    opt_g.zero_grad(set_to_none=True)
    opt_e.zero_grad(set_to_none=True)
    del static_loss, keep
    settle()
    memory_back(errors, alloc0, res0, "with the graph and its tensors gone")
    report(errors)


if __name__ == "__main__":
    main()
