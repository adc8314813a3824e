"""torch.cuda's memory API called inside a CUDA graph capture (torch.cuda.graph): monitoring
hooks, loggers and OOM guards run inside captured regions (a forward pass under
make_graphed_callables, a vLLM or SGLang capture of decode steps with a logging callback),
and call empty_cache(), memory_stats(), memory_allocated(), reset_peak_memory_stats(),
reset_accumulated_memory_stats(), memory_snapshot(), memory_summary(), mem_get_info(),
get/set_per_process_memory_fraction() and caching_allocator_alloc()/delete() there.

For each: what the call did (returned, or raised which type), whether the capture then ended
without error, whether a replay computes the captured y = x * 2 + 1 from new input, and
whether a tensor made after all that is right. What PyTorch's allocator does is not written
here (some of these raise there: empty_cache() inside a capture reaches an assertion that no
capture is under way): each probe runs in a fresh process with PyTorch's allocator
(VMM_TORCH_ENABLE removed) and in one with this program's environment (vmm under the
runner's vmm run), so that a capture one call breaks cannot spoil the next, and the two
must agree (the calls that only read statistics share a process, each in its own graph).

Why vmm may differ: vmm answers these calls itself (statistics and snapshots from libvmm,
empty_cache through libvmm's sweep, the fraction through its cap, raw blocks through
CUDAPluggableAllocator's bookkeeping and vmm's capture routes); a call that synchronizes the
device, or that vmm defers or accepts where PyTorch's allocator refuses, changes the
outcome.
"""

from outcome_compare import groups_against_native, outcome

MIB = 1 << 20
GROUPS = [
    ["empty_cache"],
    ["mem_get_info"],
    ["caching_allocator_alloc"],
    ["set_per_process_memory_fraction"],
    ["memory_stats", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
     "reset_accumulated_memory_stats", "memory_snapshot", "memory_summary",
     "get_per_process_memory_fraction"],
]


def calls():
    import torch

    def raw():
        p = torch.cuda.caching_allocator_alloc(MIB)
        kind = "null" if p == 0 else "pointer"
        torch.cuda.caching_allocator_delete(p)
        return kind

    return {
        "empty_cache": torch.cuda.empty_cache,
        "mem_get_info": lambda: torch.cuda.mem_get_info()[1] > 0,
        "caching_allocator_alloc": raw,
        "set_per_process_memory_fraction": lambda: torch.cuda.set_per_process_memory_fraction(1.0),
        "memory_stats": lambda: len(torch.cuda.memory_stats()) > 0,
        "memory_allocated": lambda: torch.cuda.memory_allocated() > 0,
        "max_memory_allocated": lambda: torch.cuda.max_memory_allocated() > 0,
        "reset_peak_memory_stats": torch.cuda.reset_peak_memory_stats,
        "reset_accumulated_memory_stats": torch.cuda.reset_accumulated_memory_stats,
        "memory_snapshot": lambda: isinstance(torch.cuda.memory_snapshot(), list),
        "memory_summary": lambda: isinstance(torch.cuda.memory_summary(), str),
        "get_per_process_memory_fraction":
            lambda: round(torch.cuda.get_per_process_memory_fraction(), 6),
    }


def probe(names):
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]
    table = calls()
    x = torch.zeros(MIB, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2 + 1  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for name in names:
        graph = torch.cuda.CUDAGraph()
        box = {}

        def capture():
            with torch.cuda.graph(graph):
                y = x * 2
                box["call"] = outcome(table[name])
                box["y"] = y + 1
            return "ended"

        res.append([f"{name}: the capture", outcome(capture)])
        res.append([f"{name}: the call inside it", box.get("call")])

        def replay():
            x.fill_(3.0)
            graph.replay()
            torch.cuda.synchronize()
            return bool((box["y"] == 7.0).all().item())

        res.append([f"{name}: replay right", outcome(replay)])

        def after():
            torch.cuda.synchronize()
            t = torch.full((MIB,), 2.0, device="cuda")
            return float(t.sum(dtype=torch.float64).item())

        res.append([f"{name}: a tensor after", outcome(after)])
        graph = box = None  # noqa: F841  (this graph goes before the next)
    return res


if __name__ == "__main__":
    groups_against_native(GROUPS, probe)
