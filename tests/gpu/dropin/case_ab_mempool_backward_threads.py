"""Which allocations torch.cuda.use_mem_pool routes when other threads allocate: a forward and
backward pass run inside the context (the autograd engine computes CUDA gradients on a device
thread of its own), torch.autograd.grad inside it, a tensor hook that opens a context of
another pool in the engine's thread, a thread started inside the context, and two threads
each inside a context of their own pool at the same time while the main thread allocates.

PyTorch documents the rule (use_mem_pool: "only current thread's allocations route to the
given pool ... (e.g. by calling backward) the allocations in that thread will not route");
what it does in each case is not written here: each group of probes runs in a fresh process
with PyTorch's allocator and in one with this program's environment, and the outcomes
(which pool each tensor lies in, use counts, values) must agree.

Why vmm may differ: vmm keeps the open routes in a list and asks each route's filter, newest
first, from the allocating thread; the filters of two threads' contexts and of the engine's
thread must each take only their own thread's allocations.
"""
import threading

from outcome_compare import named_groups_against_native


def in_pool(pool, t):
    p = t.data_ptr()
    return any(s["address"] <= p < s["address"] + s["total_size"] for s in pool.snapshot())


def autograd(torch, rec):
    from torch.cuda import MemPool, use_mem_pool
    torch.manual_seed(0)
    L = torch.nn.Linear
    model = torch.nn.Sequential(L(512, 512), torch.nn.GELU(), L(512, 512), torch.nn.GELU(),
                                L(512, 64)).cuda()
    x = torch.randn(256, 512, device="cuda")
    model(x).square().mean().backward()  # warm-up: cuBLAS workspaces of both threads
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    pool, side = MemPool(), MemPool()
    box = {"main": threading.get_ident()}

    def hook(grad):
        box["hook thread"] = threading.get_ident()
        try:
            with use_mem_pool(side):
                box["in hook"] = torch.full((1 << 18,), 2.0, device="cuda")
            box["after hook ctx"] = torch.full((1 << 18,), 3.0, device="cuda")
        except Exception as e:  # noqa: BLE001  (compared with PyTorch's allocator's)
            box["hook error"] = type(e).__name__
        return grad

    def spawned():
        box["thread"] = torch.full((1 << 18,), 4.0, device="cuda")
    with use_mem_pool(pool):
        h = model[0](x)
        h.register_hook(hook)
        out = model[1:](h)
        loss = out.square().mean()
        loss.backward()
        xg = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(xg).sum(), xg)
        th = threading.Thread(target=spawned)
        th.start()
        th.join()
        inside_count = pool.use_count()
    after = torch.empty(1 << 18, device="cuda")
    torch.cuda.synchronize()
    grads = [p.grad for p in model.parameters()]
    rec("[forward output, loss, clone of x] in the pool",
        lambda: [in_pool(pool, out), in_pool(pool, loss), in_pool(pool, xg)])
    rec("parameter gradients in the pool", lambda: [in_pool(pool, g) for g in grads])
    rec("torch.autograd.grad's result in the pool", lambda: in_pool(pool, gx))
    rec("the hook ran in another thread, [error]",
        lambda: [box.get("hook thread") != box["main"], box.get("hook error")])
    rec("hook's tensor made in its own context: [in side pool, in pool]",
        lambda: [in_pool(side, box["in hook"]), in_pool(pool, box["in hook"])])
    rec("hook's tensor after its context: [in side pool, in pool]",
        lambda: [in_pool(side, box["after hook ctx"]), in_pool(pool, box["after hook ctx"])])
    rec("a thread started in the context: its tensor in the pool",
        lambda: in_pool(pool, box["thread"]))
    rec("[use_count inside, after, side's after]",
        lambda: [inside_count, pool.use_count(), side.use_count()])
    rec("a tensor after the context in the pool", lambda: in_pool(pool, after))
    rec("values [hook tensors, thread tensor]", lambda: [
        float(box[k].sum().item()) for k in ("in hook", "after hook ctx", "thread")])
    ref = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model[1:](model[0](x)).square().mean().backward()
    rec("gradients made in the context equal those made outside it", lambda: all(
        torch.allclose(a, p.grad, rtol=1e-4, atol=1e-6) for a, p in zip(ref, model.parameters())))


def two_threads(torch, rec):
    from torch.cuda import MemPool, use_mem_pool
    pools = [MemPool(), MemPool()]
    barrier = threading.Barrier(3, timeout=30)
    made = [[], []]

    def run(i):
        with use_mem_pool(pools[i]):
            barrier.wait()
            for k in range(40):
                made[i].append(torch.full((1000 * (k + 1),), float(i + 1), device="cuda"))
            barrier.wait()
            barrier.wait()
    ths = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in ths:
        t.start()
    barrier.wait()
    mine = [torch.full((1000 * (k + 1),), 5.0, device="cuda") for k in range(40)]
    barrier.wait()
    counts = [p.use_count() for p in pools]
    barrier.wait()
    for t in ths:
        t.join()
    torch.cuda.synchronize()
    for i in (0, 1):
        rec(f"thread {i}'s tensors: [all in its pool, any in the other pool]", lambda i=i: [
            all(in_pool(pools[i], t) for t in made[i]),
            any(in_pool(pools[1 - i], t) for t in made[i])])
        rec(f"thread {i}'s values", lambda i=i: sum(float(t.sum().item()) for t in made[i]))
    rec("main thread's tensors meanwhile: [in pool 0, in pool 1]",
        lambda: [any(in_pool(p, t) for t in mine) for p in pools])
    rec("use counts while both contexts were open, and after",
        lambda: [counts, [p.use_count() for p in pools]])


GROUPS = {"autograd": autograd, "two_threads": two_threads}


if __name__ == "__main__":
    named_groups_against_native(GROUPS)
