"""A captured CUDA graph's static output is sent to another process once (a logger gets
the first result); later replays must still update that output tensor.

With PyTorch's allocator sending a tensor does not move it: after static_in is refilled and
the graph replayed, static_out holds the new result.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): Queue.put moves a tensor that shares a physical chunk with another live
tensor (here the graph's second output in the same private-pool chunk) into memory of its
own and swaps the storage; the graph keeps writing to the old address, so static_out stops
following replays.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report


def child(q, reply):
    t = q.get(timeout=60)
    reply.put(float(t.sum().item()))
    del t


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    static_in = torch.ones(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            static_in * 2 + 1, static_in * 3
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = static_in * 2 + 1
        static_aux = static_in * 3
    g.replay()
    torch.cuda.synchronize()
    errors = []
    q.put(static_out)
    first = reply.get(timeout=90)
    if first != 3.0 * 1024:
        errors.append(f"the receiver got sum {first}, expected {3.0 * 1024}")
    for value in (5.0, -2.0, 0.5):
        static_in.fill_(value)
        g.replay()
        torch.cuda.synchronize()
        got = float(static_out[0].item())
        aux = float(static_aux[0].item())
        if got != value * 2 + 1:
            errors.append(f"after replay with input {value}: static_out[0] = {got}, expected "
                          f"{value * 2 + 1} (the output tensor no longer follows the graph)")
        if aux != value * 3:
            errors.append(f"after replay with input {value}: static_aux[0] = {aux}")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
