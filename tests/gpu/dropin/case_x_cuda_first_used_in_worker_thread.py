"""CUDA first used by a worker thread that then exits: a server that loads its model in a
startup thread, a notebook or GUI that runs the first GPU work in a background thread. The
main thread has only imported torch; the worker makes the model, trains it three steps,
caches and frees memory, and ends. Then the main thread trains on, a second short-lived
thread allocates, captures and replays a CUDA graph, and a spawned process receives one of
the model's weights through a torch.multiprocessing queue and writes to it.

With PyTorch's allocator nothing is tied to the thread that first used CUDA: after it ended
the model trains on in the main thread to the same weights as a copy trained six steps in
one go (within float32 tolerance); the second thread's graph replays right; the receiver
reads the weight's values and its in-place write shows in the main process; the tensors the
startup thread kept hold their values throughout.

Why vmm may differ: vmm starts its pools, its process state and its helpers (the fd server
that hands POSIX-fd handles to receivers, the driver's retained context) at the first
allocation, in whatever thread makes it; state bound to that thread (a thread-local context,
a helper whose life follows its parent thread, a route or stream tag keyed by a thread id the
system reuses) breaks once the thread is gone.
"""
import copy
import threading

import torch
import torch.multiprocessing as mp
from dropin_report import report

MIB = 1 << 20


def make_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(256, 64, generator=g), torch.randn(256, 8, generator=g)


def train(model, opt, steps):
    for s in steps:
        x, y = make_batch(s)
        loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def receiver(q, reply):
    try:
        w = q.get(timeout=60)
        seen = float(w.sum().item())
        w.add_(1.0)
        torch.cuda.synchronize()
        reply.put(("ok", seen))
        reply.put(q.get(timeout=60))  # wait for the parent's word before dropping w
        del w
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {e}"))


def main():
    errors = []
    state = {}

    def startup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 8)).cuda()
        twin = copy.deepcopy(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, opt, range(3))
        scratch = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        scratch.fill_(1)
        del scratch
        small = [torch.full((1 << (8 + i % 10),), float(i), device="cuda") for i in range(200)]
        del small[::2]
        state.update(model=model, twin=twin, opt=opt, small=small)
        torch.cuda.synchronize()

    def run(fn, name):
        def body():
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        th = threading.Thread(target=body, name=name)
        th.start()
        th.join(60)
        if th.is_alive():
            errors.append(f"{name}: did not finish within 60 s")

    run(startup, "the startup thread")
    if "model" not in state:
        report(errors)
        return
    model, twin, opt = state["model"], state["twin"], state["opt"]

    # The main thread carries on.
    train(model, opt, range(3, 6))
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    train(twin, twin_opt, range(6))
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            errors.append(f"after 3 + 3 steps across the threads {name} differs from the copy "
                          f"trained 6 steps in the main thread")
    for i, t in zip(range(1, 200, 2), state["small"]):
        if float(t.max().item()) != float(i):
            errors.append("a tensor the startup thread kept changed")
            break

    # A second short-lived thread: allocations, empty_cache, a CUDA graph.
    def second():
        x = torch.zeros(4096, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x * 3 + 1
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 3 + 1
        for v in (1.0, 2.0):
            x.fill_(v)
            g.replay()
            torch.cuda.synchronize()
            if not bool((y == v * 3 + 1).all()):
                errors.append(f"a graph captured in a second thread replayed wrong for {v}")
        junk = [torch.empty(n * MIB, dtype=torch.uint8, device="cuda") for n in (1, 5, 40, 90)]
        del junk
        torch.cuda.empty_cache()

    run(second, "the second thread")

    # A spawned receiver maps one of the weights and writes to it.
    w = model[2].weight.detach()
    before = float(w.sum().item())
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receiver, args=(q, reply), daemon=True)
    p.start()
    q.put(w)
    try:
        status, seen = reply.get(timeout=90)
    except Exception as e:  # noqa: BLE001
        status, seen = "error", f"no answer: {type(e).__name__}"
    if status != "ok":
        errors.append(f"the receiver failed: {str(seen)[:300]}")
    else:
        if abs(seen - before) > 1e-3 * max(1.0, abs(before)):
            errors.append(f"the receiver read a sum of {seen}, the weight's is {before}")
        torch.cuda.synchronize()
        after = float(w.sum().item())
        if abs(after - (before + w.numel())) > 1e-2 * max(1.0, abs(before) + w.numel()):
            errors.append(f"after the receiver added 1 the weight's sum is {after}, expected "
                          f"{before + w.numel()}")
    q.put(("done", None))
    try:
        reply.get(timeout=30)
    except Exception:  # noqa: BLE001
        pass
    p.join(30)

    del state["small"], w
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() < held:
        errors.append(f"memory_allocated() is {torch.cuda.memory_allocated()}, below the "
                      f"{held} bytes of the model's parameters")
    report(errors)


if __name__ == "__main__":
    main()
