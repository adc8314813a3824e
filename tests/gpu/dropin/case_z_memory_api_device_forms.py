"""Every way of naming the device in torch.cuda's memory API, and a device that does not exist:
the logging and monitoring code of trainers and serving engines calls memory_allocated(),
memory_reserved(), max_memory_allocated(), max_memory_reserved(), memory_stats(),
reset_peak_memory_stats(), reset_accumulated_memory_stats(), memory_summary() and
mem_get_info() with device=None, an int, "cuda", "cuda:0" or a torch.device (whatever the
config holds: `torch.device(f"cuda:{local_rank}")`, `args.device`), and tools that probe the
GPUs of a machine call them for each index and stop at the first that raises.

With PyTorch's allocator: the argument is turned into a device index in Python
(_get_device_index) and the allocator's statistics of that device are read, so every form
that names device 0 (None, 0, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0),
torch.device("cuda:0")) gives the same values: memory_allocated(form) ==
memory_stats(form)["allocated_bytes.all.current"], memory_reserved(form) ==
memory_stats(form)["reserved_bytes.all.current"], max_* >= the current values,
memory_summary(form) names device 0, mem_get_info(form) (for the forms with an index: some
versions refuse "cuda" there) has the same total for every form and 0 < free <= total;
reset_peak_memory_stats(form) makes max_memory_allocated(form) == memory_allocated(form)
and max_memory_reserved(form) == memory_reserved(form) (a 64 MiB temporary raised both peaks
before each reset); reset_accumulated_memory_stats(form) makes
allocation.all.allocated and .freed 0 while .current keeps its value. For the index
device_count() (one past the last GPU) the allocator checks the index (assertValidDevice:
"Invalid device argument") and memory_stats, memory_allocated, memory_reserved,
max_memory_allocated, max_memory_reserved, memory_summary, reset_peak_memory_stats,
reset_accumulated_memory_stats and set_per_process_memory_fraction raise (the case asks
only that something derived from Exception is raised, not which message); mem_get_info and
caching_allocator_alloc raise too (CUDA's invalid-device error, before any allocator
call). Afterwards the allocator still works, memory_allocated() is back at its baseline and,
after empty_cache(), memory_reserved() is no higher than it was.
Assumed, not read in torch 2.11's source: that get_per_process_memory_fraction(bad index)
raises too, so it is only called, and its result or exception is not checked.

Why vmm may differ: vmm answers statistics, resets and the memory fraction for any device
index it is given (vmm_device_torch_stats, vmm_reset_peak_stats: a device without a pool
reads zeros), so a device that does not exist may read as an empty GPU instead of raising,
and a fraction set for it may be kept; and a form of the device that vmm's Python layer
parses itself (vmm_torch) may differ from PyTorch's.
"""
import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20


def forms():
    return [None, 0, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0),
            torch.device("cuda:0")]


def raise_peaks():
    t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    del t


def check_form(form, keep, errors):
    name = repr(form)
    st = torch.cuda.memory_stats(form)
    alloc, res = torch.cuda.memory_allocated(form), torch.cuda.memory_reserved(form)
    if alloc != st.get("allocated_bytes.all.current"):
        errors.append(f"memory_allocated({name}) {alloc} != memory_stats({name})"
                      f"['allocated_bytes.all.current'] {st.get('allocated_bytes.all.current')}")
    if res != st.get("reserved_bytes.all.current"):
        errors.append(f"memory_reserved({name}) {res} != memory_stats({name})"
                      f"['reserved_bytes.all.current'] {st.get('reserved_bytes.all.current')}")
    if alloc != torch.cuda.memory_allocated() or res != torch.cuda.memory_reserved():
        errors.append(f"memory_allocated/reserved({name}) = {alloc}/{res}, with no argument "
                      f"{torch.cuda.memory_allocated()}/{torch.cuda.memory_reserved()}")
    if alloc < keep:
        errors.append(f"memory_allocated({name}) {alloc} < the {keep} bytes of live tensors")
    if res < alloc:
        errors.append(f"memory_reserved({name}) {res} < memory_allocated({name}) {alloc}")
    if torch.cuda.max_memory_allocated(form) < alloc:
        errors.append(f"max_memory_allocated({name}) < memory_allocated({name})")
    if torch.cuda.max_memory_reserved(form) < res:
        errors.append(f"max_memory_reserved({name}) < memory_reserved({name})")
    text = torch.cuda.memory_summary(form)
    if "device ID 0" not in text:
        errors.append(f"memory_summary({name}) does not name device 0")
    total = None
    if form is None or isinstance(form, int) or torch.device(form).index is not None:
        # mem_get_info wants an index (_get_device_index without optional=True in some
        # versions: "cuda" alone may raise ValueError there, with either allocator).
        free, total = torch.cuda.mem_get_info(form)
        if not 0 < free <= total:
            errors.append(f"mem_get_info({name}) = ({free}, {total})")

    raise_peaks()
    if torch.cuda.max_memory_allocated(form) < torch.cuda.memory_allocated(form) + 64 * MIB:
        errors.append(f"a 64 MiB temporary did not raise max_memory_allocated({name})")
    torch.cuda.reset_peak_memory_stats(form)
    if torch.cuda.max_memory_allocated(form) != torch.cuda.memory_allocated(form):
        errors.append(f"after reset_peak_memory_stats({name}) max_memory_allocated "
                      f"{torch.cuda.max_memory_allocated(form)} != memory_allocated "
                      f"{torch.cuda.memory_allocated(form)}")
    if torch.cuda.max_memory_reserved(form) != torch.cuda.memory_reserved(form):
        errors.append(f"after reset_peak_memory_stats({name}) max_memory_reserved "
                      f"{torch.cuda.max_memory_reserved(form)} != memory_reserved "
                      f"{torch.cuda.memory_reserved(form)}")
    current = torch.cuda.memory_stats(form)["allocation.all.current"]
    torch.cuda.reset_accumulated_memory_stats(form)
    st = torch.cuda.memory_stats(form)
    if (st["allocation.all.allocated"], st["allocation.all.freed"]) != (0, 0) or \
            st["allocation.all.current"] != current:
        errors.append(f"after reset_accumulated_memory_stats({name}) allocation.all is "
                      f"allocated={st['allocation.all.allocated']} freed="
                      f"{st['allocation.all.freed']} current={st['allocation.all.current']} "
                      f"(current was {current})")
    return total


