"""CUDA tensors that require grad, sent where the caller pickles (ForkingPickler.dumps,
Connection.send over a Pipe, SimpleQueue.put, Process arguments at start()): leaves go,
non-leaves are refused.

With PyTorch's allocator (torch/multiprocessing/reductions.py, reduce_tensor): a non-leaf
that requires grad (the output of an op on a leaf, a slice of a leaf, a view of an
nn.Parameter), alone or inside a dict with tensors that could go, raises RuntimeError whose
message starts "Cowardly refusing to serialize non-leaf tensor which requires_grad" (programs
match that text: torchrl's collectors turn it into their own advice) in the caller, before
anything is written: the Pipe and the SimpleQueue stay usable and the receiver never sees the
refused message, and a Process whose arguments hold one does not start. A leaf that requires
grad arrives as a leaf with requires_grad True and no grad (the sender's .grad, set by a
backward, stays in the sender); an nn.Parameter with requires_grad False arrives as one; the
same slice taken under torch.no_grad() (a leaf, whatever its requires_grad) and a detach()ed
output go. The
receiver's backward through its leaf fills its own .grad (2 * x) and leaves the sender's grad
as it was; the receiver's in-place update of the leaf's data (under no_grad) shows in the
sender.

Why vmm may differ: vmm's reducer replaces PyTorch's for CUDA tensors of its memory, and has
its own refusal of non-leaf tensors (its own message), checked in Queue.put's preparation and
in the reducer; a refused send must leave no half-written message behind.
"""
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from dropin_report import report

PREFIX = "Cowardly refusing to serialize non-leaf tensor which requires_grad"


def child(conn, sq):
    try:
        first = conn.recv()
        if first[0] != "leaves":
            raise RuntimeError(f"the first message on the pipe is {first[0]!r}")
        d = first[1]
        info = {k: (type(v).__name__, v.requires_grad, v.is_leaf, v.grad is None,
                    v.detach().cpu().tolist()) for k, v in d.items()}
        x = d["leaf"]
        (x * x).sum().backward()
        grad = x.grad.cpu().tolist()
        with torch.no_grad():
            x.add_(1.0)
        torch.cuda.synchronize()
        conn.send(("info", info, grad))
        second = sq.get()
        conn.send(("sq", second[0], second[1].detach().cpu().tolist()))
        conn.recv()  # end
        del d, x, first, second
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))


def never_started(t):
    pass


def refused(errors, label, send):
    """`send()` must raise PyTorch's RuntimeError for a non-leaf that requires grad."""
    try:
        send()
    except RuntimeError as e:
        if not str(e).startswith(PREFIX):
            errors.append(f"{label}: RuntimeError {str(e)[:200]!r}, PyTorch says "
                          f"{PREFIX!r}...")
        return
    except Exception as e:  # noqa: BLE001
        errors.append(f"{label}: raised {type(e).__name__}: {str(e)[:200]}, PyTorch raises "
                      f"RuntimeError {PREFIX!r}...")
        return
    errors.append(f"{label}: sent without error; PyTorch refuses a non-leaf that requires grad")


def main():
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    sq = ctx.SimpleQueue()
    p = ctx.Process(target=child, args=(child_conn, sq), daemon=True)
    p.start()
    errors = []
    leaf = torch.arange(8, dtype=torch.float32, device="cuda").requires_grad_()
    (leaf * 3).sum().backward()  # the sender's grad: 3 everywhere
    frozen = torch.nn.Parameter(torch.ones(3, device="cuda"), requires_grad=False)
    param = torch.nn.Parameter(torch.full((4, 4), 2.0, device="cuda"))
    out = leaf * 2
    non_leaves = {"output": out, "slice": leaf[2:5], "param_view": param[1]}
    for name, t in non_leaves.items():
        if not (t.requires_grad and not t.is_leaf):
            errors.append(f"test setup: {name} is not a non-leaf that requires grad")
    with torch.no_grad():
        quiet_slice = leaf[2:5]
    if not quiet_slice.is_leaf:
        errors.append("test setup: a slice taken under no_grad is not a leaf")
    for name, t in non_leaves.items():
        refused(errors, f"ForkingPickler.dumps({name})", lambda t=t: ForkingPickler.dumps(t))
        refused(errors, f"Connection.send({name})", lambda t=t: parent_conn.send(t))
        refused(errors, f"SimpleQueue.put({name})", lambda t=t: sq.put(t))
    del t
    refused(errors, "Connection.send(a dict with a non-leaf)",
            lambda: parent_conn.send({"bad": out, "ok": quiet_slice, "more": frozen}))
    bad_proc = ctx.Process(target=never_started, args=(out,), daemon=True)
    refused(errors, "Process(args=(non-leaf,)).start()", bad_proc.start)
    if bad_proc.pid is not None:
        errors.append("a Process whose arguments hold a non-leaf started anyway")
        bad_proc.kill()
    parent_conn.send(("leaves", {"leaf": leaf, "frozen": frozen, "param": param,
                                 "quiet_slice": quiet_slice, "detached": out.detach()}))
    sq.put(("second", out.detach() + 1))
    if not parent_conn.poll(90):
        errors.append("no answer from the receiver in 90 s")
        p.kill()
        report(errors)
    msg = parent_conn.recv()
    if msg[0] != "info":
        errors.append(f"the receiver: {str(msg)[:600]}")
    else:
        _, info, grad = msg
        want = {
            "leaf": ("Tensor", True, True, True, [float(v) for v in range(8)]),
            "frozen": ("Parameter", False, True, True, [1.0] * 3),
            "param": ("Parameter", True, True, True, [[2.0] * 4] * 4),
            # a view made under no_grad is a leaf; its requires_grad follows its base's
            "quiet_slice": ("Tensor", quiet_slice.requires_grad, True, True, [2.0, 3.0, 4.0]),
            "detached": ("Tensor", False, True, True, [2.0 * v for v in range(8)]),
        }
        for k, w in want.items():
            if info.get(k) != w:
                errors.append(f"{k} arrived as (type, requires_grad, is_leaf, grad is None, "
                              f"values) {info.get(k)}, expected {w}")
        if grad != [2.0 * v for v in range(8)]:
            errors.append(f"the receiver's backward gave grad {grad}, expected 2 * x")
        torch.cuda.synchronize()
        if leaf.grad is None or leaf.grad.tolist() != [3.0] * 8:
            errors.append(f"the sender's grad is {leaf.grad}, was 3 everywhere before")
        if leaf.detach().tolist() != [v + 1.0 for v in range(8)]:
            errors.append(f"the receiver's in-place update of the leaf reads as "
                          f"{leaf.detach().tolist()} in the sender")
        if not parent_conn.poll(90):
            errors.append("no second answer from the receiver in 90 s")
        else:
            msg = parent_conn.recv()
            if msg[0] != "sq" or msg[1] != "second" or \
                    msg[2] != [2.0 * v + 1.0 for v in range(8)]:
                errors.append(f"the SimpleQueue's next message after the refused ones "
                              f"arrived as {str(msg)[:300]}")
    parent_conn.send("end")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
