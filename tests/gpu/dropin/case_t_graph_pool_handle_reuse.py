"""A memory pool handle kept for the life of a program and used again and again as CUDA graphs
come and go: a serving engine that makes one torch.cuda.graph_pool_handle() at start-up (as
vLLM and SGLang keep theirs), deletes some graphs and captures new ones into the same handle,
re-captures everything into it after a model reload, captures into the pool of a graph it
already deleted (g.pool()), reuses a CUDAGraph object after reset(), and replays graphs from
worker threads while another thread captures into the handle (thread_local mode).

With PyTorch's allocator (a pool id names a private pool while any graph or capture uses it;
once nothing does and its memory is gone, the next capture with that id makes it afresh;
torch.cuda.graph empties the cache before each capture):
 - A: g1 (x * 2) and g2 (o1 + 1) captured into handle H; g1 deleted, its output o1 kept; g3
   (o2 * 3 - o1) captured into H while g2 lives; replays of g2 then g3 (capture order) with
   eager tensors filled with 7 and empty_cache() between them give o2 == o1 + 1 and
   o3 == o2 * 3 - o1 and leave the eager tensors alone;
 - B: everything of A dropped and the cache emptied, then g4 (x - 5) captured into H again:
   its replay follows new values of x, and its output lies in a segment of memory_snapshot()
   whose segment_pool_id is H;
 - C: g5 (x + 7) in a pool of its own, P = g5.pool(); g6 (o5 * 2) into P; g5 deleted; g7
   (o6 + o5) into P; replays of g6, g7 right;
 - D: g6.reset(), then g6 captured again into P (o5 * 4) while g7 lives: replays of g7 then
   g6 right (o7 == o6_old + o5, the new output o5 * 4);
 - E: a worker thread captures g8 (o4 * 0.5 + 1) into H in capture_error_mode="thread_local"
   while the main thread allocates and frees eager tensors; then, with a new x, two threads
   replay g4 then g8 and g7 then g6 (each pool's capture order), 20 times each, at once on
   streams of their own, and every replay is right;
 - once everything is dropped and the cache emptied, memory_allocated() is back where it was
   (memory_reserved() is not checked: PyTorch's allocator kept 196 MiB of the pools' segments
   there on an H200, vmm 86 MiB).

Why vmm may differ: each pool id is a vmm private pool created at first use, closed at its
last release (its cached memory released at once, the rest with its last block) and made
afresh by a later use of the same id; the same id used again once its pool closed, a pool kept
open by a sibling graph after the graph that made it is gone, a reset() graph's release
followed by a capture into the same pool, and a capture route opened from a worker thread
while the main thread allocates, all go through that bookkeeping.
"""
import gc
import threading

import torch
from dropin_report import baseline, memory_back, report

MIB = 1 << 20
N = 2 * MIB  # float32 elements: 8 MiB tensors


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def capture(fn, pool, stream, mode="global"):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode=mode):
        out = fn()
    return g, out


def churn(seed):
    """Eager tensors filled with 7 and an empty_cache(): what must not touch graph memory."""
    junk = [torch.full(((seed * 7919 + k * 104729) % (3 * MIB) + 1000,), 7.0, device="cuda")
            for k in range(12)]
    torch.cuda.empty_cache()
    return junk


def junk_ok(junk):
    return all(float(t.min().item()) == 7.0 and float(t.max().item()) == 7.0 for t in junk)


def segment_pool_of(ptr):
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg.get("segment_pool_id")
    return "no segment"


