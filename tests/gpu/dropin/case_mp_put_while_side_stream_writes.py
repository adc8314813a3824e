"""Queue.put of a CUDA tensor that a side stream is still writing (recorded with
record_stream); the sender synchronizes afterwards.

With PyTorch's allocator the tensor does not move: once the sender has synchronized, its own
tensor holds what the side stream wrote, and so does the receiver's (same memory), read after
an Event the sender sets once synchronized.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): Queue.put moves a small tensor that shares a physical chunk into memory
of its own (sharing.relocate_storage): the bytes are copied on the *current* stream, which
does not wait for the side stream, and the storage is swapped; the side stream's pending
write lands in the old block. The sender's own tensor then loses the write.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report

N = 4096


def child(q, go, reply):
    t = q.get(timeout=60)
    if not go.wait(60):
        reply.put("timeout")
        return
    torch.cuda.synchronize()
    reply.put(float(t.sum().item()))
    del t


def main():
    ctx = mp.get_context("spawn")
    q, reply, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, go, reply), daemon=True)
    p.start()
    before = [torch.ones(1024, device="cuda") for _ in range(8)]  # neighbours in one chunk
    t = torch.zeros(N, device="cuda")
    after = [torch.ones(1024, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the write below is still pending at put
        t.fill_(1.0)
    t.record_stream(side)
    q.put(t)
    torch.cuda.synchronize()
    local = float(t.sum().item())
    go.set()
    remote = reply.get(timeout=90)
    p.join(30)
    errors = []
    if local != float(N):
        errors.append(f"the sender's own tensor sums to {local} after synchronize, expected {N} "
                      f"(the side stream's write was lost)")
    if remote != float(N):
        errors.append(f"the receiver's tensor sums to {remote}, expected {N}")
    del before, after
    report(errors)


if __name__ == "__main__":
    main()
