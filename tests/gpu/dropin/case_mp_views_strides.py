"""Many views of one CUDA storage in one message: rows, columns, transposes, steps,
expand (stride 0), channels_last, a flat slice with an offset, and the base itself.

With PyTorch's allocator every view arrives with its shape, strides and storage offset and
its values; all of them share one storage in the receiver (a write through the column view
shows in the base and in the transpose there), and the receiver's write shows in the
sender's tensor (same memory).

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): vmm moves the storage before sending (its views follow), sends each view
as its own import payload (descriptor, shape, strides, offset) and checks each view against
the imported buffer.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report


def views(base, img):
    return {
        "base": base, "row": base[5], "col": base[:, 7], "t": base.t(),
        "block": base[10:20, 3:9], "step": base[::2, ::3], "expand": base[0:1].expand(4, 64),
        "flat": base.view(-1)[100:200], "img": img, "img_slice": img[:, 1:, 2:, :],
    }


def describe(d):
    return {k: (tuple(v.shape), v.stride(), v.storage_offset(), v.cpu().clone())
            for k, v in d.items()}


def child(q, reply):
    msg, expect = q.get(timeout=60)
    errors = []
    for k, (shape, stride, offset, values) in expect.items():
        v = msg[k]
        if (tuple(v.shape), v.stride(), v.storage_offset()) != (shape, stride, offset):
            errors.append(f"{k}: {tuple(v.shape)} {v.stride()} {v.storage_offset()} vs "
                          f"{shape} {stride} {offset}")
        elif not torch.equal(v.cpu(), values):
            errors.append(f"{k}: values differ")
    msg["col"].fill_(-1.0)
    torch.cuda.synchronize()
    if float(msg["base"][33, 7].item()) != -1.0 or float(msg["t"][7, 40].item()) != -1.0:
        errors.append("in the receiver, a write through the column view is not in the base "
                      "or the transpose (views do not share memory)")
    reply.put(errors)
    del msg


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    base = torch.arange(64 * 64, dtype=torch.float32, device="cuda").reshape(64, 64)
    img = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32, device="cuda").reshape(2, 3, 4, 5)
    img = img.to(memory_format=torch.channels_last)
    d = views(base, img)
    q.put((d, describe(d)))
    errors = reply.get(timeout=90)
    torch.cuda.synchronize()
    if not bool((base[:, 7] == -1.0).all().item()):
        errors.append("the receiver's write is not visible in the sender's tensor")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
