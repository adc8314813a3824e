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
import json
import os
import subprocess
import sys

from dropin_report import report

MIB = 1 << 20
PHRASES = ["out of memory"]


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

    def works():
        gc.collect()
        torch.cuda.synchronize()
        t = torch.full((MIB,), 3.0, device="cuda")
        return float(t.sum(dtype=torch.float64).item())
    rec("a tensor at the end", works)


GROUPS = {"lifecycle": lifecycle, "misuse": misuse}


def probe(group):
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]

    def rec(name, fn):
        res.append([f"{group}: {name}", outcome(fn)])

    GROUPS[group](torch, rec)
    return res


# --- the comparison harness (the same in every case_u_* program) -----------------------------


def outcome(fn):
    """What fn() did: {"kind": "returned", "value": ...} (the value as fn summarised it) or
    {"kind": "raised", "type": ..., "phrases": [...], "text": ...}."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001  (what is raised is the outcome)
        try:
            text = str(e)
        except Exception:  # noqa: BLE001
            text = ""
        lines = text.strip().splitlines()
        low = text.lower()
        return {"kind": "raised", "type": type(e).__name__,
                "phrases": [p for p in PHRASES if p in low],
                "text": lines[0][:200] if lines else ""}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = f"<{type(value).__name__}>"
    return {"kind": "returned", "value": value}


def same(a, b):
    """Whether two outcomes agree in what programs see: returned (and the value) or raised (the
    exception's type and the key phrases of its message)."""
    if a is None or b is None or a["kind"] != b["kind"]:
        return False
    if a["kind"] == "returned":  # as JSON: a tuple is a list, nan equals nan
        return json.dumps(a["value"], sort_keys=True) == json.dumps(b["value"], sort_keys=True)
    return a["type"] == b["type"] and a["phrases"] == b["phrases"]


def show(o):
    if o is None:
        return "(missing)"
    if o["kind"] == "returned":
        return f"returned {o['value']!r}"
    return f"raised {o['type']} {o['phrases']} {o['text']!r}"


def child_env():
    """This program's environment without VMM_TORCH_ENABLE: PyTorch's own allocator (the
    runner's sitecustomize only adds vmm_torch's folder; vmm is enabled by that variable)."""
    return {k: v for k, v in os.environ.items() if k != "VMM_TORCH_ENABLE"}


def start_probe(args, env):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe"] + args,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_probe(proc, label, errors, timeout=50):
    """The outcomes a probe process printed (a list of [name, outcome]), or None."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        errors.append(f"{label}: the probe process hung")
        return None
    lines = [line for line in out.splitlines() if line.startswith("OUTCOMES ")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(err.strip().splitlines()[-5:])
        errors.append(f"{label}: the probe process exited {proc.returncode} without outcomes: "
                      f"{tail}")
        return None
    return json.loads(lines[-1][len("OUTCOMES "):])


def compare(native, mine, errors, skip=()):
    """Prints the table native | this process and adds each disagreement to `errors`."""
    theirs = dict((name, o) for name, o in native)
    ours = dict((name, o) for name, o in mine)
    names = [name for name, _ in native] + [n for n, _ in mine if n not in theirs]
    mode = "vmm" if os.environ.get("VMM_TORCH_ENABLE") else "native"
    print(f"{'probe':44s} | PyTorch's allocator (child) | this process ({mode})")
    for name in names:
        a, b = theirs.get(name), ours.get(name)
        flag = "  " if same(a, b) else "!="
        print(f"{flag} {name:41s} | {show(a)} | {show(b)}")
        if name in skip:
            continue
        if not same(a, b):
            errors.append(f"{name}: PyTorch's allocator {show(a)}; here {show(b)}")


def emit(results):
    print("OUTCOMES " + json.dumps(results))


def main():
    if "--probe" in sys.argv:
        emit(probe(sys.argv[sys.argv.index("--probe") + 1]))
        return
    errors = []
    runs = [(g, start_probe([g], child_env()), start_probe([g], dict(os.environ)))
            for g in GROUPS]
    native, mine = [], []
    for group, theirs, ours in runs:
        a = finish_probe(theirs, f"{group} with PyTorch's allocator", errors)
        b = finish_probe(ours, f"{group} in this program's environment", errors)
        if a is not None and b is not None:
            native += a
            mine += b
            backend = dict(a).get("_backend", {}).get("value")
            if backend != "native":
                errors.append(f"the process meant to run PyTorch's allocator has backend "
                              f"{backend!r}")
    compare([o for o in native if o[0] != "_backend"], [o for o in mine if o[0] != "_backend"],
            errors)
    report(errors)


if __name__ == "__main__":
    main()
