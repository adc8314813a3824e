"""Hundreds of private memory pools alive at once: a CUDA graph captured for each of 200
shapes without `pool=` (torch.cuda.graph then gives each capture a private pool of its own:
hand-written decoders that capture one graph per batch size or sequence bucket), and 200
torch.cuda.MemPool objects each holding a small tensor made inside use_mem_pool (a pool per
request, per layer or per adapter), all kept alive together; then half of each dropped and
as many new ones made, everything replayed and checked, and everything dropped.

With PyTorch's allocator a private pool costs only the segments it holds: each graph's pool
holds one 2 MiB segment of small blocks (its temporary and its output), each MemPool one, so
the 400 pools take about 0.8 GiB of the GPU and nothing else; every graph replays into its
own output (x * k + 1 for its own k, with the shared static input refilled between
replays), every MemPool tensor keeps its value (and lies in its own pool's segments, not
checked here, below), and once
everything is gone and empty_cache() ran, memory_allocated() is back at its baseline.

Why vmm may differ: vmm gives each private pool a virtual address range of its own, 2.75
times the GPU's memory (process_state.cc UsePrivatePool: twice for the large arena, once for
the small one), until the private and explicit pools alive hold 32 TiB of address space; past
that a quarter of the GPU's memory (process_state.h kPoolRangeBudget; before it, 400 pools
asked for 88 TB of address space on an H100). A reservation the driver refuses must not fail
a capture or an allocation that PyTorch's allocator serves from a 2 MiB segment, and the
ranges of pools that are gone must come back.

Where each MemPool tensor lies is not checked here (case_api_nested_pool_contexts and others
do, for a few pools): with torch 2.11, `MemPool.snapshot()` of a few of these pools made a
later `torch.cuda.memory_stats()` crash the process (SIGSEGV) with
PyTorch's own allocator (3 runs of 3 with the MemPools alone, about half the runs of the
whole case), and with vmm alike (the crash once taken for vmm's, run DU); without those
snapshots the case ran 3 of 3 with PyTorch's allocator and 4 of 4 with vmm on an H100 (run
DX, docs/results/2026-12-05.md).
"""
import torch
from dropin_report import baseline, memory_back, report, settle

GRAPHS = 200
POOLS = 200
N = 1024  # elements of the static input and of each output (4 KiB)


def capture(x, k):
    """A graph computing x * k + 1 into a private pool of its own; (graph, output)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * float(k) + 1.0
    return g, y


def check_graphs(graphs, x, errors, when):
    """Refills x twice, replays every graph and compares all outputs at once."""
    if not graphs:
        return
    ks = torch.tensor([float(k) for k, _, _ in graphs], device="cuda").unsqueeze(1)
    for v in (2.0, 3.0):
        x.fill_(v)
        for _, g, _ in graphs:
            g.replay()
        got = torch.stack([y for _, _, y in graphs])
        want = (ks * v + 1.0).expand(-1, N)
        if not torch.equal(got, want):
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            errors.append(f"{when}: {len(bad)} of {len(graphs)} graphs replayed a wrong output "
                          f"with input {v} (first: k={graphs[bad[0]][0]})")
            return


def check_pools(pools, errors, when):
    """Every MemPool tensor holds its value (each was written in its own pool)."""
    if not pools:
        return
    vals = torch.tensor([float(v) for v, _, _ in pools], device="cuda").unsqueeze(1)
    got = torch.stack([t for _, _, t in pools])
    if not torch.equal(got, vals.expand(-1, N)):
        bad = (got != vals).any(dim=1).nonzero().flatten().tolist()
        errors.append(f"{when}: {len(bad)} of {len(pools)} MemPool tensors lost their values")


def make_graphs(x, ks, graphs, errors, when):
    for k in ks:
        try:
            g, y = capture(x, k)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{when}: capturing graph {k} (with {len(graphs)} graphs alive) "
                          f"raised {type(e).__name__}: {str(e)[:300]}")
            return False
        graphs.append((k, g, y))
    return True


def make_pools(values, pools, errors, when):
    for v in values:
        try:
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                t = torch.full((N,), float(v), device="cuda")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{when}: a tensor in MemPool {v} (with {len(pools)} MemPools "
                          f"alive) raised {type(e).__name__}: {str(e)[:300]}")
            return False
        pools.append((v, pool, t))
    return True


def main():
    errors = []
    x = torch.zeros(N, device="cuda")
    (x * 2.0 + 1.0).sum().item()  # the kernels loaded before any capture
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()  # cuBLAS's workspace for this stream made before the baseline
    del a
    base, res0, count0 = baseline()

    graphs, pools = [], []
    ok = make_graphs(x, range(1, GRAPHS + 1), graphs, errors, "first graphs")
    ok = make_pools(range(1, POOLS + 1), pools, errors, "first MemPools") and ok
    check_graphs(graphs, x, errors, f"{len(graphs)} graphs alive")
    check_pools(pools, errors, f"{len(pools)} MemPools alive")

    if ok:
        # Half of each go, as many new ones come.
        graphs = graphs[1::2]
        pools = pools[1::2]
        settle()
        make_graphs(x, range(GRAPHS + 1, GRAPHS + 1 + GRAPHS // 2), graphs, errors,
                    "graphs made after half were dropped")
        make_pools(range(POOLS + 1, POOLS + 1 + POOLS // 2), pools, errors,
                   "MemPools made after half were dropped")
        check_graphs(graphs, x, errors, "after half of the graphs were replaced")
        check_pools(pools, errors, "after half of the MemPools were replaced")

    # Eager work beside them all is unaffected.
    a = torch.randn(1024, 1024, device="cuda")
    if not torch.allclose((a @ a).cpu(), a.cpu() @ a.cpu(), rtol=1e-3, atol=1e-3):
        errors.append("an eager matmul beside the private pools gave a wrong result")
    del a

    del graphs, pools
    settle()
    memory_back(errors, base, res0, "with every graph and MemPool gone", count0)
    report(errors)


if __name__ == "__main__":
    main()
