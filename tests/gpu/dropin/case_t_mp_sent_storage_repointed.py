"""CUDA tensors sent to another process whose storages are not plain allocations of the
tensor's own, or that the sender re-points right after sending, before the receiver has read
them: what weight-sync code of colocated RL trainers and interop code do.

One torch.multiprocessing Queue message carries:
 - "raw": a tensor over a raw block of torch.cuda.caching_allocator_alloc, wrapped without a
   copy by torch._C._construct_storage_from_data_pointer (a non-owning storage), as CuPy or
   Numba memory taken from PyTorch's allocator comes back into torch;
 - "alias": torch.from_dlpack(base) of a whole tensor (a storage of its own over base's block);
 - "param": an nn.Parameter whose storage the sender then frees with
   untyped_storage().resize_(0) and allocates again with resize_(nbytes), as FSDP frees and
   re-gathers unsharded parameters (a trainer that shared its gathered weights with an
   inference process and reshards before the copy is done);
 - "swap": an nn.Parameter whose .data the sender then replaces (param.data = new);
 - "set": a tensor the sender then detaches from its memory with t.set_().
After the receiver has unpickled the message (it answers), the sender re-points those tensors,
drops base and the alias, allocates and fills 256 MiB of other tensors, and only then lets
the receiver read.

With PyTorch's allocator a sent storage is the block itself (CUDA IPC of its segment, the
storage's deleter wrapped in a reference-counted context): whatever the sender does to its
tensors afterwards, the block stays allocated while the receiver holds it (PyTorch's "limbo"),
so the receiver reads every value as it was sent (3, 5, 7, 9, 11), its write through "raw"
shows in the sender's raw block, and its write through "param" does not show in the sender's
re-allocated parameter (8 there), nor does the sender's fill of new memory show in the
receiver; once the receiver drops everything and the sender deletes the raw block,
memory_allocated() is back where it was (ipc_collect() polled, sender_memory.py).

Why vmm may differ: vmm's reducer finds the memory to send by the storage's address (a raw
block, or another tensor's block for the DLPack alias) and holds it until the receiver
acknowledges, then frees a block whose tensor is gone while the chunk stays exported; a
storage re-pointed after the send (resize_, .data =, set_()) frees the block through the
allocator while a receiver still maps it, and the new block must land elsewhere.
"""
import gc
import sys

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20
N = MIB  # float32 elements: 4 MiB each
TIMEOUT = 60
VALUES = {"raw": 3.0, "alias": 5.0, "param": 7.0, "swap": 9.0, "set": 11.0}


def receiver(q, reply, go_read, go_drop):
    try:
        msg = q.get(timeout=TIMEOUT)
        reply.put("received")
        go_read.wait(TIMEOUT)
        torch.cuda.synchronize()
        seen = {}
        for name, t in msg.items():
            seen[name] = [type(t).__name__, t.numel(), float(t.min().item()),
                          float(t.max().item())]
        msg["raw"][:16] = -1.0
        msg["param"].data[0] = -1.0
        torch.cuda.synchronize()
        reply.put(("seen", seen))
        go_drop.wait(TIMEOUT)
        del msg, t
        gc.collect()
        torch.cuda.synchronize()
        reply.put("dropped")
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {str(e)[:400]}"))


def answer(reply, p, what):
    try:
        return reply.get(timeout=TIMEOUT)
    except Exception:  # noqa: BLE001
        print(f"FAIL: no answer from the receiver ({what}); alive: {p.is_alive()}",
              file=sys.stderr)
        p.kill()
        sys.exit(1)


def wrap_raw(ptr, nbytes):
    dev = torch.device("cuda", torch.cuda.current_device())
    storage = torch._C._construct_storage_from_data_pointer(ptr, dev, nbytes)
    return torch.empty(0, dtype=torch.float32, device=dev).set_(storage, 0, (nbytes // 4,),
                                                                (1,))


def main():
    errors = []
    ctx = mp.get_context("spawn")
    q, reply, go_read, go_drop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=receiver, args=(q, reply, go_read, go_drop), daemon=True)
    p.start()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated()

    ptr = torch.cuda.caching_allocator_alloc(4 * N)
    raw = wrap_raw(ptr, 4 * N)
    raw.fill_(VALUES["raw"])
    base = torch.full((N,), VALUES["alias"], device="cuda")
    alias = torch.from_dlpack(base)
    param = torch.nn.Parameter(torch.full((N,), VALUES["param"], device="cuda"))
    swap = torch.nn.Parameter(torch.full((N,), VALUES["swap"], device="cuda"))
    detached = torch.full((N,), VALUES["set"], device="cuda")
    torch.cuda.synchronize()
    q.put({"raw": raw, "alias": alias, "param": param, "swap": swap, "set": detached})
    got = answer(reply, p, "the message")
    if got != "received":
        print(f"FAIL: the receiver failed: {got}", file=sys.stderr)
        sys.exit(1)

    # Re-point everything the receiver has not read yet.
    nbytes = param.untyped_storage().nbytes()
    param.untyped_storage().resize_(0)
    param.untyped_storage().resize_(nbytes)
    param.data.fill_(8.0)
    swap.data = torch.full((N,), 10.0, device="cuda")
    detached.set_()
    del base, alias
    gc.collect()
    other = [torch.full((16 * MIB,), 42.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    go_read.set()
    got = answer(reply, p, "the reads")
    if got[0] == "error":
        errors.append(f"the receiver failed reading: {got[1]}")
    else:
        seen = got[1]
        for name, value in VALUES.items():
            want_type = "Parameter" if name in ("param", "swap") else "Tensor"
            if seen.get(name) != [want_type, N, value, value]:
                errors.append(f"{name!r} reached the receiver as {seen.get(name)} "
                              f"([type, numel, min, max]), sent as {[want_type, N, value, value]}")
        torch.cuda.synchronize()
        if not bool((raw[:16] == -1.0).all().item()) or float(raw[16].item()) != 3.0:
            errors.append("the receiver's write through the raw block's tensor is not (only) "
                          "where it belongs in the sender's raw block")
        if float(param[0].item()) != 8.0 or float(swap[0].item()) != 10.0:
            errors.append(f"the sender's re-allocated parameters read {float(param[0].item())} "
                          f"and {float(swap[0].item())}, expected 8.0 and 10.0")
        if any(float(t.min().item()) != 42.0 or float(t.max().item()) != 42.0 for t in other):
            errors.append("the sender's own new tensors changed")
    go_drop.set()
    got = answer(reply, p, "the drop")
    if got != "dropped":
        errors.append(f"the receiver failed dropping the message: {got}")
    del raw, param, swap, detached, other
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.caching_allocator_delete(ptr)
    err = memory_back_error(base_alloc, "receiver")
    if err:
        errors.append(err)
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
