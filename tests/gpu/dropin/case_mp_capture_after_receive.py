"""A consumer receives small CUDA tensors from a producer, uses and drops them, and then
captures a CUDA graph (default "global" capture mode), several rounds (an RL learner that
consumes rollouts and then records a graph).

With PyTorch's allocator a received tensor's memory is closed when the tensor is dropped, in
the dropping thread; nothing runs in the background, and every capture succeeds and its
replay equals the eager result.

Why vmm may differ: vmm closes imports of up to 16 MiB on a background thread
(import_closer.h) that synchronizes the device (cuCtxSynchronize) and unmaps; if that runs
while the main thread captures in global mode, the synchronization is a prohibited call
during capture (the capture can be invalidated, or the close fails and the mapping leaks).
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report

N_PER_ROUND = 150
ROUNDS = 6


def producer(q, done):
    for r in range(ROUNDS):
        for i in range(N_PER_ROUND):
            q.put(torch.full((256,), float(r * N_PER_ROUND + i), device="cuda"))
    done.wait(120)


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=producer, args=(q, done), daemon=True)
    p.start()
    x = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda") / 16
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.tanh(x @ w)
    torch.cuda.current_stream().wait_stream(s)
    h = x
    for _ in range(40):
        h = torch.tanh(h @ w)
    ref = h.clone()
    errors = []
    graphs = []
    for r in range(ROUNDS):
        got = [q.get(timeout=90) for _ in range(N_PER_ROUND)]
        vals = [float(t[0].item()) for t in got]
        if vals != [float(r * N_PER_ROUND + i) for i in range(N_PER_ROUND)]:
            errors.append(f"round {r}: received values differ")
        del got  # dropping the received tensors
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                h = x
                for _ in range(40):
                    h = torch.tanh(h @ w)
            g.replay()
            torch.cuda.synchronize()
            if not torch.allclose(h, ref, atol=1e-4):
                errors.append(f"round {r}: replay differs from eager")
            graphs.append((g, h))
        except Exception as e:  # noqa: BLE001
            errors.append(f"round {r}: capture after dropping received tensors failed: "
                          f"{type(e).__name__}: {str(e)[:300]}")
            torch.cuda.synchronize()
    done.set()
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
