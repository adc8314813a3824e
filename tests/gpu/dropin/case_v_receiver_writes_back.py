"""A receiver that writes into the CUDA tensors it received, with kernels of several kinds,
and the sender reading the results, in three rounds of a Queue handshake over the same
tensors (a worker that fills output buffers its parent owns: shared replay buffers, result
slots, gradient accumulators).

The parent sends once (a SimpleQueue): a 64 MiB float32 buffer, a 256 x 256 block of rows
8..263 of a 272 x 256 matrix (a contiguous slice at an offset), an int64 counter vector, a
float16 vector and an int32 vector. Each round k the parent fills the buffer with k and the
matrix block with k * identity, synchronizes and says go; the child checks what it reads,
then writes: add_(1) over the whole buffer, torch.mm(..., out=block), index_add_ into the
counters, a copy_ on a side stream of its own into the float16 vector, scatter_ into every
third int32; synchronizes and answers.

With PyTorch's allocator CUDA IPC shares the memory both ways: the child reads each round's
values, and the parent, after the answer and torch.cuda.synchronize(), reads every write of
the child (k + 1 everywhere in the buffer, k + 1 in the block and its rows 0..7 untouched,
the counters at 10 * (k + 1), the float16 vector at k + 0.5, every third int32 at k + 7 and
the others at -1).

Why vmm may differ: the receiver's kernels (a cuBLAS GEMM writing its output, index_add_'s
atomics, a copy on a stream the receiver made) write memory it imported; the sender's own
kernels rewrite it between rounds; the mapping must be the sender's memory and stay so.
"""
import torch
import torch.multiprocessing as mp
from dropin_report import report

BUF = 16 << 20  # float32 elements: 64 MiB
ROUNDS = 3


def child(sq, ctl, reply):
    try:
        buf, block, counts, half, ints = sq.get()
        side = torch.cuda.Stream()
        idx = torch.arange(1000, device="cuda") % 100
        for k in range(ROUNDS):
            msg = ctl.get(timeout=60)
            if msg != ("go", k):
                raise RuntimeError(f"protocol: {msg}")
            errs = []
            if not bool((buf == float(k)).all().item()):
                errs.append(f"round {k}: the child does not read {k} in the whole buffer")
            eye = torch.eye(256, device="cuda")
            if not torch.equal(block, eye * k):
                errs.append(f"round {k}: the child does not read {k} * identity in the block")
            buf.add_(1.0)
            torch.mm(torch.full((256, 256), k + 1.0, device="cuda"), eye, out=block)
            counts.index_add_(0, idx, torch.ones(1000, dtype=torch.int64, device="cuda"))
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                half.copy_(torch.full((half.numel(),), k + 0.5, dtype=torch.float16,
                                      device="cuda"))
            ints.scatter_(0, torch.arange(0, 1000, 3, device="cuda"),
                          torch.full((334,), k + 7, dtype=torch.int32, device="cuda"))
            torch.cuda.synchronize()
            del eye
            reply.put(("done", k, errs))
        if ctl.get(timeout=60) != "end":
            raise RuntimeError("protocol: expected end")
        del buf, block, counts, half, ints
    except Exception as e:  # noqa: BLE001
        reply.put(("error", -1, [f"the child failed: {type(e).__name__}: {e}"]))


def main():
    ctx = mp.get_context("spawn")
    sq, ctl, reply = ctx.SimpleQueue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(sq, ctl, reply), daemon=True)
    p.start()
    buf = torch.zeros(BUF, device="cuda")
    mat = torch.full((272, 256), -3.0, device="cuda")
    block = mat[8:264]
    counts = torch.zeros(100, dtype=torch.int64, device="cuda")
    half = torch.zeros(4099, dtype=torch.float16, device="cuda")
    ints = torch.full((1000,), -1, dtype=torch.int32, device="cuda")
    sq.put((buf, block, counts, half, ints))
    errors = []
    eye = torch.eye(256, device="cuda")
    every_third = torch.arange(1000, device="cuda") % 3 == 0
    for k in range(ROUNDS):
        buf.fill_(float(k))
        block.copy_(eye * k)
        torch.cuda.synchronize()
        ctl.put(("go", k))
        kind, got_k, errs = reply.get(timeout=90)
        errors += errs
        if kind != "done" or got_k != k:
            break
        torch.cuda.synchronize()
        if not bool((buf == float(k + 1)).all().item()):
            errors.append(f"round {k}: the child's add_ over the buffer is not in the parent's "
                          f"(reads {buf[0].item()} .. {buf[-1].item()})")
        if not bool((block == float(k + 1)).all().item()) or \
                not bool((mat[:8] == -3.0).all().item()) or \
                not bool((mat[264:] == -3.0).all().item()):
            errors.append(f"round {k}: the child's mm(out=) into rows 8..263 is not (only) there "
                          f"in the parent's matrix")
        if not bool((counts == 10 * (k + 1)).all().item()):
            errors.append(f"round {k}: the child's index_add_ reads as {counts[:4].tolist()}")
        if not bool((half == k + 0.5).all().item()):
            errors.append(f"round {k}: the child's side-stream copy reads as "
                          f"{half[:4].tolist()}")
        want_ints = torch.where(every_third, k + 7, -1).to(torch.int32)
        if not torch.equal(ints, want_ints):
            errors.append(f"round {k}: the child's scatter_ reads as {ints[:6].tolist()}")
        del want_ints
        if errors:
            break
    ctl.put("end")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
