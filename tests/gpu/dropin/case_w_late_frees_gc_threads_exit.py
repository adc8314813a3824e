"""CUDA tensors freed late and from unexpected places: held by reference cycles (models with
back-references, callbacks that capture their owner) that only the cyclic garbage collector
frees, run by gc.collect() on a background thread (a monitoring or data thread that calls
it, or that simply triggers a collection) while the main thread allocates; weakref.finalize
callbacks and __del__ methods that allocate and free CUDA memory themselves while the
collector runs them; and, in a child interpreter, tensors still alive at exit in module
globals and in uncollected cycles, a non-daemon thread still allocating when the script
ends, an atexit handler that runs gc.collect() over cycles holding CUDA tensors and then
allocates, checks and frees 64 MiB, and weakref.finalize callbacks run at exit.

With PyTorch's allocator a free may come from any thread at any time (the caching allocator
takes its mutex; the block goes back to the pool of the stream it was made on); so the 240
cyclic objects' tensors are freed on the collector thread, every finalize callback and
__del__ runs there (computing the right values with the tensors they allocate), the main
thread's own tensors keep their values, and once everything is dropped memory_allocated()
is back at its value before (the program owns every byte: no library workspaces). The
caching allocator is never torn down at exit, so the child exits with status 0, prints what
its atexit handler and finalizers computed, and writes no traceback, "Exception ignored" or
fatal error on stderr.

Why vmm may differ: frees reaching vmm's pool from a thread that never allocated (its
per-thread state, stream lookup, deferred-free queues), frees interleaved with the main
thread's allocations, and frees and allocations at interpreter exit (atexit, finalize,
module teardown) racing vmm's own exit hooks and static destructors.
"""
import gc
import os
import subprocess
import sys
import threading
import weakref

import torch
from dropin_report import report

K = 240
SIZES = [256, 1000, 4096, 65_536, 262_144, 1 << 20]  # float32 elements


class Node:
    made = 0
    deleted = []  # GPU tensors the __del__ methods computed (kept: the program owns them)
    del_threads = set()

    def __init__(self, k):
        self.k = k
        self.t = torch.full((SIZES[k % len(SIZES)],), float(k), device="cuda")
        self.view = self.t[1:]
        self.me = self  # a cycle of its own
        self.hook = lambda: self.t  # a closure over its owner: another cycle
        Node.made += 1


class NodeWithDel(Node):
    def __del__(self):
        x = torch.full((4096,), 2.0, device="cuda")
        Node.deleted.append((self.k, (x * float(self.k)).sum()))  # 8192 * k
        Node.del_threads.add(threading.current_thread().name)


finalized = []  # (k, GPU value, thread name)


def on_finalize(k, n):
    y = torch.arange(n, dtype=torch.float64, device="cuda")  # sums exact in float64
    finalized.append((k, (y * 0 + k).sum(), threading.current_thread().name))
    del y


def build():
    nodes = []
    for k in range(K):
        node = NodeWithDel(k) if k % 3 == 0 else Node(k)
        if k % 2:
            node.partner = nodes[-1]  # pairs that point at each other
            nodes[-1].partner = node
        weakref.finalize(node, on_finalize, k, SIZES[k % len(SIZES)])
        nodes.append(node)
    return sum(n.t.numel() * 4 for n in nodes)


def in_process(errors):
    # Warm up the ops used here on both threads before the baseline.
    def warm():
        on_finalize(0, 16)
        torch.cuda.synchronize()
    warmer = threading.Thread(target=warm)
    warmer.start()
    warmer.join()
    warm()
    finalized.clear()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    keep = [torch.full((n,), 100.0 + i, device="cuda") for i, n in enumerate(SIZES)]
    gc.disable()
    try:
        nbytes = build()  # every node is garbage now, but in cycles: still allocated
        held = torch.cuda.memory_allocated() - base
        if held < nbytes:
            errors.append(f"{K} cyclic nodes of {nbytes} bytes: memory_allocated() grew by {held}")
        collected = []
        collector = threading.Thread(target=lambda: collected.append(gc.collect()),
                                     name="collector")
        collector.start()
        rounds = 0
        while collector.is_alive() or rounds < 20:
            a = torch.full((SIZES[rounds % len(SIZES)],), 3.0, device="cuda")
            b = a * 2
            if float(b.sum(dtype=torch.float64).item()) != 6.0 * a.numel():
                errors.append(f"main thread, round {rounds}: a wrong sum while the collector ran")
            del a, b
            rounds += 1
            if rounds > 100_000:
                break
        collector.join(30)
    finally:
        gc.enable()
    torch.cuda.synchronize()
    check_collected(errors, keep)
    finalized.clear()
    Node.deleted.clear()
    del keep
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"with every node collected and every tensor dropped memory_allocated() "
                      f"is {torch.cuda.memory_allocated()}, was {base}")


