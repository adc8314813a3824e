"""One torch.multiprocessing Queue message holding 2,000 small CUDA tensors (a list, four
dtypes, 1 to 300 elements each) and a dict of views of one 32 MiB uint8 storage at offsets
from 0 to 31 MiB, reinterpreted with view(dtype) as float32, float64 (2-D, sliced columns),
bfloat16 (transposed, at an odd element offset), int32, complex64, plus raw uint8 slices that
overlap the float32 view (a batch of small per-layer tensors and a packed flat buffer, as
optimizer states and KV caches travel).

With PyTorch's allocator every small tensor arrives with its dtype, shape and values (all
2,000 checked, element by element) in a storage of its own; every view arrives with its
dtype, shape, strides, storage offset and values; all the views share one storage in the
receiver, of the sender's 32 MiB (the receiver finds the storage it already rebuilt by the
IPC handle and offset, whatever the dtype); a write of 1.5 through the float32 view at byte
offset 1 MiB reads as the bytes 0, 0, 192, 63 through the overlapping uint8 slice in the
receiver and in the sender's storage.

Why vmm may differ: 2,000 sends in one message (each a vmm send of its own, with its own
acknowledgement; Queue.put's preparation walks a list of 2,000 tensors), small tensors that
share physical chunks in the sender; views of one block with six dtypes, rebuilt over one
import and matched to the storage already received whatever the dtype; offsets up to 31 MiB
into one storage.
"""
import torch
import torch.multiprocessing as mp
from dropin_report import report

COUNT = 2000
DTYPES = (torch.float32, torch.int64, torch.float16, torch.int8)
MIB = 1 << 20
SIZE = 32 * MIB


def small_values(i, device):
    """Tensor i of the list: 1 to 300 small integers (exact in every one of the dtypes)."""
    n = 1 + (i * 37) % 300
    return (torch.arange(n, device=device) % 100 + i % 7).to(DTYPES[i % len(DTYPES)])


def packed():
    big = (torch.arange(SIZE, dtype=torch.int32, device="cuda") % 251).to(torch.uint8)
    views = {
        "u8_head": big[:4096],
        "f32": big[MIB:MIB + 4 * 4096].view(torch.float32),
        "f64_cols": big[3 * MIB:3 * MIB + 8 * 64 * 32].view(torch.float64).view(64, 32)[:, 5:20],
        "bf16_t": big[9 * MIB + 6:9 * MIB + 6 + 2 * 128 * 64].view(torch.bfloat16)
        .view(128, 64).t(),
        "i32": big[17 * MIB + 4:17 * MIB + 4 + 4 * 1000].view(torch.int32),
        "c64": big[31 * MIB:31 * MIB + 8 * 500].view(torch.complex64),
        "u8_over_f32": big[MIB:MIB + 64],
    }
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    views["f32"].copy_(torch.linspace(-5.0, 5.0, 4096, device="cuda"))
    f64 = big[3 * MIB:3 * MIB + 8 * 64 * 32].view(torch.float64)
    f64.copy_(torch.randn(64 * 32, dtype=torch.float64, device="cuda", generator=g))
    bf = big[9 * MIB + 6:9 * MIB + 6 + 2 * 128 * 64].view(torch.bfloat16)
    bf.copy_(torch.randn(128 * 64, device="cuda", generator=g).to(torch.bfloat16))
    views["i32"].copy_(torch.arange(-500, 500, dtype=torch.int32, device="cuda") * 12345)
    lin = torch.linspace(-2.0, 2.0, 500, device="cuda")
    views["c64"].copy_(torch.complex(lin, -3.0 * lin))
    return big, views


def describe(v):
    return (str(v.dtype), tuple(v.shape), v.stride(), v.storage_offset(), v.cpu().tolist())


def child(q, reply):
    try:
        msg = q.get(timeout=60)
        small, views, expect = msg["small"], msg["views"], msg["expect"]
        errs = []
        if len(small) != COUNT:
            errs.append(f"the list arrived with {len(small)} tensors, sent {COUNT}")
        want = [small_values(i, "cpu") for i in range(COUNT)]
        meta = [(t.dtype, tuple(t.shape), t.is_cuda) for t in small]
        wrong = [i for i in range(min(COUNT, len(small)))
                 if meta[i] != (want[i].dtype, tuple(want[i].shape), True)]
        if wrong:
            errs.append(f"{len(wrong)} small tensors arrived with another dtype, shape or "
                        f"device, e.g. #{wrong[0]}: {meta[wrong[0]]}")
        else:
            got = torch.cat([t.double().flatten() for t in small]).cpu()
            ref = torch.cat([w.double().flatten() for w in want])
            if not torch.equal(got, ref):
                bad = int((got != ref).sum())
                errs.append(f"{bad} of {ref.numel()} elements of the small tensors differ")
            del got
        ptrs = {t.untyped_storage().data_ptr() for t in small}
        if len(ptrs) != len(small):
            errs.append(f"{len(small)} small tensors arrived in {len(ptrs)} storages")
        for name, want_v in expect.items():
            got_v = describe(views[name])
            if got_v[:4] != want_v[:4]:
                errs.append(f"view {name} arrived as {got_v[:4]}, sent {want_v[:4]}")
            elif got_v[4] != want_v[4]:
                errs.append(f"view {name} arrived with other values")
        storages = {v.untyped_storage().data_ptr() for v in views.values()}
        sizes = {v.untyped_storage().nbytes() for v in views.values()}
        if len(storages) != 1 or sizes != {SIZE}:
            errs.append(f"the views of one storage arrived in {len(storages)} storages of "
                        f"{sorted(sizes)} bytes (sent one of {SIZE})")
        views["f32"][0] = 1.5
        torch.cuda.synchronize()
        seen = views["u8_over_f32"][:4].tolist()
        if seen != [0, 0, 192, 63]:
            errs.append(f"in the receiver, 1.5 written through the float32 view reads as bytes "
                        f"{seen} through the overlapping uint8 slice")
        reply.put(errs)
        del msg, small, views, meta
    except Exception as e:  # noqa: BLE001
        reply.put([f"the receiver failed: {type(e).__name__}: {e}"])


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    small = [small_values(i, "cuda") for i in range(COUNT)]
    big, views = packed()
    expect = {name: describe(v) for name, v in views.items()}
    q.put({"small": small, "views": views, "expect": expect})
    errors = list(reply.get(timeout=90))
    torch.cuda.synchronize()
    if big[MIB:MIB + 4].tolist() != [0, 0, 192, 63]:
        errors.append(f"the receiver's write through the float32 view reads as bytes "
                      f"{big[MIB:MIB + 4].tolist()} in the sender's storage")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
