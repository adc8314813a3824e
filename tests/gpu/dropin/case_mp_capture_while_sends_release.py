"""A producer sends CUDA tensors (put, then del), then records CUDA graphs (default global
capture mode) while its consumer drops what it received.

With PyTorch's allocator nothing happens in the producer when the consumer lets go (the
blocks are reclaimed at the producer's next share or ipc_collect), so every capture succeeds
and replays equal eager results.

Why vmm may differ: a vmm send is held until the receiver acknowledges and later reports the
unmap; the producer's background release thread then frees the block, settles/parks/releases
its chunk (driver calls, event records on the block's stream) — possibly while the main thread
is capturing in global mode.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report

MIB = 1 << 20


def consumer(q, got_all, drop, count):
    held = [q.get(timeout=90) for _ in range(count)]
    sums = [float(t.double().sum().item()) for t in held]
    got_all.put(sums)
    drop.wait(120)
    del held
    torch.cuda.synchronize()


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, got_all, drop = ctx.Queue(), ctx.Queue(), ctx.Event()
    sizes = [256] * 150 + [2 * MIB] * 10 + [24 * MIB] * 4
    p = ctx.Process(target=consumer, args=(q, got_all, drop, len(sizes)), daemon=True)
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
    for _ in range(20):
        h = torch.tanh(h @ w)
    ref = h.clone()
    expect = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(i % 7), device="cuda")
        expect.append(float(i % 7) * n)
        q.put(t)
        del t
    errors = []
    sums = got_all.get(timeout=90)
    if sums != expect:
        errors.append("the consumer received other values")
    drop.set()  # the consumer drops everything now; captures start at once
    graphs = []
    for r in range(150):
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                h = x
                for _ in range(20):
                    h = torch.tanh(h @ w)
            g.replay()
            graphs.append((g, h))
            if len(graphs) > 3:
                graphs.pop(0)
        except Exception as e:  # noqa: BLE001
            errors.append(f"capture {r} while the consumer released its tensors: "
                          f"{type(e).__name__}: {str(e)[:300]}")
            torch.cuda.synchronize()
            break
    torch.cuda.synchronize()
    for g, h in graphs:
        if not torch.allclose(h, ref, atol=1e-4):
            errors.append("a replay differs from eager")
            break
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
