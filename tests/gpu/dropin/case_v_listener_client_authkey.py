"""CUDA tensors over multiprocessing.connection Listener / Client with an authkey: the parent
listens on an AF_UNIX socket, two spawned children connect to it (each proving the key), and
tensors go both ways with Connection.send / recv (which pickle with ForkingPickler in the
calling thread): what actor frameworks and hand-written parameter servers do instead of
Queues.

With PyTorch's allocator: each child receives, in one message, a tensor both children get
(each writes its own slice of it), a tensor of its own (which it doubles in place), and two
views of one storage (a slice at offset 1000 and a column of a transposed 256 x 256 view, both
over element 1000) that arrive with their values, sharing one storage (the child's write
through the slice is read through the column); then a tensor the parent deleted right after
sending it (`conn.send(t); del t`), with its values. Every write of the children is in the
parent's tensors. Each child answers with a CUDA tensor of its own, which the parent reads
and writes (the child sees the write). Once the children dropped what they received, the
parent's memory_allocated() comes back to where it was before the deleted tensors were sent
(torch.cuda.ipc_collect() polled for up to 15 s).

Why vmm may differ: Connection objects made by Listener.accept() / Client() are no Pipe: the
send runs vmm's reducer in the caller (it synchronizes the current stream and exports) over a
socket of another family, to two receivers of one storage; the children answer over the same
connections (each child both imports and exports); a send whose tensor is deleted at once is
held until its receiver acknowledges.
"""
import gc
import secrets
import sys
import threading
from multiprocessing.connection import Client, Listener

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

N = 1 << 16
CLIENTS = 2


def client(address, authkey, rank):
    conn = Client(address, authkey=authkey)
    conn.send(("hello", rank))
    try:
        shared, own, views, expect = conn.recv()
        errs = []
        # (the other child may already have written its own slice)
        if tuple(shared.shape) != (N,) or \
                not bool((shared[CLIENTS * 100:] == 1.0).all().item()) or \
                not bool((shared[rank * 100:(rank + 1) * 100] == 1.0).all().item()):
            errs.append(f"child {rank}: the shared tensor arrived wrong")
        if tuple(own.shape) != (N,) or not bool((own == float(rank + 1)).all().item()):
            errs.append(f"child {rank}: its own tensor arrived wrong")
        for name, (shape, stride, offset, values) in expect.items():
            v = views[name]
            got = (tuple(v.shape), v.stride(), v.storage_offset())
            if got != (shape, stride, offset):
                errs.append(f"child {rank}: view {name} arrived as {got}, sent "
                            f"{(shape, stride, offset)}")
            elif v.cpu().tolist() != values:
                errs.append(f"child {rank}: view {name} arrived with other values")
            del v
        a, b = views["slice"], views["column"]
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            errs.append(f"child {rank}: two views of one storage arrived in different storages")
        a[0] = -1.0 - rank  # element 1000 of the parent's tensor, b[3] too
        torch.cuda.synchronize()
        if float(b[3].item()) != -1.0 - rank:
            errs.append(f"child {rank}: a write through the slice is not in the column view")
        t = conn.recv()
        want = (5.0 + rank) * (N - 1) - 1.0
        total = float(t.double().sum().item())
        if tuple(t.shape) != (N,) or total != want:
            errs.append(f"child {rank}: the tensor deleted after send sums to {total}, "
                        f"expected {want}")
        del t
        shared[rank * 100:(rank + 1) * 100].fill_(10.0 + rank)
        own.mul_(2.0)
        torch.cuda.synchronize()
        mine = torch.full((N,), 100.0 + rank, device="cuda")
        conn.send(("ok", errs, mine))
        if conn.recv() != "check":
            raise RuntimeError("protocol: expected check")
        torch.cuda.synchronize()
        conn.send(("seen", float(mine[0].item()), float(mine[1].item())))
        if conn.recv() != "drop":
            raise RuntimeError("protocol: expected drop")
        del shared, own, views, a, b, mine
        gc.collect()
        torch.cuda.synchronize()
        conn.send(("dropped",))
        conn.recv()  # "end"
    except Exception as e:  # noqa: BLE001
        try:
            conn.send(("error", f"child {rank}: {type(e).__name__}: {e}", None))
        except Exception:  # noqa: BLE001
            pass
    conn.close()


