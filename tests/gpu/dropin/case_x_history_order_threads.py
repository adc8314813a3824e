"""The order of the allocation history when several threads allocate and free at once: the
trace of torch.cuda.memory._record_memory_history (what _dump_snapshot writes and PyTorch's
memory visualizer replays block by block), recorded with Python stacks (context="all",
stacks="python", as memory-debugging guides set it), while the main thread runs backward
passes of a 6-layer MLP (the autograd engine's thread frees the 1 MiB activations and
allocates gradients, holding no GIL) and two Python threads run ops whose temporaries are
freed inside the op (layer_norm's statistics, a cub radix sort's and scan's scratch: no GIL
held there) and make 1 MiB tensors.

With PyTorch's allocator every entry is recorded under the allocator's lock as the block
changes state (the stack is gathered before the lock is taken), so for every address the
trace reads alloc, free_requested, free_completed, alloc, ...: an address is never allocated
again before its free_completed entry, nor freed while not allocated; the allocations made by
the Python threads carry frames naming their function; the run ends (no deadlock between the
GIL the stacks need and the allocator).

Why vmm may differ: vmm records an allocation's entry after the pool handed the block out
and a free's free_completed entry after the pool took the block back, outside the pool's lock
(VmmAllocator::Malloc / Free; alloc_history.h gathers the stack, taking the GIL, before it
records), so another thread can be handed the block and record its alloc between a free's
two entries: the trace then shows an address allocated twice, and the visualizer's replay
loses the block.
"""
import faulthandler
import threading

import torch
from dropin_report import mlp_and_input, python_worker, report, threaded_backward

RUN_S = 2.0
MAX_ENTRIES = 300_000


def check_order(trace):
    """Per address: alloc -> free_requested -> free_completed -> alloc ...; the first entry
    of an address may be any (the ring buffer drops the oldest). A list of what broke it."""
    state = {}
    bad = []
    for i, e in enumerate(trace):
        action, addr = e.get("action"), e.get("addr")
        before = state.get(addr)
        if action == "alloc":
            if before in ("live", "pending"):
                bad.append(f"entry {i}: alloc at {addr:#x} while it is {before}")
            state[addr] = "live"
        elif action == "free_requested":
            if before in ("pending", "free"):
                bad.append(f"entry {i}: free_requested at {addr:#x} while it is {before}")
            state[addr] = "pending"
        elif action == "free_completed":
            if before == "free":
                bad.append(f"entry {i}: free_completed at {addr:#x} while it is free")
            state[addr] = "free"
    return bad


def main():
    faulthandler.dump_traceback_later(50, exit=True)
    errors = []
    model, x = mlp_and_input()
    model(x).square().mean().backward()  # lazy state (kernels, workspaces) made first
    model.zero_grad(set_to_none=True)
    once = threading.Event()
    once.set()
    python_worker(once, errors, 0)
    torch.cuda.synchronize()

    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=MAX_ENTRIES)
    steps = threaded_backward(model, x, errors, RUN_S)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)

    trace = snap["device_traces"][torch.cuda.current_device()]
    allocs = [e for e in trace if e.get("action") == "alloc"]
    if len(allocs) < 1000:
        errors.append(f"the trace holds {len(allocs)} alloc entries after {steps} backward "
                      f"passes beside two allocating threads")
    bad = check_order(trace)
    if bad:
        errors.append(f"{len(bad)} trace entries out of order in {len(trace)} entries "
                      f"({steps} backward passes beside two allocating threads), first: "
                      + "; ".join(bad[:3]))
    if not any(f.get("name") == "python_worker" for e in allocs for f in e.get("frames", [])):
        errors.append("no alloc entry's Python frames name the threads' function")
    faulthandler.cancel_dump_traceback_later()
    report(errors)


if __name__ == "__main__":
    main()
