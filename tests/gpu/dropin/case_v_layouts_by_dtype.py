"""Every layout in each of four dtypes (bool, complex64, bfloat16, uint8), through a
torch.multiprocessing SimpleQueue: a channels_last 4-D tensor, a channels_last_3d 5-D one, a
transpose, a strided slice at an offset, an expand (stride 0), a 2-D window at an offset, a
0-dim tensor of its own and a 0-dim element of another tensor (storage offset 7), then the
0-dim elements again in a second message.

With PyTorch's allocator each tensor arrives with its dtype, shape, strides, storage offset,
memory format, the byte size of its storage (the sender's whole storage) and its values; the
0-dim element arrives 0-dim, over the same storage as the strided slice (element 7 is the
slice's element 2: a write through the slice shows in the element in the receiver and in the
sender); the second message's elements arrive over the storages the first message's tensors
still hold in the receiver (PyTorch's receiver finds them by IPC handle and offset), so the
write is visible there too.

Why vmm may differ: one send per tensor with its own dtype for 32 tensors of odd layouts
(stride 0, channels_last_3d, 0-dim at an offset); one-byte and complex element sizes; a
storage sent again in a later message while the receiver still holds it.
"""
import torch
import torch.multiprocessing as mp
from dropin_report import report

DTYPES = (torch.bool, torch.complex64, torch.bfloat16, torch.uint8)
NEW = {torch.bool: True, torch.complex64: complex(9.0, -9.0), torch.bfloat16: 2.5,
       torch.uint8: 200}


def make(values, dtype):
    """`values` (a float tensor of small integers) converted to `dtype` with distinct values."""
    if dtype == torch.bool:
        return values.remainder(3) == 0
    if dtype == torch.complex64:
        return torch.complex(values, -0.5 * values)
    if dtype == torch.bfloat16:
        return (values * 0.25 - 3.0).to(torch.bfloat16)
    return (values * 7).remainder(256).to(torch.uint8)


def layouts(dtype):
    def ramp(*shape):
        n = 1
        for s in shape:
            n *= s
        return make(torch.arange(n, dtype=torch.float32, device="cuda"), dtype).reshape(shape)

    line = ramp(12)
    grid = ramp(9, 10)
    return {
        "cl": ramp(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "cl3d": ramp(2, 3, 2, 4, 5).contiguous(memory_format=torch.channels_last_3d),
        "t": ramp(6, 10).t(),
        "step": line[1::3],
        "expand": ramp(1, 5).expand(4, 5),
        "window": grid[2:5, 3:7],
        "scalar": make(torch.tensor(5.0, device="cuda"), dtype),
        "elem": line[7],
    }


def describe(t):
    fmt = None
    if t.dim() == 4:
        fmt = t.is_contiguous(memory_format=torch.channels_last)
    elif t.dim() == 5:
        fmt = t.is_contiguous(memory_format=torch.channels_last_3d)
    return (str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset(), fmt,
            t.untyped_storage().nbytes(), t.cpu().tolist())


def child(sq, reply):
    try:
        msg, expect = sq.get()
        errs = []
        for dt, group in msg.items():
            for name, t in group.items():
                got, want = describe(t), expect[dt][name]
                if got[:6] != want[:6]:
                    errs.append(f"{dt} {name}: arrived as {got[:6]}, sent {want[:6]}")
                elif got[6] != want[6]:
                    errs.append(f"{dt} {name}: values {str(got[6])[:120]}, sent "
                                f"{str(want[6])[:120]}")
            if group["step"].untyped_storage().data_ptr() != \
                    group["elem"].untyped_storage().data_ptr():
                errs.append(f"{dt}: the 0-dim element and the slice of one storage arrived in "
                            f"different storages")
        for dtype in DTYPES:
            group = msg[str(dtype)]
            group["step"][2] = NEW[dtype]  # element 7 of the sender's line
        torch.cuda.synchronize()
        for dtype in DTYPES:
            seen = msg[str(dtype)]["elem"].item()
            if seen != NEW[dtype]:
                errs.append(f"{dtype}: a write through the slice reads as {seen!r} through the "
                            f"0-dim element in the receiver")
        again = sq.get()
        for dtype in DTYPES:
            elem = again[str(dtype)]
            first = msg[str(dtype)]["elem"]
            if elem.dim() != 0 or elem.storage_offset() != 7 or elem.item() != NEW[dtype]:
                errs.append(f"{dtype}: the element sent again arrived as {elem.dim()}-dim at "
                            f"offset {elem.storage_offset()}, value {elem.item()!r}")
            if elem.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                errs.append(f"{dtype}: the element sent again arrived over another storage "
                            f"than the one the receiver holds")
        reply.put(errs)
        del msg, again, group, t, elem, first
    except Exception as e:  # noqa: BLE001
        reply.put([f"the receiver failed: {type(e).__name__}: {e}"])


def main():
    ctx = mp.get_context("spawn")
    sq, reply = ctx.SimpleQueue(), ctx.Queue()
    p = ctx.Process(target=child, args=(sq, reply), daemon=True)
    p.start()
    msg = {str(dt): layouts(dt) for dt in DTYPES}
    expect = {dt: {name: describe(t) for name, t in group.items()} for dt, group in msg.items()}
    sq.put((msg, expect))
    sq.put({dt: group["elem"] for dt, group in msg.items()})
    errors = list(reply.get(timeout=90))
    torch.cuda.synchronize()
    for dtype in DTYPES:
        seen = msg[str(dtype)]["elem"].item()
        if seen != NEW[dtype]:
            errors.append(f"{dtype}: the receiver's write reads as {seen!r} in the sender")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