def accept_all(listener, n, seconds):
    conns = []

    def run():
        for _ in range(n):
            conns.append(listener.accept())

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    return list(conns)


def expect_msg(conn, what):
    if not conn.poll(90):
        raise RuntimeError(f"no {what} from a child in 90 s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1][:600])
    if msg[0] != what:
        raise RuntimeError(f"expected {what}, got {str(msg)[:200]}")
    return msg


def describe(v):
    return (tuple(v.shape), v.stride(), v.storage_offset(), v.cpu().tolist())


def main():
    ctx = mp.get_context("spawn")
    authkey = secrets.token_bytes(16)
    listener = Listener(family="AF_UNIX", authkey=authkey)
    procs = [ctx.Process(target=client, args=(listener.address, authkey, r), daemon=True)
             for r in range(CLIENTS)]
    for p in procs:
        p.start()
    errors = []
    conns = accept_all(listener, CLIENTS, 60)
    if len(conns) != CLIENTS:
        for p in procs:
            p.kill()
        print(f"FAIL: {len(conns)} of {CLIENTS} children connected in 60 s", file=sys.stderr)
        sys.exit(1)
    by_rank = {}
    try:
        for conn in conns:
            by_rank[expect_msg(conn, "hello")[1]] = conn
        if sorted(by_rank) != list(range(CLIENTS)):
            raise RuntimeError(f"children said ranks {sorted(by_rank)}")
        shared = torch.ones(N, device="cuda")
        own = [torch.full((N,), float(r + 1), device="cuda") for r in range(CLIENTS)]
        bigs = [torch.arange(N, dtype=torch.float32, device="cuda") for _ in range(CLIENTS)]
        views = [{"slice": big[1000:2000], "column": big.view(256, 256).t()[232]}
                 for big in bigs]
        expect = [{k: describe(v) for k, v in d.items()} for d in views]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for r in range(CLIENTS):
            by_rank[r].send((shared, own[r], views[r], expect[r]))
        for r in range(CLIENTS):
            t = torch.full((N,), 5.0 + r, device="cuda")
            t[-1] = -1.0
            by_rank[r].send(t)
            del t
        mine = {}
        for r in range(CLIENTS):
            _, errs, m = expect_msg(by_rank[r], "ok")
            errors += errs
            mine[r] = m
        torch.cuda.synchronize()
        want = torch.ones(N, device="cuda")
        for r in range(CLIENTS):
            want[r * 100:(r + 1) * 100] = 10.0 + r
        if not torch.equal(shared, want):
            errors.append("the children's writes into the shared tensor are not (only) where "
                          "they belong in the parent's tensor")
        del want
        for r in range(CLIENTS):
            if not bool((own[r] == 2.0 * (r + 1)).all().item()):
                errors.append(f"child {r}'s in-place doubling is not in the parent's tensor")
            m = mine[r]
            if not m.is_cuda or tuple(m.shape) != (N,) or \
                    not bool((m == 100.0 + r).all().item()):
                errors.append(f"child {r}'s tensor arrived wrong in the parent")
            m[0] = -7.0 - r
            del m
            if float(bigs[r][1000].item()) != -1.0 - r or float(bigs[r][999].item()) != 999.0:
                errors.append(f"child {r}'s write through a view: the parent reads "
                              f"{bigs[r][998:1002].tolist()}")
        torch.cuda.synchronize()
        for r in range(CLIENTS):
            by_rank[r].send("check")
        for r in range(CLIENTS):
            _, first, second = expect_msg(by_rank[r], "seen")
            if (first, second) != (-7.0 - r, 100.0 + r):
                errors.append(f"the parent's write into child {r}'s tensor reads as "
                              f"{(first, second)} there")
        del mine
        gc.collect()
        for r in range(CLIENTS):
            by_rank[r].send("drop")
        for r in range(CLIENTS):
            expect_msg(by_rank[r], "dropped")
        error = memory_back_error(base, "children")
        if error:
            errors.append(error)
        for r in range(CLIENTS):
            by_rank[r].send("end")
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
        for p in procs:
            p.kill()
    for p in procs:
        p.join(30)
    for conn in conns:
        conn.close()
    listener.close()
    report(errors)


if __name__ == "__main__":
    main()