def main():
    errors = []
    torch.manual_seed(0)
    s = torch.cuda.Stream()
    x = torch.randn(N, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up on the capture stream
            y = x * 2 + 1
            y = (y * 3 - x) - 5 + 7
            del y
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    base, _, _ = baseline()

    h = torch.cuda.graph_pool_handle()
    g, o = {}, {}  # graphs and their outputs, by name

    # A: a graph of the shared pool deleted, another captured while a sibling lives.
    g[1], o[1] = capture(lambda: x * 2, h, s)
    g[2], o[2] = capture(lambda: o[1] + 1, h, s)
    g[1].replay()
    g[2].replay()
    del g[1]
    g[3], o[3] = capture(lambda: o[2] * 3 - o[1], h, s)
    for r in range(4):
        x.copy_(torch.randn(N, device="cuda"))
        junk = churn(r)
        g[2].replay()
        g[3].replay()
        torch.cuda.synchronize()
        if not close(o[2], o[1] + 1) or not close(o[3], o[2] * 3 - o[1]):
            errors.append(f"A, replay {r}: with g1 deleted, g2 and g3 of the shared pool "
                          f"computed wrong values")
            break
        if not junk_ok(junk):
            errors.append(f"A, replay {r}: an eager tensor filled with 7 changed")
            break
    del junk
    g.clear()
    o.clear()

    # B: everything of the handle dropped, then the same handle used again (after a model
    # reload: the old graphs' memory handed back first).
    gc.collect()
    torch.cuda.empty_cache()
    try:
        g[4], o[4] = capture(lambda: x - 5, h, s)
    except Exception as e:  # noqa: BLE001
        errors.append(f"B: capturing into the pool handle again after all its graphs were "
                      f"dropped raised {type(e).__name__}: {str(e)[:300]}")
        report(errors)
    x.copy_(torch.randn(N, device="cuda"))
    g[4].replay()
    torch.cuda.synchronize()
    if not close(o[4], x - 5):
        errors.append("B: the graph captured into the reused handle does not follow x")
    where = segment_pool_of(o[4].data_ptr())
    if where is None or tuple(where) != tuple(h):
        errors.append(f"B: the reused handle's output lies in a segment of pool {where}, "
                      f"captured with pool={tuple(h)}")

    # C: the pool of a deleted graph.
    g[5], o[5] = capture(lambda: x + 7, None, s)
    p5 = g[5].pool()
    g[6], o[6] = capture(lambda: o[5] * 2, p5, s)
    g[5].replay()
    del g[5]
    g[7], o[7] = capture(lambda: o[6] + o[5], p5, s)
    g[6].replay()
    g[7].replay()
    torch.cuda.synchronize()
    if not close(o[6], o[5] * 2) or not close(o[7], o[6] + o[5]):
        errors.append("C: graphs captured into the pool of a deleted graph computed wrong "
                      "values")

    # D: a graph reset and captured again into the same pool while a sibling lives.
    o["6 before reset"] = o.pop(6)
    g[6].reset()
    try:
        with torch.cuda.graph(g[6], pool=p5, stream=s):
            o[6] = o[5] * 4
    except Exception as e:  # noqa: BLE001
        errors.append(f"D: capturing a reset() graph again into its pool raised "
                      f"{type(e).__name__}: {str(e)[:300]}")
        report(errors)
    for r in range(3):
        junk = churn(100 + r)
        g[7].replay()
        g[6].replay()
        torch.cuda.synchronize()
        if not close(o[7], o["6 before reset"] + o[5]) or not close(o[6], o[5] * 4):
            errors.append(f"D, replay {r}: after reset() and a new capture into the pool, "
                          f"the replays computed wrong values")
            break
        if not junk_ok(junk):
            errors.append(f"D, replay {r}: an eager tensor filled with 7 changed")
            break
    del junk

    # E: a capture into the handle from a worker thread, then replays from two threads.
    failures = []

    def capturer():
        try:
            with torch.cuda.stream(s):
                g[8], o[8] = capture(lambda: o[4] * 0.5 + 1, h, s, mode="thread_local")
        except Exception as e:  # noqa: BLE001
            failures.append(f"E: a capture into the handle from a worker thread raised "
                            f"{type(e).__name__}: {str(e)[:300]}")
    t = threading.Thread(target=capturer)
    t.start()
    eager = []
    while t.is_alive():  # the main thread allocates and frees meanwhile
        eager.append(torch.full((MIB,), 3.0, device="cuda"))
        if len(eager) > 8:
            eager.pop(0)
    t.join()
    del eager
    if failures:
        report(errors + failures)
    x.copy_(torch.randn(N, device="cuda"))
    torch.cuda.synchronize()

    def replayer(names, check, k):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for r in range(20):
                    for name in names:
                        g[name].replay()
                    stream.synchronize()
                    if not check():
                        failures.append(f"E: thread {k}, replay {r}: wrong values")
                        return
        except Exception as e:  # noqa: BLE001
            failures.append(f"E: thread {k}: {type(e).__name__}: {str(e)[:300]}")

    threads = [
        threading.Thread(target=replayer, args=(
            (4, 8), lambda: close(o[4], x - 5) and close(o[8], o[4] * 0.5 + 1), 0)),
        threading.Thread(target=replayer, args=(
            (7, 6), lambda: close(o[7], o["6 before reset"] + o[5]) and close(o[6], o[5] * 4),
            1)),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    errors += failures

    g.clear()
    o.clear()
    del threads
    memory_back(errors, base, float("inf"), "after every graph and output was dropped")
    report(errors)


if __name__ == "__main__":
    main()
