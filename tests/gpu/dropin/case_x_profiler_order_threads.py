"""torch.profiler's CUDA memory events (profile_memory=True) when several threads allocate and
free at once, and the totals a single thread's events carry.

With PyTorch's allocator every allocation and free is reported to the profiler under the
allocator's lock as the block changes state (c10::reportMemoryUsageToProfiler in the device
allocator's malloc and free), so, ordered by time, the events of every address alternate:
an allocation, a free, an allocation, ...: an address is never reported allocated while it
is live for the profiler, nor freed twice (the pairing torch.profiler's memory timeline and
TensorBoard's memory view rely on). Checked while three threads run ops whose temporaries
are freed inside the op (layer_norm, sort, cumsum) and make 1 MiB tensors: this one and two
tasks it forks in TorchScript (torch.jit.fork inside a scripted function runs on an inter-op
thread that carries the profiler's state, so its events are recorded); the check needs
events from at least two threads (it says so and checks nothing else where fewer report). And,
one thread alone: the event of an 8 MiB allocation carries the memory_allocated() of just
after it, the event of its free that of just after the free.

Why vmm may differ: VmmAllocator::Free told the profiler after the pool had taken the block
back (with the totals the free left), so another thread could be handed the address and
report its allocation first: the profile then shows an address allocated twice, then freed
while live. Told before the block goes back, the free's event carries the allocated figure
less the block, which must still be the figure after the free.
"""
import faulthandler

import torch
from dropin_report import report

MIB = 1 << 20
ROUNDS = 1500


@torch.jit.script
def churn(x: torch.Tensor, rounds: int) -> torch.Tensor:
    """Ops whose temporaries are freed inside them, and a 1 MiB tensor, `rounds` times (their
    results summed, so that none is left out of the compiled function)."""
    acc = torch.zeros([1], device=x.device)
    for _ in range(rounds):
        y = torch.nn.functional.layer_norm(x, [1024])
        s, _idx = torch.sort(y.flatten())
        t = torch.empty([256 * 1024], device=x.device)
        t.fill_(1.0)
        acc += torch.cumsum(s, 0)[-1:] + t[:1]
    return acc


@torch.jit.script
def together(x: torch.Tensor, rounds: int) -> torch.Tensor:
    """churn in two forked tasks (inter-op threads) and in this thread at once."""
    tasks = [torch.jit.fork(churn, x, rounds) for _ in range(2)]
    acc = churn(x, rounds)
    for task in tasks:
        acc += torch.jit.wait(task)
    return acc


def memory_events(prof):
    """([(time ns, ptr, bytes, total allocated)] of the CUDA memory events, by time; the
    threads they came from)."""
    from torch._C._profiler import _EventType
    out = []
    threads = set()
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
        threads.add(node.start_tid)
    # On a tie of times a free before an allocation: an order a lock could have given.
    out.sort(key=lambda e: (e[0], e[2] > 0))
    return out, threads


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
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        after_alloc = torch.cuda.memory_allocated()
        ptr = x.data_ptr()
        with record_function("dropin_free"):  # a free outside every range is not in the tree
            del x
        after_free = torch.cuda.memory_allocated()
    mine = [e for e in memory_events(prof)[0] if e[1] == ptr]
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


def threaded_events():
    """this thread and two forked TorchScript tasks allocate and free at once under the
    profiler: (the memory events by time, the threads they came from)."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(256, 1024, device="cuda")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        together(x, ROUNDS)
        torch.cuda.synchronize()
    return memory_events(prof)


def main():
    faulthandler.dump_traceback_later(50, exit=True)
    errors = []
    together(torch.randn(256, 1024, device="cuda"), 2)  # compiled, kernels loaded, first
    torch.cuda.synchronize()

    single_thread_totals(errors)

    events, threads = threaded_events()
    if len(threads) < 2:
        print(f"the profile's CUDA memory events came from {len(threads)} thread(s): this torch "
              f"does not record the forked tasks' events; the order is not checked")
    else:
        bad = check_order(events)
        if bad:
            errors.append(f"{len(bad)} of {len(events)} memory events from {len(threads)} "
                          f"threads out of order, first: " + "; ".join(bad[:3]))
        print(f"{len(events)} CUDA memory events from {len(threads)} threads, "
              f"{len(bad)} out of order")
    faulthandler.cancel_dump_traceback_later()
    report(errors)


if __name__ == "__main__":
    main()
