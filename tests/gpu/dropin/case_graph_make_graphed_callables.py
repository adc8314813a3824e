"""torch.cuda.make_graphed_callables: a module's forward and backward captured as CUDA graphs
(warm-up iterations on a side stream, a private memory pool shared by the two graphs), then
trained for a few steps.

With PyTorch's allocator: the graphed module's outputs, losses and parameters after five SGD
steps match an eager copy's (same initial weights, same inputs) to float tolerance; the graphed
module's outputs are fresh each replay (inputs copied into the static input); and dropping the
graphed module, the optimizers and the tensors lowers memory_allocated() (cuBLAS keeps a
workspace per stream for good, so the baseline itself is not reached).

Why vmm may differ: the capture's private pool is a vmm private pool reached through a route
whose filter takes the capture stream; warm-up runs on a side stream; backward's graph shares
the forward's pool, and the pool is released when the graphs go.
"""
import copy
import gc

import torch
from dropin_report import report


def main():
    errors = []
    torch.manual_seed(0)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 10)).cuda()
    eager = copy.deepcopy(model)
    sample = torch.randn(32, 256, device="cuda", requires_grad=False)
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    opt_g = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(32, 256, device="cuda")
        target = torch.randn(32, 10, device="cuda")
        out_g = graphed(x)
        out_e = eager(x)
        if not torch.allclose(out_g, out_e, atol=1e-4, rtol=1e-4):
            errors.append(f"step {step}: the graphed forward differs from eager")
        loss_g = torch.nn.functional.mse_loss(out_g, target)
        loss_e = torch.nn.functional.mse_loss(out_e, target)
        loss_g.backward()
        loss_e.backward()
        opt_g.step()
        opt_e.step()
        opt_g.zero_grad(set_to_none=True)
        opt_e.zero_grad(set_to_none=True)
        if abs(loss_g.item() - loss_e.item()) > 1e-4 * max(1.0, abs(loss_e.item())):
            errors.append(f"step {step}: loss {loss_g.item()} graphed, {loss_e.item()} eager")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if not torch.allclose(p, q, atol=1e-4, rtol=1e-4):
            errors.append(f"parameter {name} differs from eager after five steps")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    del graphed, model, eager, opt_g, opt_e, sample, x, target, out_g, out_e, loss_g, loss_e
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() >= held:
        errors.append(f"memory_allocated() did not go down when the graphed module was dropped "
                      f"({held} before, {torch.cuda.memory_allocated()} after)")
    report(errors)


if __name__ == "__main__":
    main()
