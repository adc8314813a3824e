"""One torch.multiprocessing Queue message holding a nested dict / list / tuple of CUDA tensors
of every common dtype, 0-element and 0-dim tensors, an nn.Parameter, a leaf that requires
grad, 300 small tensors, views of one storage and a CPU tensor (a rollout batch, an
optimizer-state dict).

With PyTorch's allocator everything arrives with its type, dtype, shape, device, values and
requires_grad: bool, int8, uint8, int64, float16, bfloat16, float32, float64 and complex64;
an empty tensor (whose storage has no memory: PyTorch sends no IPC handle for it) arrives as
an empty CUDA tensor; a 0-dim tensor stays 0-dim; the Parameter stays a Parameter; the three
views of one base share one storage in the receiver (a write through one shows in the
others) and in the sender (the receiver's write shows there).

Why vmm may differ: each CUDA tensor is a vmm send of its own; an empty tensor has a null
pointer (no vmm memory); the dry run of pickle in Queue.put walks the whole nested object;
sends of views of one block share one import in the receiver (sharing.received_storage).
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report


def describe(obj):
    if isinstance(obj, torch.Tensor):
        return (type(obj).__name__, str(obj.dtype), tuple(obj.shape), obj.device.type,
                obj.requires_grad, obj.detach().cpu().tolist())
    if isinstance(obj, dict):
        return {k: describe(v) for k, v in obj.items()}
    return [describe(v) for v in obj]


def child(q, reply):
    try:
        msg = q.get(timeout=60)
        d = describe(msg)
        v0, v1, v2 = msg["views"]
        v1[0] = -7.0  # base[100]: also v0[100] and v2[25]
        torch.cuda.synchronize()
        shared = (float(v0[100].item()), float(v2[25].item()),
                  v0.untyped_storage().data_ptr() == v2.untyped_storage().data_ptr())
        reply.put(("ok", d, shared))
        del msg, v0, v1, v2
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {e}", None))


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    f = torch.randn(64, device="cuda")
    g = f.abs() * 10
    base = torch.arange(200.0, device="cuda")
    msg = {
        "dtypes": {str(dt): g.to(dt) for dt in (torch.int8, torch.uint8, torch.int64,
                                                torch.float16, torch.bfloat16,
                                                torch.float32, torch.float64)},
        "bool": f > 0,
        "complex": torch.complex(f, -f),
        "empty": [torch.empty(0, device="cuda"), torch.zeros(0, 5, dtype=torch.int64,
                                                             device="cuda")],
        "scalar": torch.tensor(3.5, device="cuda"),
        "param": torch.nn.Parameter(torch.ones(4, 4, device="cuda")),
        "leaf": torch.zeros(3, device="cuda", requires_grad=True),
        "many": [torch.full((i % 17 + 1,), float(i), device="cuda") for i in range(300)],
        "views": (base, base[100:110], base[50::2]),
        "cpu": torch.arange(5),
    }
    expect = describe(msg)
    q.put(msg)
    errors = []
    status, got, shared = reply.get(timeout=90)
    if status != "ok":
        errors.append(f"the receiver failed: {got[:500]}")
    else:
        for key, want in expect.items():
            if got.get(key) != want:
                errors.append(f"{key!r} arrived as {str(got.get(key))[:300]}, sent "
                              f"{str(want)[:300]}")
        if shared != (-7.0, -7.0, True):
            errors.append(f"views of one storage do not share it in the receiver: {shared}")
        torch.cuda.synchronize()
        if float(base[100].item()) != -7.0:
            errors.append("the receiver's write through a view is not in the sender's tensor")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
