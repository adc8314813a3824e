"""torch.cuda.MemPool used in unusual ways: a pool's id, use_count() and snapshot() when new,
inside its use_mem_pool context, after it and after its tensors died (before and after
empty_cache()); memory_snapshot(mempool_id=pool.id) and for an id no pool has;
use_mem_pool with device "cuda:0", torch.device, "cpu" and a non-pool; use_mem_pool of a
pool nested inside its own context (the inner entry, then where the outer context's
tensors go, and the use count after); empty_cache() inside a pool's context (what it
does, and whether the context still routes there afterwards); the last reference to a pool
dropped inside its own context (its tensor stays usable); a pool made inside another's
context. Libraries that manage pools (NCCL's and symmetric-memory allocators, vLLM's sleep
mode, torchtitan's) meet these through user code and catch what is raised.

What each does with PyTorch's allocator is not written here: each group of probes runs in a
fresh process with PyTorch's allocator (VMM_TORCH_ENABLE removed) and in one with this
program's environment (vmm under the runner's vmm run), and the outcomes must agree:
returned (and the summary of the value: counts, lengths, whether a tensor lies in the
pool) or raised (the exception's type).

Why vmm may differ: vmm routes a pool's context itself (beginAllocateToPool: a use of the
pool, then a check that no route of that pool is open), keeps the pool's memory in a vmm
private pool with its own use count and snapshot, and empties caches with libvmm's sweep,
which does not refuse while a pool's context is open.
"""
import gc

from outcome_compare import a_tensor_works, named_groups_against_native, outcome

MIB = 1 << 20


def in_pool(pool, t):
    address = t.data_ptr()
    return any(s["address"] <= address < s["address"] + s["total_size"]
               for s in pool.snapshot())


def active_blocks(pool):
    return sum(1 for s in pool.snapshot() for b in s["blocks"]
               if b.get("state") == "active_allocated")


def lifecycle(torch, rec):
    from torch.cuda import MemPool, use_mem_pool
    pool = MemPool()
    rec("new pool: id is a pair", lambda: [type(pool.id).__name__, len(pool.id)])
    rec("new pool: use_count()", pool.use_count)
    rec("new pool: snapshot() length", lambda: len(pool.snapshot()))
    box = {}

    def inside():
        with use_mem_pool(pool):
            box["t"] = torch.full((8 * MIB,), 1.0, device="cuda")
            count = pool.use_count()
        return [count, in_pool(pool, box["t"])]
    rec("inside use_mem_pool: [use_count, tensor in pool]", inside)
    rec("after the context: use_count()", pool.use_count)
    rec("after: memory_snapshot(mempool_id=pool.id) has segments",
        lambda: len(torch.cuda.memory_snapshot(mempool_id=pool.id)) > 0)
    rec("memory_snapshot(mempool_id=(0, 987654)) length",
        lambda: len(torch.cuda.memory_snapshot(mempool_id=(0, 987654))))

    def died():
        del box["t"]
        gc.collect()
        torch.cuda.synchronize()
        return [len(pool.snapshot()) > 0, active_blocks(pool), pool.use_count()]
    rec("tensor died: [segments kept, active blocks, use_count]", died)

    def emptied():
        torch.cuda.empty_cache()
        return [len(pool.snapshot()) > 0, active_blocks(pool), pool.use_count()]
    rec("then empty_cache(): [segments kept, active blocks, use_count]", emptied)
    for label, device in (("'cuda:0'", "cuda:0"), ("torch.device('cuda')", torch.device("cuda")),
                          ("0", 0), ("'cpu'", "cpu")):
        def with_device(device=device):
            with use_mem_pool(pool, device=device):
                t = torch.empty(MIB, device="cuda")
            return [in_pool(pool, t), pool.use_count()]
        rec(f"use_mem_pool(pool, device={label}): [in pool, use_count after]", with_device)

    def not_a_pool():
        with use_mem_pool(object()):
            pass
    rec("use_mem_pool(object())", not_a_pool)
    rec("use_count() at the end", pool.use_count)


def misuse(torch, rec):
    from torch.cuda import MemPool, use_mem_pool
    pool = MemPool()

    def nested():
        with use_mem_pool(pool):
            inner = outcome(lambda: use_mem_pool(pool).__enter__() and None)
            t = torch.empty(4 * MIB, device="cuda")
            where = in_pool(pool, t)
        after = torch.empty(4 * MIB, device="cuda")
        return [inner["kind"], inner.get("type"), where, in_pool(pool, after)]
    rec("use_mem_pool(p) nested in its own context: [inner, its type, outer tensor in p, "
        "tensor after in p]", nested)
    rec("use_count() after the nesting", pool.use_count)

    other = MemPool()

    def empty_inside():
        with use_mem_pool(other):
            a = torch.empty(2 * MIB, device="cuda")
            called = outcome(torch.cuda.empty_cache)
            b = torch.empty(2 * MIB, device="cuda")
            return [called["kind"], called.get("type"), in_pool(other, a), in_pool(other, b)]
    rec("empty_cache() inside a pool's context: [what it did, type, before in pool, "
        "after in pool]", empty_inside)
    rec("a tensor after that context is not in the pool",
        lambda: in_pool(other, torch.empty(2 * MIB, device="cuda")))

    def dropped_inside():
        p = MemPool()
        cm = use_mem_pool(p)
        cm.__enter__()
        t = torch.full((MIB,), 2.0, device="cuda")
        del p
        gc.collect()
        cm.__exit__(None, None, None)
        del cm
        gc.collect()
        t.add_(1.0)
        return float(t.sum(dtype=torch.float64).item())
    rec("last reference to a pool dropped inside its context: its tensor", dropped_inside)

    def pool_made_inside():
        outer = MemPool()
        with use_mem_pool(outer):
            inner = MemPool()
            with use_mem_pool(inner):
                t = torch.empty(MIB, device="cuda")
            u = torch.empty(MIB, device="cuda")
        return [in_pool(inner, t), in_pool(outer, t), in_pool(outer, u), inner.use_count(),
                outer.use_count()]
    rec("a pool made inside another's context: [t in inner, t in outer, u in outer, "
        "use counts]", pool_made_inside)

    rec("a tensor at the end", a_tensor_works)


GROUPS = {"lifecycle": lifecycle, "misuse": misuse}


if __name__ == "__main__":
    named_groups_against_native(GROUPS)
