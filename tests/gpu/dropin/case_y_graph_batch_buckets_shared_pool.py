"""A serving engine's CUDA graph runner (vLLM's and SGLang's pattern): one graph per batch-size
bucket, all captured into one pool from torch.cuda.graph_pool_handle(), largest bucket first,
each reading a slice of one static input buffer and keeping its output; then replays of random
buckets with eager work and empty_cache() in between, an in-place weight update (new weights
loaded into the same parameters) seen by every graph, and a re-capture of all buckets into a
fresh pool after the old graphs are dropped (a model reload).

With PyTorch's allocator (its documented rules for graphs that share a pool): a capture
reuses memory that earlier captures of the pool freed, never memory that a live output holds;
nothing of the pool goes to eager allocations while a graph lives. So: with the model warmed up
on the capture stream (its cuBLAS workspaces made before any capture), eight buckets of 64 to 1
rows captured in decreasing order give, on every replay, the eager model's result for the rows
copied into the static input (within float32 tolerance), for 24 replays in a random order
interleaved with eager tensors filled with 7 and empty_cache() calls; the eager tensors keep 7;
after `p.mul_(0.5)` on every parameter the replays give the new model's result; once the
graphs and outputs are dropped and the cache emptied, memory_reserved() is no more than before
the captures; the same holds for buckets re-captured in increasing order into a new pool;
and at the end memory_allocated() is back at its value after the warm-up.

Why vmm may differ: the shared pool is one vmm private pool used by eight captures in turn (a
use count, blocks freed in one capture handed to the next), with outputs that are views of the
same allocation-sized blocks held for the pool's life; the pool must keep its memory mapped
through empty_cache() while graphs live and give all of it back when they are gone, and a pool
made for the re-capture must not find the old one's blocks.
"""
import random

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20
BUCKETS = (64, 48, 32, 16, 8, 4, 2, 1)
D = 512


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, 4 * D)
        self.down = torch.nn.Linear(4 * D, D)
        self.head = torch.nn.Linear(D, 256)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return torch.softmax(self.head(h), dim=-1)


def capture_all(model, static_in, order, stream):
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = {}, {}
    for bs in order:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            outs[bs] = model(static_in[:bs])
        graphs[bs] = g
    return graphs, outs


def check_replays(model, static_in, graphs, outs, rng, errors, where, rounds=24):
    eager_junk = []
    for r in range(rounds):
        bs = rng.choice(list(graphs))
        x = torch.randn(bs, D, device="cuda")
        static_in[:bs].copy_(x)
        graphs[bs].replay()
        with torch.no_grad():
            want = model(x)
        if not torch.allclose(outs[bs], want, rtol=1e-3, atol=1e-5):
            errors.append(f"{where}: replay {r} of bucket {bs} differs from eager by "
                          f"{float((outs[bs] - want).abs().max().item())}")
            return
        eager_junk.append(torch.full((rng.choice((1000, 300_000, 3 * MIB)),), 7.0,
                                     device="cuda"))
        if r % 6 == 5:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    if any(float(t.min().item()) != 7.0 or float(t.max().item()) != 7.0 for t in eager_junk):
        errors.append(f"{where}: an eager tensor filled with 7 changed during the replays")


def main():
    errors = []
    rng = random.Random(0)
    torch.manual_seed(0)
    model = Block().cuda().eval()
    stream = torch.cuda.Stream()
    static_in = torch.zeros(max(BUCKETS), D, device="cuda")
    with torch.no_grad():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in BUCKETS:
                model(static_in[:bs])  # warm-up on the capture stream: workspaces made now
        torch.cuda.current_stream().wait_stream(stream)
        for bs in BUCKETS:
            model(static_in[:bs])
    torch.cuda.synchronize()
    base, res0, _ = baseline()

    with torch.no_grad():
        graphs, outs = capture_all(model, static_in, BUCKETS, stream)
        ptrs = {bs: o.data_ptr() for bs, o in outs.items()}
        if len(set(ptrs.values())) != len(ptrs):
            errors.append("two live bucket outputs of the shared pool have the same address")
        check_replays(model, static_in, graphs, outs, rng, errors, "decreasing buckets")
        for p in model.parameters():
            p.mul_(0.5)
        check_replays(model, static_in, graphs, outs, rng, errors, "after the weight update",
                      rounds=8)
        del graphs, outs
        settle()
        if torch.cuda.memory_reserved() > res0:
            errors.append(f"after the first graphs were dropped memory_reserved() is "
                          f"{torch.cuda.memory_reserved()}, was {res0} before the captures")
        graphs, outs = capture_all(model, static_in, tuple(reversed(BUCKETS)), stream)
        check_replays(model, static_in, graphs, outs, rng, errors, "increasing buckets, new pool")
        del graphs, outs
    settle()
    memory_back(errors, base, res0, "after every graph and output was dropped")
    report(errors)


if __name__ == "__main__":
    main()
