"""CUDA nested tensors (torch.nested, ragged batches of sequences) put on a
torch.multiprocessing Queue: the strided layout (a plain torch.Tensor whose is_nested is
True) and the jagged layout (the NestedTensor subclass); and sparse CUDA tensors (COO and
CSR), which PyTorch's reducer also sends as their parts (indices and values).

With PyTorch's allocator both arrive as nested CUDA tensors with the same layout and
components: torch.multiprocessing's reduce_tensor sends a strided nested tensor as its
buffer (nt.values(), a CUDA tensor over the sender's memory) plus its size, stride and
offset metadata (CPU tensors) and rebuilds it from them; a jagged one pickles itself through
its values and offsets, which go as CUDA tensors. (Whether the receiver's nested tensor
aliases the sender's memory differs between PyTorch versions, which rebuild a strided one
with _nested_view_from_buffer or its _copy variant: it is not checked.)

Why vmm may differ: vmm's reducer is registered for torch.Tensor and takes every tensor
whose memory is vmm's, a strided nested tensor included (its layout is torch.strided and it
has a storage), and builds its payload from shape, stride and storage offset, which a nested
tensor does not have; PyTorch's reducer (with its nested-tensor branch) is only used for
memory that is not vmm's. A jagged nested tensor is a subclass that pickles itself through
its values, offsets and lengths: Queue.put's dry run must prepare each of them (a ready event
for what the current stream wrote), or the feeder thread sends them unprepared.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report

NAMES = ("strided", "jagged", "sparse_coo", "sparse_csr")


def components(nt):
    if nt.is_nested:
        return [x.cpu().tolist() for x in nt.unbind()]
    return nt.to_dense().cpu().tolist()


def child(q, reply):
    out = {}
    for expected in NAMES:  # the order they are put in
        name = expected
        try:
            name, nt = q.get(timeout=40)
            if nt is None:
                out[name] = ("not sent", "")
                continue
            seen = (type(nt).__name__, nt.is_nested, str(nt.layout), nt.is_cuda, components(nt))
            out[name] = ("ok", seen)
            del nt
        except Exception as e:  # noqa: BLE001
            out[name] = ("error", f"{type(e).__name__}: {e}")
    reply.put(out)


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    parts = [torch.randn(2, 4), torch.randn(5, 4), torch.randn(3, 4)]
    sent = {
        "strided": torch.nested.nested_tensor(parts, device="cuda"),
        "jagged": torch.nested.nested_tensor(parts, layout=torch.jagged, device="cuda"),
        "sparse_coo": torch.randn(6, 5, device="cuda").relu().to_sparse(),
        "sparse_csr": torch.randn(6, 5, device="cuda").relu().to_sparse_csr(),
    }
    expect = {name: (type(nt).__name__, nt.is_nested, str(nt.layout), True, components(nt))
              for name, nt in sent.items()}
    errors = []
    for name, nt in sent.items():
        try:
            q.put((name, nt))
        except Exception as e:  # noqa: BLE001
            errors.append(f"{name}: Queue.put of a CUDA nested tensor raised "
                          f"{type(e).__name__}: {str(e)[:300]}")
            q.put((name, None))
    got = reply.get(timeout=90)
    for name, want in expect.items():
        status, seen = got.get(name, ("missing", ""))
        if status == "not sent":
            continue
        if status != "ok":
            errors.append(f"{name}: the receiver got {status}: {str(seen)[:400]}")
            continue
        if seen[:4] != want[:4]:
            errors.append(f"{name}: arrived as (type, is_nested, layout, is_cuda) {seen[:4]}, "
                          f"sent {want[:4]}")
        elif seen[4] != want[4]:
            errors.append(f"{name}: the components arrived with other values")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
