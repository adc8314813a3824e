"""Less common dtypes and dtype-punned views of one storage in one torch.multiprocessing
Queue message: float8 (e4m3fn, e5m2, and e8m0fnu / float4_e2m1fn_x2 where torch has them),
uint16 / uint32 / uint64, int16, int32 and complex128; a float32 tensor with its int32,
uint8 (sliced) and complex64 views and the complex view's .imag (stride 2, offset 1); a
14-byte uint8 storage with a float32 view at byte offset 4.

With PyTorch's allocator each tensor arrives with its dtype, shape, strides, storage offset
and bytes; the views of one storage arrive sharing one storage (PyTorch's receiver finds it
by IPC handle and offset whatever the dtype), so a write through the int32 view shows as
the float 1.5 in the float32 tensor and in the complex view's .imag, in the receiver and in
the sender; likewise through the float view of the odd-sized byte storage.

Why vmm may differ: dtypes outside vmm's fixed table travel by name (looked up on arrival);
each view is a send of its own with its own dtype, rebuilt over the imported buffer and
matched to the storage already received over the same bytes, whatever the dtype; a storage
whose size is no multiple of the view's element size.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report

BITS_OF_1_5 = 1069547520  # torch.tensor(1.5).view(torch.int32)


def describe(t):
    raw = t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return (str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset(),
            raw.cpu().tolist())


def message():
    g = torch.linspace(-3.0, 3.0, 96, device="cuda")
    byte_ramp = torch.arange(96, dtype=torch.uint8, device="cuda")
    plain = {
        "float8_e4m3fn": g.to(torch.float8_e4m3fn),
        "float8_e5m2": g.to(torch.float8_e5m2).reshape(8, 12)[:, 2:9],
        "uint16": torch.arange(-48, 48, dtype=torch.int16, device="cuda").view(torch.uint16),
        "uint32": torch.arange(-48, 48, dtype=torch.int32, device="cuda").view(torch.uint32),
        "uint64": torch.arange(-48, 48, dtype=torch.int64, device="cuda").view(torch.uint64),
        "int16": (g * 1000).to(torch.int16),
        "int32": (g * 1e6).to(torch.int32)[5:],
        "complex128": torch.complex(g, -g).to(torch.complex128).reshape(12, 8).t(),
    }
    for name in ("float8_e8m0fnu", "float4_e2m1fn_x2"):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            plain[name] = byte_ramp.view(dtype)
    base = torch.arange(64, dtype=torch.float32, device="cuda")
    c64 = base.view(torch.complex64)
    punned = {"f32": base, "i32": base.view(torch.int32), "u8": base.view(torch.uint8)[8:40],
              "c64": c64, "imag": c64.imag}
    buf = torch.arange(14, dtype=torch.uint8, device="cuda")
    odd = {"buf": buf, "f": buf[4:12].view(torch.float32)}
    return plain, punned, odd


def child(q, reply):
    try:
        (plain, punned, odd), expect = q.get(timeout=60)
        errs = []
        for group in (plain, punned, odd):
            for name, t in group.items():
                got = describe(t)
                if got[:4] != expect[name][:4]:
                    errs.append(f"{name}: arrived as {got[:4]}, sent {expect[name][:4]}")
                elif got[4] != expect[name][4]:
                    errs.append(f"{name}: its bytes differ")
        for label, group in (("punned", punned), ("odd", odd)):
            ptrs = {name: t.untyped_storage().data_ptr() for name, t in group.items()}
            if len(set(ptrs.values())) != 1:
                errs.append(f"the {label} views of one storage arrived in different storages "
                            f"{ptrs}")
        punned["i32"][3] = BITS_OF_1_5
        odd["f"][1] = 0.0
        torch.cuda.synchronize()
        if float(punned["f32"][3].item()) != 1.5 or float(punned["imag"][1].item()) != 1.5:
            errs.append("a write through the int32 view is not in the float32 tensor or the "
                        "complex view's .imag in the receiver")
        if odd["buf"][8:12].tolist() != [0, 0, 0, 0]:
            errs.append(f"a write through the float view of the 14-byte storage reads as bytes "
                        f"{odd['buf'].tolist()} in the receiver")
        reply.put(errs)
    except Exception as e:  # noqa: BLE001
        reply.put([f"the receiver failed: {type(e).__name__}: {e}"])


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    plain, punned, odd = message()
    expect = {name: describe(t) for group in (plain, punned, odd) for name, t in group.items()}
    q.put(((plain, punned, odd), expect))
    errors = list(reply.get(timeout=90))
    torch.cuda.synchronize()
    if not errors:
        if float(punned["f32"][3].item()) != 1.5:
            errors.append("the receiver's write through the int32 view is not in the sender's "
                          "float32 tensor")
        if odd["buf"][8:12].tolist() != [0, 0, 0, 0]:
            errors.append("the receiver's write through the float view is not in the sender's "
                          "14-byte storage")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
