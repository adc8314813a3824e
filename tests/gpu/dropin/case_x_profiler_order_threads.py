"""torch.profiler's CUDA memory events (profile_memory=True) when several threads allocate and
free at once, profiled in every thread (experimental_config=_ExperimentalConfig(
profile_all_threads=True)), and the totals a single thread's events carry.

With PyTorch's allocator every allocation and free is reported to the profiler under the
allocator's lock as the block changes state (c10::reportMemoryUsageToProfiler in the device
allocator's malloc and free), so, ordered by time, the events of every address alternate:
an allocation, a free, an allocation, ...: an address is never reported allocated while it
is live for the profiler, nor freed twice (the pairing torch.profiler's memory timeline and
TensorBoard's memory view rely on). Checked while the main thread runs backward passes of a
6-layer MLP (the autograd engine's thread frees the 1 MiB activations and allocates
gradients) and two Python threads run ops whose temporaries are freed inside the op and make
1 MiB tensors. And, one thread alone: the event of an 8 MiB allocation carries the
memory_allocated() of just after it, the event of its free that of just after the free.

Why vmm may differ: VmmAllocator::Free told the profiler after the pool had taken the block
back (with the totals the free left), so another thread could be handed the address and
report its allocation first: the profile then shows an address allocated twice, then freed
while live. Told before the block goes back, the free's event carries the allocated figure
less the block, which must still be the figure after the free.
"""
import faulthandler
import threading

import torch
from dropin_report import mlp_and_input, python_worker, report, threaded_backward

MIB = 1 << 20
RUN_S = 2.0


def all_threads_config():
    """The experimental config that profiles every thread, or None where this torch has none
    (after saying so: the threaded check is then skipped)."""
    try:
        from torch.profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError) as e:
        print(f"this torch cannot profile every thread ({type(e).__name__}: {e}); "
              f"the threaded check is skipped")
        return None


def memory_events(prof):
    """[(time ns, ptr, bytes, total allocated)] of the CUDA memory events, by time."""
    from torch._C._profiler import _EventType
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag != _EventType.Allocation:
            continue
        fields = node.extra_fields
        if fields.device.type != "cuda":
            continue
        out.append((node.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated))
    # On a tie of times a free before an allocation: an order a lock could have given.
    out.sort(key=lambda e: (e[0], e[2] > 0))
    return out


def check_order(events):
    """Per address: allocation -> free -> allocation ...; a free of an address not seen
    allocated may come first (made before the profile). A list of what broke it."""
    state = {}
    bad = []
    for i, (ns, ptr, nbytes, _) in enumerate(events):
        before = state.get(ptr)
        if nbytes > 0:
            if before == "live":
                bad.append(f"event {i}: allocation at {ptr:#x} while it is live ({ns} ns)")
            state[ptr] = "live"
        elif nbytes < 0:
            if before == "free":
                bad.append(f"event {i}: free at {ptr:#x} while it is free ({ns} ns)")
            state[ptr] = "free"
    return bad


def single_thread_totals(errors):
    """One allocation and its free in this thread: the totals their events carry."""
    from torch.profiler import profile
    torch.cuda.synchronize()
    with profile(profile_memory=True) as prof:
        x = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        after_alloc = torch.cuda.memory_allocated()
        ptr = x.data_ptr()
        del x
        after_free = torch.cuda.memory_allocated()
    mine = [e for e in memory_events(prof) if e[1] == ptr]
    allocs = [e for e in mine if e[2] > 0]
    frees = [e for e in mine if e[2] < 0]
    if len(allocs) != 1 or len(frees) != 1:
        errors.append(f"the profile of one 8 MiB tensor made and dropped has {len(allocs)} "
                      f"allocation and {len(frees)} free events at its address")
        return
    if allocs[0][3] != after_alloc:
        errors.append(f"the allocation event's total allocated is {allocs[0][3]}, "
                      f"memory_allocated() just after it {after_alloc}")
    if frees[0][3] != after_free:
        errors.append(f"the free event's total allocated is {frees[0][3]}, "
                      f"memory_allocated() just after the free {after_free}")


def main():
    faulthandler.dump_traceback_later(50, exit=True)
    from torch.profiler import profile
    errors = []
    model, x = mlp_and_input()
    model(x).square().mean().backward()  # lazy state (kernels, workspaces) made first
    model.zero_grad(set_to_none=True)
    once = threading.Event()
    once.set()
    python_worker(once, errors, 0)  # one pass
    torch.cuda.synchronize()

    single_thread_totals(errors)

    config = all_threads_config()
    if config is not None:
        with profile(profile_memory=True, experimental_config=config) as prof:
            steps = threaded_backward(model, x, errors, RUN_S)
        events = memory_events(prof)
        if len(events) < 1000:
            errors.append(f"the profile holds {len(events)} CUDA memory events after {steps} "
                          f"backward passes beside two allocating threads")
        bad = check_order(events)
        if bad:
            errors.append(f"{len(bad)} memory events out of order in {len(events)} "
                          f"({steps} backward passes beside two allocating threads), first: "
                          + "; ".join(bad[:3]))
        print(f"{len(events)} CUDA memory events over {steps} backward passes, "
              f"{len(bad)} out of order")
    faulthandler.cancel_dump_traceback_later()
    report(errors)


if __name__ == "__main__":
    main()