def check_collected(errors, keep):
    """What the collector thread's finalizers computed, and the main thread's tensors (a
    function of its own, so that no loop variable keeps a tensor alive afterwards)."""
    if len(finalized) != K:
        errors.append(f"{len(finalized)} of {K} weakref.finalize callbacks ran")
    threads = {name for _, _, name in finalized}
    if threads - {"collector"}:
        errors.append(f"finalize callbacks ran on {threads}, expected the collector thread")
    for k, value, _ in finalized:
        want = float(k) * SIZES[k % len(SIZES)]
        if float(value.item()) != want:
            errors.append(f"finalize callback {k} computed {float(value.item())}, expected {want}")
            break
    want_dels = len(range(0, K, 3))
    if len(Node.deleted) != want_dels or Node.del_threads - {"collector"}:
        errors.append(f"{len(Node.deleted)} of {want_dels} __del__ methods ran, on "
                      f"{Node.del_threads}")
    for k, value in Node.deleted:
        if float(value.item()) != 8192.0 * k:
            errors.append(f"__del__ of node {k} computed {float(value.item())}")
            break
    for i, t in enumerate(keep):
        if not bool((t == 100.0 + i).all()):
            errors.append(f"the main thread's tensor {i} changed while the collector freed")


CHILD = r'''
import atexit, gc, threading, time, weakref
import torch

gc.disable()  # cycles stay until the atexit handler collects them (or until exit)

class Holder:
    pass

def cycle(n, v):
    a, b = Holder(), Holder()
    a.t = torch.full((n,), v, device="cuda")
    b.view = a.t[n // 2:]
    a.b, b.a = b, a
    return a

def on_exit_finalize(tag, t):
    x = torch.full((1 << 16,), 1.0, device="cuda") * t.sum()
    print(f"finalize {tag} {float(x[0].item())}", flush=True)

GLOBAL_BIG = torch.full((64 << 20,), 5.0, device="cuda")  # 256 MiB alive at exit
GLOBAL_SMALL = [torch.full((100 + i,), float(i), device="cuda") for i in range(300)]
GLOBAL_CYCLES = [cycle(1 << 18, float(i)) for i in range(8)]  # alive, in cycles, at exit
for i in range(6):
    weakref.finalize(Holder(), lambda: None)  # collected at once
    h = cycle(1 << 16, 1.0)
    weakref.finalize(h, on_exit_finalize, i, torch.ones(4, device="cuda"))
    del h  # garbage in a cycle: the atexit handler's gc.collect() frees it
GLOBAL_PINNED = [cycle(4096, 2.0) for _ in range(3)]
for i, h in enumerate(GLOBAL_PINNED):
    weakref.finalize(h, on_exit_finalize, 100 + i, torch.ones(2, device="cuda"))

def at_exit():
    n = gc.collect()
    t = torch.empty(16 << 20, device="cuda")
    t.fill_(3.0)
    ok = float(t.sum(dtype=torch.float64).item()) == 3.0 * (16 << 20)
    del t
    torch.cuda.memory_stats()
    torch.cuda.empty_cache()
    print("atexit ok" if ok else "atexit WRONG SUM", n > 0, flush=True)

atexit.register(at_exit)

def late_worker():
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        x = torch.full((1 << 20,), 1.0, device="cuda")
        y = x + 1
        del x, y
    z = torch.full((1000,), 2.0, device="cuda")
    print("thread done", float(z.sum().item()), flush=True)

threading.Thread(target=late_worker).start()  # still running when the script ends
print("main done", flush=True)
'''


def at_exit_child(errors):
    try:
        p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                           timeout=40, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        errors.append("the child interpreter did not exit within 40 s")
        return
    out, err = p.stdout, p.stderr
    if p.returncode != 0:
        errors.append(f"the child interpreter exited with status {p.returncode}")
    lines = out.splitlines()
    for want in ("main done", "thread done 2000.0", "atexit ok True"):
        if want not in lines:
            errors.append(f"the child did not print {want!r}")
    got = sorted(line for line in lines if line.startswith("finalize"))
    want = sorted([f"finalize {i} 4.0" for i in range(6)]
                  + [f"finalize {100 + i} 2.0" for i in range(3)])
    if got != want:
        errors.append(f"the child's finalizers printed {got}, expected {want}")
    for bad in ("Traceback", "Exception ignored", "Fatal", "Segmentation fault",
                "terminate called", "Aborted"):
        if bad in err:
            errors.append(f"the child's stderr says {bad!r}: {err[-800:]}")
            break
    if errors:
        print(f"child stdout:\n{out[-2000:]}\nchild stderr:\n{err[-2000:]}", file=sys.stderr)


def main():
    errors = []
    in_process(errors)
    at_exit_child(errors)
    report(errors[:12])


if __name__ == "__main__":
    main()
