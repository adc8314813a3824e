"""The GPU trace's memory callbacks (torch.cuda._gpu_trace: what CUDA Sanitizer registers to
forget a freed tensor's accesses before its memory serves another tensor, and what memory
trackers register) in a program where several threads allocate and free at once, and
callbacks that use the allocator themselves.

With PyTorch's allocator (CachingAllocator::free tells the trace before the block goes back
to the device allocator; ::malloc tells it after the block is handed out), for every pointer
the callbacks alternate: allocation, deallocation, allocation, ... whatever the threads do:
a pointer is never reported allocated while it is live for the callbacks, nor freed twice.
Checked while the main thread runs backward passes of a 6-layer MLP (the autograd engine's
thread frees the 1 MiB activations and allocates gradients, holding no GIL) and two Python
threads run ops whose temporaries are freed inside the op (layer_norm's statistics, a cub
radix sort's and scan's scratch: no GIL held there) and make 1 MiB tensors.

Callbacks run outside the allocator's lock, so they may call it: first, single-threaded, an
allocation callback that reads memory_allocated() and memory_stats() and every tenth time
makes a small tensor (whose own allocation it is told of), and a deallocation callback that
reads memory_reserved() and every seventh time drops one of those tensors (a free inside a
free's callback); everything runs without deadlock or error and every tensor keeps its value.

Why vmm may differ: VmmAllocator::Free tells the tools after the pool has taken the block
back (TellTools after libvmm.free), so while the freeing thread waits for the GIL to run the
callback, another thread can be handed the block and report its allocation first: the
callbacks then see one pointer allocated twice, and then freed while it is live, which makes
CUDA Sanitizer forget the accesses of a live tensor.
"""
import collections
import faulthandler
import random
import threading

import torch
from dropin_report import (gpu_trace_api, mlp_and_input, python_worker, report,
                           threaded_backward)

MIB = 1 << 20
RUN_S = 3.0


class Tracker:
    def __init__(self):
        self.mode = "off"
        self.lock = threading.Lock()
        self.state = {}
        self.violations = []
        self.local = threading.local()
        self.kept = []  # (value, tensor) made by the allocation callback
        self.made = 0
        self.counts = collections.Counter()
        self.errors = []

    def on_alloc(self, ptr):
        try:
            if self.mode == "track":
                with self.lock:
                    if self.state.get(ptr) == "live":
                        self.violations.append(f"pointer {ptr:#x} reported allocated while live")
                    self.state[ptr] = "live"
                    self.counts["track_alloc"] += 1
            elif self.mode == "reenter" and not getattr(self.local, "depth", 0):
                self.local.depth = 1
                try:
                    self.counts["alloc"] += 1
                    torch.cuda.memory_allocated()
                    torch.cuda.memory_stats()["allocation.all.current"]
                    if self.counts["alloc"] % 10 == 0:
                        v = float(self.made % 1000)
                        self.made += 1
                        self.kept.append((v, torch.full((256,), v, device="cuda")))
                finally:
                    self.local.depth = 0
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"allocation callback: {type(e).__name__}: {str(e)[:200]}")

    def on_free(self, ptr):
        try:
            if self.mode == "track":
                with self.lock:
                    if self.state.get(ptr) == "free":
                        self.violations.append(f"pointer {ptr:#x} reported freed twice")
                    self.state[ptr] = "free"
                    self.counts["track_free"] += 1
            elif self.mode == "reenter" and not getattr(self.local, "depth", 0):
                self.local.depth = 1
                try:
                    self.counts["free"] += 1
                    torch.cuda.memory_reserved()
                    if self.counts["free"] % 7 == 0 and self.kept:
                        self.kept.pop(0)  # a free inside a free's callback
                finally:
                    self.local.depth = 0
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"deallocation callback: {type(e).__name__}: {str(e)[:200]}")


def threaded_workload(errors):
    """Backward passes in the main thread while two Python threads allocate; the passes."""
    model, x = mlp_and_input()
    return threaded_backward(model, x, errors, RUN_S)


def main():
    faulthandler.dump_traceback_later(50, exit=True)
    errors = []
    api = gpu_trace_api()
    if api is None:
        report(errors)
        return
    gpu_trace, activate = api
    # Everything lazily made (kernels, cuBLAS workspaces, the model's first pass) first.
    once = threading.Event()
    once.set()
    python_worker(once, errors, 0)  # one pass
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    torch.cuda.synchronize()

    tracker = Tracker()
    activate()
    gpu_trace.register_callback_for_memory_allocation(tracker.on_alloc)
    gpu_trace.register_callback_for_memory_deallocation(tracker.on_free)

    # 1. Callbacks that use the allocator, one thread.
    tracker.mode = "reenter"
    rng = random.Random(7)
    live = []
    for i in range(300):
        n = rng.choice([64, 1000, 65536, 1 << 18, 3 << 18, 5 << 20])
        live.append((float(i), torch.full((n,), float(i), device="cuda")))
        if len(live) > 20:
            live.pop(rng.randrange(len(live)))
    b = (a @ a).sum()
    s = torch.sort(torch.randn(1 << 20, device="cuda"))[0]
    torch.cuda.synchronize()
    tracker.mode = "off"
    del b, s
    if tracker.counts["alloc"] < 300 or tracker.counts["free"] < 250:
        errors.append(f"the callbacks that use the allocator ran {tracker.counts['alloc']} "
                      f"times for allocations and {tracker.counts['free']} for frees")
    for v, t in live + tracker.kept:
        if float(t.min().item()) != v or float(t.max().item()) != v:
            errors.append(f"a tensor of value {v} (made in the loop or in a callback) changed")
            break
    live.clear()
    tracker.kept.clear()

    # 2. The order of the callbacks with several threads allocating and freeing.
    tracker.mode = "track"
    steps = threaded_workload(errors)
    tracker.mode = "off"
    if tracker.violations:
        errors.append(f"{len(tracker.violations)} callbacks out of order over {steps} backward "
                      f"passes beside two allocating threads ({tracker.counts['track_alloc']} "
                      f"allocations, {tracker.counts['track_free']} frees reported), first: "
                      + "; ".join(tracker.violations[:3]))
    if tracker.counts["track_alloc"] < 1000:
        errors.append(f"only {tracker.counts['track_alloc']} allocations were reported while "
                      f"the threads ran")
    errors.extend(tracker.errors[:5])
    faulthandler.cancel_dump_traceback_later()
    report(errors)


if __name__ == "__main__":
    main()
