"""torch.multiprocessing.reductions.reduce_tensor called directly: the "CUDA IPC handle"
pattern RLHF frameworks use to hand training weights to a colocated inference engine
(OpenRLHF / verl / vLLM's update_weights_from_ipc_handles: `func, args = reduce_tensor(w)`,
send (func, args), the other process calls `func(*args)`).

With PyTorch's allocator: the receiver rebuilds the tensor over the same memory, reads the
weights, writes to them (the sender sees it), for a parameter, a slice with an offset and a
bf16 tensor.

Why vmm may differ: vmm replaces the ForkingPickler reducer, but PyTorch's reduce_tensor
still calls storage._share_cuda_(), which asks the current CUDA allocator for an IPC handle
(shareIpcHandle / cudaIpcGetMemHandle) of memory vmm made with cuMemCreate.
"""
import sys

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor
from dropin_report import report


def child(conn):
    handles = conn.recv()
    ts = [func(*args) for func, args in handles]
    conn.send([float(t.float().sum().item()) for t in ts])
    for t in ts:
        t.add_(1)
    torch.cuda.synchronize()
    conn.send("written")
    conn.recv()  # the sender has checked; drop the tensors and exit
    del ts


def main():
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    p = ctx.Process(target=child, args=(child_conn,), daemon=True)
    p.start()
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256).cuda()
    big = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    tensors = [layer.weight.detach(), big[1000:5000],
               torch.full((4096,), 0.5, dtype=torch.bfloat16, device="cuda")]
    expect = [float(t.float().sum().item()) for t in tensors]
    errors = []
    try:
        handles = [reduce_tensor(t) for t in tensors]
    except Exception as e:  # noqa: BLE001
        print(f"FAIL: reduce_tensor of a CUDA tensor raised {type(e).__name__}: {e}",
              file=sys.stderr)
        p.kill()
        sys.exit(1)
    torch.cuda.synchronize()
    parent_conn.send(handles)
    if not parent_conn.poll(90):
        print("FAIL: the receiver did not answer", file=sys.stderr)
        p.kill()
        sys.exit(1)
    got = parent_conn.recv()
    for g, e in zip(got, expect):
        if abs(g - e) > 1e-3 * max(1.0, abs(e)):
            errors.append(f"receiver read sum {g}, expected {e}")
    if parent_conn.poll(90) and parent_conn.recv() == "written":
        after = [float(t.float().sum().item()) for t in tensors]
        for a, e, t in zip(after, expect, tensors):
            if abs(a - (e + t.numel())) > 1e-4 * abs(e + t.numel()) + 1.0:
                errors.append(f"the receiver's write is not visible to the sender: {a} vs "
                              f"{e + t.numel()}")
    else:
        errors.append("the receiver did not write")
    parent_conn.send("done")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
