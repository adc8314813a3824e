"""A whole CUDA nn.Module (tied embedding / output weights, BatchNorm with its running
statistics, a registered buffer and a non-persistent one) put on a torch.multiprocessing
Queue as the object itself, after model.share_memory(), with
parameters_to_vector(model.parameters()).detach() beside it (without detach() it is a
non-leaf that requires grad, which neither PyTorch nor vmm sends); the receiving process
evaluates it, then trains it one SGD step in place (Hogwild through a queue).

With PyTorch's allocator the module arrives as itself: its parameters are Parameters over the
sender's memory (requires_grad kept, the tie kept), its buffers too; eval output equals the
sender's; the receiver's SGD step, BatchNorm running statistics, num_batches_tracked and an
in-place buffer update land in the sender's module, equal to the same step taken locally on a
deepcopy; gradients stay in the receiver (the sender's .grad remains None).

Why vmm may differ: the put's dry run of pickle walks the module's __dict__ (parameters,
buffers, hooks, submodules) to find and prepare every tensor; 0-dim int64 buffers, a tied
Parameter reached twice, and in-place updates by the receiver's kernels (BatchNorm's running
statistics) through imported memory.
"""
import copy

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from dropin_report import report

VOCAB, DIM, BATCH = 50, 16, 32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.full((DIM,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, idx):
        h = torch.relu(self.fc(self.emb(idx))) * self.scale
        return self.out(self.bn(h))


def step(model, idx, target):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    loss = F.cross_entropy(model(idx), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.steps += 1
    return float(loss.item())


def child(q, reply, done):
    try:
        model, vec, idx, target = q.get(timeout=60)
        params = list(model.parameters())
        info = {
            "type": type(model).__name__,
            "tied": model.out.weight is model.emb.weight,
            "params": [(type(p).__name__, p.is_cuda, p.requires_grad) for p in params],
            "buffers": sorted((n, b.is_cuda, str(b.dtype)) for n, b in model.named_buffers()),
            "vec": bool(torch.equal(vec, nn.utils.parameters_to_vector(params))),
        }
        model.eval()
        with torch.no_grad():
            y = model(idx).cpu()
        reply.put(("eval", info, y))
        loss = step(model, idx, target)
        torch.cuda.synchronize()
        reply.put(("trained", loss, all(p.grad is not None for p in model.parameters())))
        done.wait(60)
        del model, vec, params
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {e}", None))


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, reply, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, reply, done), daemon=True)
    p.start()
    model = Net().cuda()
    with torch.no_grad():  # running statistics that are not the defaults
        model.bn.running_mean.uniform_(-0.1, 0.1)
        model.bn.running_var.uniform_(0.9, 1.1)
    model.share_memory()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, VOCAB, (BATCH,), device="cuda")
    target = torch.randint(0, VOCAB, (BATCH,), device="cuda")
    vec = nn.utils.parameters_to_vector(model.parameters()).detach()  # a non-leaf otherwise
    q.put((model, vec, idx, target))
    errors = []
    kind, info, y = reply.get(timeout=90)
    if kind == "error":
        errors.append(f"the receiver failed: {info[:500]}")
        done.set()
        p.join(30)
        report(errors)
    ref.eval()
    with torch.no_grad():
        y_ref = ref(idx).cpu()
    want_buffers = sorted((n, True, str(b.dtype)) for n, b in model.named_buffers())
    n_params = len(list(model.parameters()))
    if info["type"] != "Net" or not info["tied"]:
        errors.append(f"the module arrived as {info['type']}, tie kept: {info['tied']}")
    if info["params"] != [("Parameter", True, True)] * n_params:
        errors.append(f"parameters arrived as {info['params']}")
    if info["buffers"] != want_buffers:
        errors.append(f"buffers arrived as {info['buffers']}, sent {want_buffers}")
    if not info["vec"]:
        errors.append("parameters_to_vector differs between the sent vector and the received "
                      "module")
    if not torch.allclose(y, y_ref, atol=1e-5):
        errors.append(f"eval output differs by {float((y - y_ref).abs().max())}")
    kind, loss, had_grads = reply.get(timeout=90)
    if kind == "error":
        errors.append(f"the receiver's training step failed: {loss[:500]}")
    else:
        loss_ref = step(ref, idx, target)
        torch.cuda.synchronize()
        if abs(loss - loss_ref) > 1e-4 * max(1.0, abs(loss_ref)):
            errors.append(f"the receiver's loss {loss}, locally {loss_ref}")
        if not had_grads:
            errors.append("the receiver's parameters got no gradients")
        got, want = dict(model.named_parameters()), dict(ref.named_parameters())
        for name in want:
            if not torch.allclose(got[name], want[name], atol=1e-5):
                errors.append(f"parameter {name} after the receiver's step differs from the "
                              f"local step by {float((got[name] - want[name]).abs().max())}")
        gb, wb = dict(model.named_buffers()), dict(ref.named_buffers())
        for name in wb:
            if wb[name].dtype.is_floating_point:
                same = torch.allclose(gb[name], wb[name], atol=1e-5)
            else:
                same = torch.equal(gb[name], wb[name])
            if not same:
                errors.append(f"buffer {name} after the receiver's step is not the local "
                              f"step's ({gb[name].flatten()[:4].tolist()} vs "
                              f"{wb[name].flatten()[:4].tolist()})")
        if any(prm.grad is not None for prm in model.parameters()):
            errors.append("the receiver's gradients reached the sender's parameters")
    done.set()
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
