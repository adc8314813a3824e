"""CUDA tensors both ways over one duplex multiprocessing Pipe (Connection.send / recv, which
pickle in the calling thread), and ForkingPickler.dumps bytes sent with send_bytes and loaded
with plain pickle.loads (what frameworks that carry tensors over their own transports do).

With PyTorch's allocator Connection.send pickles at once in the caller: the CUDA IPC handle
goes with an IPC event recorded on the caller's current stream, which the receiver's current
stream waits on, so a tensor whose fill is still queued behind a long kernel arrives filled
(the parent never synchronizes before sending); `conn.send(t); del t` is safe (the block
waits in the sender's limbo until the receiver lets go); the child answers with CUDA tensors
of its own, which the parent reads and writes (the child sees the write); bytes from
ForkingPickler.dumps, loaded once with pickle.loads, give tensors over the sender's memory
(two views of one storage arrive sharing it, and the receiver's write shows in the sender).

Why vmm may differ: a pipe's send is no Queue.put: nothing is prepared, the reducer runs in
the caller (it synchronizes the current stream, exports, and holds the send until the
receiver acknowledges); the child imports and exports over one connection; the bytes of
ForkingPickler.dumps are a send that travels opaque, through send_bytes.
"""
import pickle
import sys
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from dropin_report import report

ROUNDS = 4
N = 1 << 16


def child(conn):
    mine = []
    try:
        for i in range(ROUNDS):
            t = conn.recv()
            total = float(t.double().sum().item())
            del t  # before the next round: the parent may get the same block again
            out = torch.full((N,), float(i) + 0.5, device="cuda")
            mine.append(out)
            conn.send((i, total, out))
            if conn.recv() != "wrote":
                raise RuntimeError("protocol")
            torch.cuda.synchronize()
            conn.send(float(out[7].item()))
        obj = pickle.loads(conn.recv_bytes())
        w, view = obj["w"], obj["view"]
        same = w.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
        sums = (float(w.double().sum().item()), float(view.double().sum().item()))
        view.fill_(-3.0)  # w[100:200] in the sender
        torch.cuda.synchronize()
        conn.send(("bytes", same, sums))
        conn.recv()  # the end
        del w, view, obj
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))
    del mine


def main():
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    p = ctx.Process(target=child, args=(child_conn,), daemon=True)
    p.start()
    errors = []
    theirs = []
    for i in range(ROUNDS):
        t = torch.empty(N, device="cuda")
        torch.cuda._sleep(20_000_000)  # the fill below is still queued when send pickles t
        t.fill_(float(i + 1))
        parent_conn.send(t)
        del t
        if not parent_conn.poll(90):
            print(f"FAIL: no answer from the child in round {i}", file=sys.stderr)
            p.kill()
            sys.exit(1)
        answer = parent_conn.recv()
        if answer[0] == "error":
            errors.append(f"the child failed in round {i}: {answer[1][:400]}")
            break
        k, total, out = answer
        if k != i or total != float(i + 1) * N:
            errors.append(f"round {i}: the child read sum {total}, expected {float(i + 1) * N} "
                          f"(a send over a pipe did not carry the queued fill)")
        if not out.is_cuda or tuple(out.shape) != (N,) or \
                not bool((out == float(i) + 0.5).all().item()):
            errors.append(f"round {i}: the child's tensor arrived wrong")
        out[7] = -float(i)
        torch.cuda.synchronize()
        parent_conn.send("wrote")
        seen = parent_conn.recv() if parent_conn.poll(90) else None
        if seen != -float(i):
            errors.append(f"round {i}: the parent's write into the child's tensor is not "
                          f"visible there ({seen})")
        theirs.append(out)
    if not errors:
        w = torch.arange(1000, dtype=torch.float32, device="cuda")
        payload = ForkingPickler.dumps({"w": w, "view": w[100:200]})
        parent_conn.send_bytes(payload)
        answer = parent_conn.recv() if parent_conn.poll(90) else ("error", "no answer")
        if answer[0] == "error":
            errors.append(f"ForkingPickler.dumps bytes: the child failed: {answer[1][:400]}")
        else:
            _, same, sums = answer
            if sums != (float(sum(range(1000))), float(sum(range(100, 200)))):
                errors.append(f"ForkingPickler.dumps bytes: the child read sums {sums}")
            if not same:
                errors.append("ForkingPickler.dumps bytes: two views of one storage arrived in "
                              "different storages")
            torch.cuda.synchronize()
            if not bool((w[100:200] == -3.0).all().item()) or float(w[99].item()) != 99.0:
                errors.append("ForkingPickler.dumps bytes: the child's write through the view "
                              "is not (only) where it belongs in the sender's tensor")
    del theirs
    parent_conn.send("end")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
