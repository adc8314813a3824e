"""A whole CUDA nn.Module sent over a multiprocessing Pipe (Connection.send) to a spawned
evaluation process, its inputs passed as Process arguments: a channels_last Conv2d with
BatchNorm2d, a two-layer GRU (whose cuDNN weights PyTorch flattens into one buffer when the
module moves to the GPU), a self-attention nn.MultiheadAttention, LayerNorm, a frozen
Embedding (requires_grad False), a Linear head, a float buffer, a 0-dim int64 buffer and a
non-persistent buffer; model.share_memory() called first (a no-op for CUDA tensors).

With PyTorch's allocator the module arrives as itself: every parameter an nn.Parameter with
its requires_grad (the frozen one False), dtype, shape and strides (the conv weight stays
channels_last); the buffers with their values; the GRU's parameters share one storage in the
receiver exactly when they do in the sender; the receiver's eval forward equals the
sender's output (within 1e-3); after the sender changes weights and a buffer in place (the
head's weight doubled, a GRU weight shifted, the float buffer refilled) and synchronizes,
the receiver's next forward equals the sender's new output (the module is the sender's
memory, not a copy).

Why vmm may differ: pickling a module in the caller walks its __dict__ (RNNBase's
__getstate__ drops weak references; its flat weights list names the same Parameters), the
GRU's parameters are views into one flat cuDNN buffer rebuilt over one import (cuDNN checks
that they are still one contiguous chunk), and the conv weight's channels_last strides; the
inputs travel as Process arguments (pickled at start()).
"""
import torch
import torch.multiprocessing as mp
from torch import nn
from dropin_report import report

B, C, H, W, D = 4, 3, 6, 6, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gru = nn.GRU(8, D, num_layers=2, batch_first=True)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm = nn.LayerNorm(D)
        self.emb = nn.Embedding(10, D)
        self.emb.weight.requires_grad_(False)
        self.head = nn.Linear(D, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("gain", torch.ones(5), persistent=False)

    def forward(self, img, tok):
        h = torch.relu(self.bn(self.conv(img)))
        seq = h.flatten(2).transpose(1, 2)  # (B, H * W, 8)
        out, _ = self.gru(seq)
        out = out + self.emb(tok)[:, None, :]
        a, _ = self.attn(out, out, out, need_weights=False)
        y = self.norm(a + out) * self.scale
        return self.head(y.mean(1)) * self.gain


def describe(model):
    params = [(n, type(p).__name__, p.requires_grad, str(p.dtype), tuple(p.shape), p.stride(),
               p.is_cuda) for n, p in model.named_parameters()]
    buffers = [(n, str(b.dtype), tuple(b.shape), b.cpu().tolist())
               for n, b in model.named_buffers()]
    gru = {p.untyped_storage().data_ptr() for p in model.gru.parameters()}
    return params, buffers, len(gru), model.training


def child(conn, img, tok):
    try:
        model = conn.recv()
        info = describe(model)
        with torch.no_grad():
            y = model(img, tok).cpu()
        conn.send(("first", info, y))
        if conn.recv() != "again":
            raise RuntimeError("protocol: expected again")
        torch.cuda.synchronize()
        with torch.no_grad():
            y2 = model(img, tok).cpu()
        conn.send(("second", y2))
        conn.recv()  # end
        del model, img, tok
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))


def recv(conn, errors):
    if not conn.poll(90):
        errors.append("no answer from the receiver in 90 s")
        return None
    msg = conn.recv()
    if msg[0] == "error":
        errors.append(f"the receiver failed: {msg[1][:600]}")
        return None
    return msg


def close_enough(a, b):
    return torch.allclose(a, b, rtol=1e-3, atol=1e-3)


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    model = Net().cuda().to(memory_format=torch.channels_last).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.8, 1.2)
        model.calls.fill_(7)
    model.share_memory()
    img = torch.randn(B, C, H, W, device="cuda").to(memory_format=torch.channels_last)
    tok = torch.randint(0, 10, (B,), device="cuda")
    with torch.no_grad():
        y_ref = model(img, tok).cpu()
    want = describe(model)
    parent_conn, child_conn = ctx.Pipe()
    p = ctx.Process(target=child, args=(child_conn, img, tok), daemon=True)
    p.start()
    parent_conn.send(model)
    errors = []
    msg = recv(parent_conn, errors)
    if msg is not None:
        _, info, y = msg
        for label, got, exp in zip(("parameters", "buffers", "GRU storages", "training"),
                                   info, want):
            if got != exp:
                errors.append(f"{label} arrived as {str(got)[:400]}, sent {str(exp)[:400]}")
        if not close_enough(y, y_ref):
            errors.append(f"the receiver's forward differs from the sender's by "
                          f"{float((y - y_ref).abs().max())}")
        with torch.no_grad():
            model.head.weight.mul_(2.0)
            model.gru.weight_hh_l1.add_(0.05)
            model.scale.fill_(1.25)
            y2_ref = model(img, tok).cpu()
        torch.cuda.synchronize()
        if close_enough(y2_ref, y_ref):
            errors.append("the in-place weight changes did not change the sender's output")
        parent_conn.send("again")
        msg = recv(parent_conn, errors)
        if msg is not None:
            y2 = msg[1]
            if not close_enough(y2, y2_ref):
                errors.append(f"after the sender's in-place weight changes the receiver's "
                              f"forward differs from the sender's by "
                              f"{float((y2 - y2_ref).abs().max())} (it was "
                              f"{float((y2 - y_ref).abs().max())} from the old output)")
        parent_conn.send("end")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