def must_raise(what, fn, errors):
    try:
        value = fn()
    except Exception:  # noqa: BLE001  (any exception: the message is PyTorch's or vmm's)
        return
    errors.append(f"{what} for a device that does not exist returned {value!r:.120} instead of "
                  f"raising")


def main():
    errors = []
    torch.empty(1, device="cuda")
    base, res0, count0 = baseline()
    keep = [torch.full((n,), 1.0, device="cuda") for n in (1000, 300_000, 5 * MIB)]
    live = sum(t.numel() * t.element_size() for t in keep)
    totals = {repr(f): check_form(f, live, errors) for f in forms()}
    totals = {k: v for k, v in totals.items() if v is not None}
    if len(set(totals.values())) != 1:
        errors.append(f"mem_get_info's total differs between the forms of device 0: {totals}")

    bad = torch.cuda.device_count()
    before = torch.cuda.memory_allocated()
    for what, fn in (
            ("memory_stats", lambda: torch.cuda.memory_stats(bad)),
            ("memory_allocated", lambda: torch.cuda.memory_allocated(bad)),
            ("memory_reserved", lambda: torch.cuda.memory_reserved(bad)),
            ("max_memory_allocated", lambda: torch.cuda.max_memory_allocated(bad)),
            ("max_memory_reserved", lambda: torch.cuda.max_memory_reserved(bad)),
            ("memory_summary", lambda: torch.cuda.memory_summary(bad)),
            ("reset_peak_memory_stats", lambda: torch.cuda.reset_peak_memory_stats(bad)),
            ("reset_accumulated_memory_stats",
             lambda: torch.cuda.reset_accumulated_memory_stats(bad)),
            ("set_per_process_memory_fraction",
             lambda: torch.cuda.set_per_process_memory_fraction(0.5, bad)),
            ("memory_stats(torch.device('cuda', N))",
             lambda: torch.cuda.memory_stats(torch.device("cuda", bad))),
            ("memory_allocated('cuda:N')", lambda: torch.cuda.memory_allocated(f"cuda:{bad}")),
            ("mem_get_info", lambda: torch.cuda.mem_get_info(bad)),
            ("caching_allocator_alloc", lambda: torch.cuda.caching_allocator_alloc(4096, bad))):
        must_raise(what, fn, errors)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        try:
            getter(bad)
        except Exception:  # noqa: BLE001
            pass

    # The allocator works as before, for device 0 and its fraction.
    if torch.cuda.memory_allocated() != before:
        errors.append(f"the calls for a device that does not exist moved memory_allocated() "
                      f"from {before} to {torch.cuda.memory_allocated()}")
    if getter is not None and getter(0) != 1.0:
        errors.append(f"get_per_process_memory_fraction(0) is {getter(0)} after a fraction "
                      f"was set for device {bad} (none was set for device 0)")
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    if float(t.sum(dtype=torch.float64).item()) != float((1 << 20) * ((1 << 20) - 1) // 2):
        errors.append("a tensor made afterwards sums wrong")
    if any(float(k.min().item()) != 1.0 or float(k.max().item()) != 1.0 for k in keep):
        errors.append("a tensor made before lost its value")
    del t, keep
    settle()  # memory_back() reads the statistics as they are: the cache is emptied here
    memory_back(errors, base, res0, "at the end", count0)
    report(errors)


if __name__ == "__main__":
    main()
