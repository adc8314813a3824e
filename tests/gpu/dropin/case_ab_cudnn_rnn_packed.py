"""Recurrent networks on cuDNN (nn.LSTM and nn.GRU: speech, time-series and OCR models):
stacked bidirectional layers over packed variable-length batches (pack_padded_sequence), a
forward and a backward per round, with the weights flattened into cuDNN's single buffer, a
module with tied weights (weight_hh_l1 is weight_hh_l0: flatten_parameters() leaves aliased
weights apart, so cuDNN copies them into a fresh weight buffer at every call; a weight merely
replaced by a new Parameter is flattened again by the next forward, _update_flat_weights),
and a training-mode LSTM with dropout (cuDNN's dropout state, which PyTorch caches for the
process).

With PyTorch's allocator: outputs, final states and the gradients of the weights and of the
input equal the same computation on the CPU (float32, TF32 off; within 1e-2 of the largest
value), in three rounds; the dropout LSTM's outputs are finite and its eval-mode outputs equal
the CPU's; the second and third rounds end with the same memory_allocated() (cuDNN's
workspace and reserve space, requested at every call, go back; the dropout state stays).

Why vmm may differ: cuDNN's RNN workspace, its reserve space (kept from the forward for the
backward) and the flattened weight buffer are allocations of vmm with lifetimes and sizes
cuDNN chooses, several per call.
"""
import copy
import time

import torch
from dropin_report import check_level, level, report

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def rel(got, want):
    return float((got.detach().cpu() - want.detach()).abs().max() / want.abs().max())


def run(mod, x, lengths, dev):
    packed = torch.nn.utils.rnn.pack_padded_sequence(x.to(dev), lengths, batch_first=True,
                                                     enforce_sorted=False)
    out, state = mod(packed)
    out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    h = state[0] if isinstance(state, tuple) else state
    (out.square().mean() + h.sum()).backward()
    return out, h


def main():
    errors = []
    torch.manual_seed(0)
    torch.set_num_threads(2)  # the CPU references, beside seven other programs
    x = torch.randn(8, 24, 32)
    lengths = torch.randint(3, 25, (8,))
    lengths[0] = 24
    nets = {"lstm": torch.nn.LSTM(32, 48, num_layers=2, bidirectional=True, batch_first=True),
            "gru": torch.nn.GRU(32, 48, num_layers=3, bidirectional=True, batch_first=True)}
    nets["lstm, tied weights"] = torch.nn.LSTM(32, 40, num_layers=2, batch_first=True)
    gpu = {k: copy.deepcopy(m).cuda() for k, m in nets.items()}
    for m in (nets["lstm, tied weights"], gpu["lstm, tied weights"]):
        # aliased weights stay out of the flat buffer: cuDNN gets a copy at every call
        m.weight_hh_l1 = m.weight_hh_l0
    after = []
    start = time.monotonic()
    for rnd in range(3):
        for name, cpu_mod in nets.items():
            print(f"{time.monotonic() - start:6.1f} s: round {rnd}, {name}", flush=True)
            mod = gpu[name]
            mod.zero_grad(set_to_none=True)
            cpu_mod.zero_grad(set_to_none=True)
            xc, xg = x.clone().requires_grad_(), x.clone().cuda().requires_grad_()
            want = run(cpu_mod, xc, lengths, "cpu")
            got = run(mod, xg, lengths, "cuda")
            pairs = [("output", got[0], want[0]), ("final state", got[1], want[1]),
                     ("input grad", xg.grad, xc.grad)]
            pairs += [(f"grad {n}", p.grad, q.grad) for (n, p), q in
                      zip(mod.named_parameters(), cpu_mod.parameters())]
            for what, a, b in pairs:
                if rel(a, b) > 1e-2:
                    errors.append(f"round {rnd}, {name}: {what} is off by {rel(a, b):.3g}")
            del got, pairs, xg
        print(f"{time.monotonic() - start:6.1f} s: round {rnd}, dropout", flush=True)
        drop = torch.nn.LSTM(32, 48, num_layers=2, dropout=0.25, batch_first=True)
        dg = copy.deepcopy(drop).cuda().train()
        y, _ = dg(x.cuda())
        y.sum().backward()
        if not bool(torch.isfinite(y).all().item()):
            errors.append(f"round {rnd}: the dropout LSTM gave non-finite outputs")
        with torch.no_grad():
            ye, _ = dg.eval()(x.cuda())
            if rel(ye, drop.eval()(x)[0]) > 1e-2:
                errors.append(f"round {rnd}: the dropout LSTM in eval mode differs from the CPU")
        del drop, dg, y, ye, _
        after.append(level())
        if errors:
            break
    check_level(after, errors)
    report(errors)


if __name__ == "__main__":
    main()
