"""torch.cuda.memory._record_memory_history with unusual arguments, then _snapshot() and
_dump_snapshot(); and torch.cuda.memory._set_allocator_settings with unusual strings. Memory
profilers and trainers' debug flags call these with values from the command line:
enabled=None before anything was recorded, max_entries 0, 1 and 5 (the trace's length after
ten allocations), context None / "alloc" / "state" with stacks "python" (whether the live
block of a tensor has frames, and the trace's length), bad strings for enabled, context and
stacks, max_entries=-1; settings "", an unknown key, "expandable_segments:maybe",
"garbage_collection_threshold:1.5" and ":0.5", "max_split_size_mb:abc",
"backend:cudaMallocAsync" at run time, each followed by a tensor written and read back
("backend:native" is case_u_backend_named_at_run_time, a known gap).

What each call does with PyTorch's allocator is not written here: the same probe runs in a
child with PyTorch's allocator (VMM_TORCH_ENABLE removed from its environment) and in this
process, and the outcomes must agree (returned and the summary of the value, or raised and
the exception's type).

Why vmm may differ: vmm keeps the history itself (alloc_history.h: its own ring of trace
entries, its own reading of max_entries and of the context modes) and builds the snapshot's
blocks from its pools; the settings go to PyTorch's configuration while vmm's allocator is
current (whose name is not PyTorch's backend's).
"""
import gc
import os
import pickle
import tempfile

from outcome_compare import against_native, outcome

MIB = 1 << 20


def probes():
    import torch
    from torch.cuda import memory as tm
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]

    def rec(name, fn):
        res.append([name, outcome(fn)])

    def churn(n):
        ts = [torch.empty(MIB + i * 4096, dtype=torch.uint8, device="cuda") for i in range(n)]
        torch.cuda.synchronize()
        del ts

    def trace_len():
        snap = tm._snapshot()
        traces = snap.get("device_traces") or [[]]
        return len(traces[0])

    def block_has_frames(t):
        """Whether the snapshot's block at t's address lists frames (None: no such block)."""
        address = t.data_ptr()
        for seg in tm._snapshot()["segments"]:
            at = seg["address"]
            for block in seg["blocks"]:
                start = block.get("address", at)
                if start == address and block.get("state") == "active_allocated":
                    return bool(block.get("frames"))
                at = start + block["size"]
        return None

    rec("record(enabled=None) before any recording", lambda: tm._record_memory_history(None))
    for n in (0, 1, 5):
        def limited(n=n):
            tm._record_memory_history("all", max_entries=n)
            churn(10)
            length = trace_len()
            tm._record_memory_history(None)
            return length
        rec(f"trace length, max_entries={n}, 10 tensors", limited)

    def disabled_then_snapshot():
        tm._record_memory_history("all", max_entries=100)
        churn(3)
        tm._record_memory_history(None)
        return [trace_len() > 0, isinstance(tm._snapshot()["segments"], list)]
    rec("trace kept after record(None)? / segments", disabled_then_snapshot)

    for context in (None, "alloc", "state", "all"):
        for enabled in ("all", "state"):
            def mode(context=context, enabled=enabled):
                tm._record_memory_history(enabled, context=context, stacks="python",
                                          max_entries=1000, clear_history=True)
                t = torch.empty(2 * MIB, device="cuda")
                torch.cuda.synchronize()
                out = [block_has_frames(t), trace_len() > 0]
                del t
                tm._record_memory_history(None)
                return out
            rec(f"enabled={enabled} context={context} stacks=python: [block frames, trace]",
                mode)
    rec("record(enabled='bogus')", lambda: tm._record_memory_history("bogus"))
    rec("record(context='bogus')", lambda: tm._record_memory_history("all", context="bogus"))
    rec("record(stacks='cpp')", lambda: tm._record_memory_history("all", stacks="cpp"))
    rec("record(max_entries=-1)", lambda: tm._record_memory_history("all", max_entries=-1))
    rec("record(None) after the bad ones", lambda: tm._record_memory_history(None))

    def dump():
        tm._record_memory_history("all", max_entries=100)
        t = torch.empty(MIB, device="cuda")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.pickle")
            tm._dump_snapshot(path)
            with open(path, "rb") as f:
                snap = pickle.load(f)
        del t
        tm._record_memory_history(None)
        return [type(snap).__name__, sorted(k for k in ("segments", "device_traces")
                                            if k in snap)]
    rec("_dump_snapshot(path) then pickle.load", dump)
    rec("memory_snapshot(mempool_id=(0, 987654)) length",
        lambda: len(torch.cuda.memory_snapshot(mempool_id=(0, 987654))))

    def works():
        t = torch.full((4 * MIB,), 2.0, device="cuda")
        return float(t.sum(dtype=torch.float64).item())

    for setting in ("", "bogus_key_of_no_allocator:1", "expandable_segments:maybe",
                    "garbage_collection_threshold:1.5", "garbage_collection_threshold:0.5",
                    "max_split_size_mb:abc", "backend:cudaMallocAsync",
                    "expandable_segments:False"):
        rec(f"_set_allocator_settings({setting!r})",
            lambda setting=setting: tm._set_allocator_settings(setting))
        rec(f"a tensor after {setting!r}", works)
    gc.collect()
    return res


if __name__ == "__main__":
    against_native(probes)
