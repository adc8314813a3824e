"""torch.compile(mode="reduce-overhead", dynamic=True): Inductor's kernels run inside CUDA
graph trees, with a batch size that changes from step to step (dynamic shapes), so the tree
records a new graph for each new size and replays the recorded one when a size comes back: a
training loop over ragged batches, and an inference function (no_grad) over inputs of several
lengths whose results are kept (cloned) across calls; what compiled serving and training code
with varying batch sizes runs.
# EXCLUSIVE (compiles kernels with Inductor: run alone to stay within the time limit)

CUDA graph trees keep one private memory pool for all their graphs: each recording allocates
its outputs and temporaries there, and moving from one recorded graph to another whose
position in the tree differs makes the tree put the pool back into a recorded state
(getCheckpointState / setCheckpointPoolState: live blocks freed, the checkpoint's blocks
allocated again at their addresses) and check the pool's live blocks
(checkPoolLiveAllocations) before replaying without re-recording. With PyTorch's allocator: ten
SGD steps over batch sizes 8, 24, 13, 24, 8, 40, 13, 8, 24, 40 (each first size recorded, each
repeat replayed) give the losses of an eager copy of the model trained on the same batches
(within 1e-3 relative) and its weights (within 1e-4); the compiled inference function matches
eager for lengths 1000, 4096, 1000, 70000, 4096, 1000, 70000, and every kept clone still holds
its value at the end; with the compiled code dropped and the graph trees reset,
memory_allocated() is back within 64 MiB of its baseline.

Why vmm may differ: the trees' pool is a vmm private pool; checkpoints restore blocks at fixed
addresses (vmm_pool_alloc_at) and free restored blocks through raw_delete, the live-block check
compares vmm's list with the tree's, and dynamic shapes make the tree record, checkpoint and
restore at each new size, with backward's graphs (autograd's thread) in the same pool.
"""
import copy

import torch
from dropin_report import baseline, compile_ready, compile_unavailable, report, settle

BATCHES = (8, 24, 13, 24, 8, 40, 13, 8, 24, 40)
LENGTHS = (1000, 4096, 1000, 70000, 4096, 1000, 70000)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 128)
        self.fc2 = torch.nn.Linear(128, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def scan(x):
    return torch.softmax(x * 0.5, dim=0).cumsum(0) + x.sin()


def batch(step, n):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(n, 32, generator=g).cuda(), torch.randn(n, 8, generator=g).cuda()


def mark_step():
    fn = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    if fn is not None:
        fn()


def main():
    errors = []
    if not compile_ready(Net().cuda(), *batch(99, 16)):
        return
    base, _, _ = baseline()

    torch.manual_seed(0)
    model = Net().cuda()
    eager = copy.deepcopy(model)
    kept = []
    try:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05)
        for step, n in enumerate(BATCHES):
            x, y = batch(step, n)
            mark_step()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(compiled(x), y)
            loss.backward()
            opt.step()
            got = float(loss.item())
            eager_opt.zero_grad(set_to_none=True)
            want_loss = torch.nn.functional.mse_loss(eager(x), y)
            want_loss.backward()
            eager_opt.step()
            want = float(want_loss.item())
            if abs(got - want) > 1e-3 * max(1e-3, abs(want)):
                errors.append(f"step {step} (batch {n}): compiled loss {got}, eager {want}")
                break
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if not torch.allclose(p, q, rtol=1e-3, atol=1e-4):
                errors.append(f"after {len(BATCHES)} steps {name} differs from eager by "
                              f"{float((p - q).abs().max().item())}")
                break
        del compiled, opt, eager_opt, loss, want_loss

        cscan = torch.compile(scan, mode="reduce-overhead", dynamic=True)
        with torch.no_grad():
            for i, n in enumerate(LENGTHS):
                g = torch.Generator(device="cuda").manual_seed(n + i)
                x = torch.randn(n, device="cuda", generator=g)
                mark_step()
                out = cscan(x)
                want = scan(x)
                if not torch.allclose(out, want, rtol=1e-4, atol=1e-5):
                    errors.append(f"call {i} (length {n}): the compiled function differs from "
                                  f"eager by {float((out - want).abs().max().item())}")
                kept.append((out.clone(), want))
                del out
        for i, (k, want) in enumerate(kept):
            if not torch.allclose(k, want, rtol=1e-4, atol=1e-5):
                errors.append(f"the clone kept from call {i} changed after later calls")
        del cscan
    except Exception as e:  # noqa: BLE001
        if compile_unavailable(e):
            return
        errors.append(f"torch.compile: {type(e).__name__}: {str(e)[:400]}")
    from torch._dynamo.utils import counters
    print(f"cudagraph skips: {counters['inductor']['cudagraph_skips']} (0: graphs were used)")

    del model, eager, kept
    torch._dynamo.reset()
    try:
        from torch._inductor import cudagraph_trees
        cudagraph_trees.reset_cudagraph_trees()
    except Exception as e:  # noqa: BLE001
        print(f"reset_cudagraph_trees: {type(e).__name__}: {e}")
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()  # the graph trees' stream got cuBLAS workspaces of its own
    settle()
    alloc = torch.cuda.memory_allocated()
    if alloc - base > 64 << 20:
        errors.append(f"memory_allocated() is {alloc - base} bytes above its baseline after the "
                      f"compiled code and its graph trees were dropped")
    report(errors)


if __name__ == "__main__":
    main()
