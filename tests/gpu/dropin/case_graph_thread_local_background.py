"""CUDA graphs captured in "thread_local" mode (what torch.compile's CUDA graph trees use)
while a background thread keeps allocating, copying host batches non_blocking and computing
on its own stream (a prefetcher).

With PyTorch's allocator the background thread's allocations go to the ordinary pool (it
may even call cudaMalloc meanwhile: thread_local capture allows other threads' unsafe
calls), every capture succeeds, replays equal eager results, and the prefetched batches are
right.

Why vmm may differ: vmm grows the pool (cuMemCreate/cuMemMap/cuMemSetAccess) from the
background thread during the capture, queries and records events for its free lists, and
must not route the background thread's allocations to the graph's private pool.
"""
import sys
import threading
import time

import torch

MIB = 1 << 20


def prefetcher(stop, errors, counter, progress):
    stream = torch.cuda.Stream()
    host = [torch.full((n,), float(i + 1)).pin_memory()
            for i, n in enumerate((1 << 10, 1 << 16, 1 << 20, 3 << 20))]
    i = 0
    try:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                k = i % len(host)
                dev = host[k].cuda(non_blocking=True)
                big = torch.empty((8 + (i % 5) * 8) * MIB, dtype=torch.uint8, device="cuda")
                big.fill_(1)
                s = (dev * 2).sum()
                stream.synchronize()
                want = 2.0 * (k + 1) * host[k].numel()
                if abs(float(s.item()) - want) > 1e-6 * want + 1e-3:
                    errors.append(f"prefetch {i}: sum {float(s.item())}")
                    return
                del dev, big, s
                i += 1
                progress[0] = i
    except Exception as e:  # noqa: BLE001
        errors.append(f"prefetcher: {type(e).__name__}: {e}")
    counter.append(i)


def main():
    torch.manual_seed(0)
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.tanh(x @ w) @ w
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    errors, counter, progress = [], [], [0]
    stop = threading.Event()
    th = threading.Thread(target=prefetcher, args=(stop, errors, counter, progress))
    th.start()
    deadline = time.monotonic() + 10
    while progress[0] < 2 and time.monotonic() < deadline and th.is_alive():
        time.sleep(0.005)
    graphs = []
    try:
        for rnd in range(30):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                h = x
                for _ in range(4):
                    h = torch.tanh(h @ w) * 0.5
                tmp = torch.empty(4 * MIB, device="cuda").fill_(1.0)
                out = h + tmp[: h.numel()].view_as(h)
            g.replay()
            graphs.append((g, out))
            if len(graphs) > 4:
                graphs.pop(0)
        torch.cuda.synchronize()
        h = x
        for _ in range(4):
            h = torch.tanh(h @ w) * 0.5
        ref = h + 1.0
        for g, out in graphs:
            g.replay()
            torch.cuda.synchronize()
            if not torch.allclose(out, ref, atol=1e-4):
                errors.append("a replay differs from eager")
                break
    except Exception as e:  # noqa: BLE001
        errors.append(f"capture: {type(e).__name__}: {e}")
    finally:
        deadline = time.monotonic() + 10
        while progress[0] < 20 and time.monotonic() < deadline and th.is_alive():
            time.sleep(0.01)
        stop.set()
        th.join()
    if not counter or counter[0] < 10:
        errors.append(f"the prefetcher did only {counter} rounds")
    if errors:
        for e in errors:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print(f"ok ({counter[0]} prefetches)")


if __name__ == "__main__":
    main()
