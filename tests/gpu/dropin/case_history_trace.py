"""torch.cuda.memory._record_memory_history: the trace names the right addresses, is bounded
by max_entries, restarts with clear_history, and survives _dump_snapshot / pickle.

With PyTorch's allocator: after allocating a and b and freeing a, the device trace has an
"alloc" entry with addr == a.data_ptr() and size >= a's bytes, and "free_requested" and
"free_completed" entries for that address; frames of the alloc name this file; with
max_entries=50, 500 allocations leave at most 50 entries; a snapshot's live block for b
carries frames; _dump_snapshot writes a pickle that loads back with the same segments.

Why vmm may differ: vmm keeps its own bounded trace and context recorder
(alloc_history.h) and reports both free entries at the free.
"""
import os
import pickle
import tempfile

import torch
from dropin_report import report

MIB = 1 << 20


def main():
    torch.empty(1, device="cuda")
    errors = []
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    a = torch.empty(3 * MIB + 5, dtype=torch.uint8, device="cuda")
    b = torch.empty(1000, dtype=torch.float32, device="cuda")
    a_ptr, a_size = a.data_ptr(), a.numel()
    del a
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][torch.cuda.current_device()]
    allocs = [e for e in trace if e["action"] == "alloc" and e["addr"] == a_ptr]
    if not allocs:
        errors.append("no alloc entry at a's address")
    elif allocs[-1]["size"] < a_size:
        errors.append(f"alloc entry for a has size {allocs[-1]['size']} < {a_size}")
    elif not any(__file__.split("/")[-1] in f.get("filename", "")
                 for f in allocs[-1].get("frames", [])):
        errors.append("the alloc entry's frames do not name this file")
    for action in ("free_requested", "free_completed"):
        if not any(e["action"] == action and e["addr"] == a_ptr for e in trace):
            errors.append(f"no {action} entry at a's address")
    live = [blk for s in snap["segments"] for blk in s["blocks"]
            if blk["state"] == "active_allocated"]
    addr_of = {}
    for s in snap["segments"]:
        addr = s["address"]
        for blk in s["blocks"]:
            addr_of[addr] = blk
            addr += blk["size"]
    bb = addr_of.get(b.data_ptr())
    if bb is None or bb["state"] != "active_allocated":
        errors.append("b is not an active_allocated block of the snapshot")
    elif not bb.get("frames"):
        errors.append("b's block carries no frames while history is recorded")
    if not live:
        errors.append("no live blocks")

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            loaded = pickle.load(f)
        if len(loaded["segments"]) != len(torch.cuda.memory._snapshot()["segments"]):
            errors.append("the dumped snapshot has a different number of segments")

    # Bounded: max_entries keeps the newest entries only.
    torch.cuda.memory._record_memory_history(enabled=None)
    try:
        torch.cuda.memory._record_memory_history(max_entries=50, clear_history=True)
    except TypeError:
        torch.cuda.memory._record_memory_history(max_entries=50)
    for _ in range(250):
        x = torch.empty(4096, device="cuda")
        del x
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    if len(trace) > 50:
        errors.append(f"max_entries=50 but the trace holds {len(trace)} entries")
    if not any(e["action"] == "alloc" for e in trace):
        errors.append("the bounded trace holds no alloc entry")
    torch.cuda.memory._record_memory_history(enabled=None)
    del b
    report(errors)


if __name__ == "__main__":
    main()
