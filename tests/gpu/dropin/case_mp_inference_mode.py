"""Outputs computed under torch.inference_mode() (inference tensors) and torch.no_grad() sent
to another process, from inside and from outside inference mode (an inference server handing
results to a post-processing process), and used afterwards by the sender.

With PyTorch's allocator sending works in both places, the receiver gets the values, and
the sender can still read its tensors (and, inside inference mode, write them) afterwards.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): Queue.put moves small tensors into memory of their own with operators of
its own (storage_bytes, copy_, swap_storage) on tensors that are inference tensors, which
PyTorch restricts outside inference mode.
"""
import sys

import torch
import torch.multiprocessing as mp
from dropin_report import report


def child(q, reply, count):
    sums = []
    for _ in range(count):
        t = q.get(timeout=60)
        sums.append(float(t.double().sum().item()))
        del t
    reply.put(sums)


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply, 4), daemon=True)
    p.start()
    model = torch.nn.Linear(32, 16).cuda()
    x = torch.randn(8, 32, device="cuda")
    errors = []
    with torch.inference_mode():
        a = model(x)
        q.put(a)                       # inside inference mode
        b = model(x) * 3
    with torch.no_grad():
        c = model(x).relu()
    try:
        q.put(b)                       # an inference tensor, outside inference mode
        q.put(c)
        q.put(a[2:5])                  # a view of an inference tensor
    except Exception as e:  # noqa: BLE001
        print(f"FAIL: Queue.put of an inference tensor outside inference mode raised "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        p.kill()
        sys.exit(1)
    with torch.no_grad():
        ref = model(x)
    sent = [ref, ref * 3, ref.relu(), ref[2:5]]
    got = reply.get(timeout=90)
    exp = [float(t.double().sum().item()) for t in sent]
    for g, e, name in zip(got, exp, ("a", "b", "c", "a[2:5]")):
        if abs(g - e) > 1e-3 * max(1.0, abs(e)):
            errors.append(f"{name}: received sum {g}, expected {e}")
    with torch.inference_mode():
        a.add_(1.0)                    # the sender's inference tensor is still its own
    if not torch.allclose(a, ref + 1.0, atol=1e-5) or not torch.allclose(b, ref * 3, atol=1e-5):
        errors.append("the sender's inference tensors changed after sending")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
