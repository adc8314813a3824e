"""torch.cuda.memory._record_memory_history with the options memory-debugging guides and tools
use beyond the defaults: context="alloc" / "state" / None / "all", skip_actions, a small
max_entries ring, recording switched off before the snapshot is taken (record during model
setup, snapshot at an out of memory later), the custom metadata of _set_memory_metadata, and
the snapshot written by _dump_snapshot read back and fed to torch.cuda._memory_viz's text and
HTML tools.

With PyTorch's allocator (DeviceCachingAllocator::recordHistory / record_trace, and the
snapshot's block info):
 - enabled="all", context="alloc": the "alloc" entry of a tensor names this file and the
   function that made it in its frames; its free gives "free_requested" and "free_completed"
   entries at its address; the live block of another tensor has frames;
 - context="state": the trace still records the allocation, and the live block has frames
   naming the function that made it;
 - context=None: the trace still records allocations and frees (no stacks needed);
 - context="all": the "free_requested" entry of a freed tensor has frames (the free's stack);
 - skip_actions=["free_requested"] (where this torch has it): no free_requested entry for a
   tensor freed then, while its alloc and free_completed entries are there;
 - max_entries=10 after 60 events: exactly 10 entries, the newest last (the free_completed of
   the last tensor freed);
 - a block allocated while context="state" was recorded still carries its frames in a
   snapshot taken after _record_memory_history(enabled=None) (the block keeps the context it
   was given; switching recording off clears the trace, not the blocks);
 - _set_memory_metadata("...") (where this torch has it): _get_memory_metadata() returns it,
   and the snapshot records it for a tensor allocated after it was set;
 - _dump_snapshot writes a pickle whose "segments" and "device_traces" load back, and
   _memory_viz.trace() and trace_plot() accept it.

Why vmm may differ: vmm keeps its own trace and the stacks of live blocks (alloc_history.h):
which actions get stacks for each context level, its ring, its skip set, what it keeps when
recording is switched off (it drops the stacks of live blocks and reports a block's frames
only while recording is on), and the metadata (VmmAllocator does not override
setUserMetadata / getUserMetadata) are its own.
"""
import inspect
import os
import pickle
import tempfile

import torch
from dropin_report import report

MIB = 1 << 20
HERE = os.path.basename(__file__)
DEV = None


def names_here(frames):
    return {f.get("name") for f in frames or [] if HERE in str(f.get("filename", ""))}


def trace():
    return torch.cuda.memory._snapshot()["device_traces"][DEV]


def block_at(snap, ptr):
    for seg in snap["segments"]:
        addr = seg["address"]
        for blk in seg["blocks"]:
            if addr == ptr:
                return blk
            addr += blk["size"]
    return None


def entries(tr, action, ptr):
    return [e for e in tr if e.get("action") == action and e.get("addr") == ptr]


def record(**kw):
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.memory._record_memory_history(clear_history=True, **kw)


def make_alloc_ctx():
    return torch.empty(3 * MIB + 100, dtype=torch.uint8, device="cuda")


def make_state_ctx():
    return torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")


def drop_in_free_ctx(holder):
    holder.pop()


def contains(obj, text):
    if isinstance(obj, str):
        return text in obj
    if isinstance(obj, dict):
        return any(contains(v, text) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(contains(v, text) for v in obj)
    return False


def main():
    global DEV
    errors = []
    torch.empty(1, device="cuda")
    DEV = torch.cuda.current_device()
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters

    # context="alloc"
    record(enabled="all", context="alloc", stacks="python", max_entries=100_000)
    a = make_alloc_ctx()
    b = torch.empty(1000, device="cuda")
    a_ptr = a.data_ptr()
    del a
    tr = trace()
    allocs = entries(tr, "alloc", a_ptr)
    if not allocs:
        errors.append('context="alloc": no "alloc" entry at the address of the freed tensor')
    elif "make_alloc_ctx" not in names_here(allocs[-1].get("frames")):
        errors.append(f'context="alloc": the "alloc" entry\'s frames do not name make_alloc_ctx '
                      f'in {HERE} ({names_here(allocs[-1].get("frames"))})')
    for action in ("free_requested", "free_completed"):
        if not entries(tr, action, a_ptr):
            errors.append(f'context="alloc": no "{action}" entry at the freed tensor\'s address')
    blk = block_at(torch.cuda.memory._snapshot(), b.data_ptr())
    if blk is None or not blk.get("frames"):
        errors.append('context="alloc": the live block of a tensor has no frames')
    del b

    # context="state"
    record(enabled="all", context="state", stacks="python", max_entries=100_000)
    c = make_state_ctx()
    if not entries(trace(), "alloc", c.data_ptr()):
        errors.append('context="state": the trace has no "alloc" entry for a new tensor')
    blk = block_at(torch.cuda.memory._snapshot(), c.data_ptr())
    if blk is None or "make_state_ctx" not in names_here(blk.get("frames")):
        errors.append('context="state": the live block\'s frames do not name make_state_ctx')

    # Recording switched off: the live block keeps the frames it was given.
    torch.cuda.memory._record_memory_history(enabled=None)
    blk = block_at(torch.cuda.memory._snapshot(), c.data_ptr())
    if blk is None:
        errors.append("with recording off, the snapshot has no block at a live tensor")
    elif "make_state_ctx" not in names_here(blk.get("frames")):
        errors.append("with recording switched off after the allocation, the snapshot's live "
                      "block lost the frames recorded for it")
    del c

    # context=None: events without stacks.
    record(enabled="all", context=None, stacks="python", max_entries=100_000)
    d = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
    d_ptr = d.data_ptr()
    del d
    tr = trace()
    if not entries(tr, "alloc", d_ptr) or not entries(tr, "free_completed", d_ptr):
        errors.append('context=None: the trace lacks the "alloc" or "free_completed" entry of '
                      'a tensor allocated and freed')

    # context="all": the free's own stack.
    record(enabled="all", context="all", stacks="python", max_entries=100_000)
    holder = [torch.empty(MIB + 512, dtype=torch.uint8, device="cuda")]
    e_ptr = holder[0].data_ptr()
    drop_in_free_ctx(holder)
    freq = entries(trace(), "free_requested", e_ptr)
    if not freq:
        errors.append('context="all": no "free_requested" entry for a freed tensor')
    elif not freq[-1].get("frames"):
        errors.append('context="all": the "free_requested" entry has no frames')

    # skip_actions
    if "skip_actions" in params:
        record(enabled="all", context="all", stacks="python", max_entries=100_000,
               skip_actions=["free_requested"])
        f = torch.empty(700_000, dtype=torch.uint8, device="cuda")
        f_ptr = f.data_ptr()
        del f
        tr = trace()
        if entries(tr, "free_requested", f_ptr):
            errors.append('skip_actions=["free_requested"]: the trace still has a '
                          '"free_requested" entry')
        if not entries(tr, "alloc", f_ptr) or not entries(tr, "free_completed", f_ptr):
            errors.append('skip_actions=["free_requested"]: the "alloc" or "free_completed" '
                          'entry is missing')
    else:
        print("this torch has no skip_actions; not checked")

    # The ring: max_entries=10 after 20 allocations and frees.
    record(enabled="all", context=None, stacks="python", max_entries=10)
    last = None
    for i in range(20):
        t = torch.empty(4096 * (i + 1), dtype=torch.uint8, device="cuda")
        last = t.data_ptr()
        del t
    tr = trace()
    if len(tr) != 10:
        errors.append(f"max_entries=10 after 60 events: the trace holds {len(tr)} entries")
    events = [e for e in tr if e.get("action") != "snapshot"]
    if not events or events[-1].get("action") != "free_completed" or \
            events[-1].get("addr") != last:
        errors.append(f"max_entries=10: the newest entry is not the last free "
                      f"({events[-1] if events else None})")

    # Custom metadata.
    setter = getattr(torch.cuda.memory, "_set_memory_metadata", None)
    getter = getattr(torch.cuda.memory, "_get_memory_metadata", None)
    if setter is not None and getter is not None:
        record(enabled="all", context="all", stacks="python", max_entries=100_000)
        try:
            setter("phase-warmup-42")
            got = getter()
            if got != "phase-warmup-42":
                errors.append(f"_get_memory_metadata() is {got!r} after _set_memory_metadata("
                              f"'phase-warmup-42')")
            h = torch.empty(MIB * 2 + 4096, dtype=torch.uint8, device="cuda")
            snap = torch.cuda.memory._snapshot()
            where = entries(snap["device_traces"][DEV], "alloc", h.data_ptr())
            where += [block_at(snap, h.data_ptr()) or {}]
            if not contains(where, "phase-warmup-42"):
                errors.append("the snapshot does not record the custom metadata set before an "
                              "allocation")
            del h
            setter("")
            if getter() != "":
                errors.append(f"_get_memory_metadata() is {getter()!r} after it was cleared")
        except Exception as e:  # noqa: BLE001
            errors.append(f"custom memory metadata: {type(e).__name__}: {str(e)[:300]}")
    else:
        print("this torch has no _set_memory_metadata; not checked")

    # _dump_snapshot, loaded back, and the viewers' Python side.
    record(enabled="all", context="all", stacks="python", max_entries=100_000)
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (512, 3 * MIB, 200_000)]
    gone = torch.empty(6 * MIB, dtype=torch.uint8, device="cuda")
    del gone
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as fh:
            loaded = pickle.load(fh)
    if not isinstance(loaded.get("segments"), list) or not loaded.get("segments"):
        errors.append("the dumped snapshot has no segments")
    if not isinstance(loaded.get("device_traces"), list) or \
            not loaded["device_traces"][DEV]:
        errors.append("the dumped snapshot has no trace for the device")
    from torch.cuda import _memory_viz
    for name in ("trace", "trace_plot"):
        fn = getattr(_memory_viz, name, None)
        if fn is None:
            continue
        try:
            out = fn(loaded)
            if not isinstance(out, str) or not out:
                errors.append(f"_memory_viz.{name} returned {type(out).__name__}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"_memory_viz.{name} failed on the snapshot: {type(e).__name__}: "
                          f"{str(e)[:300]}")
    del keep
    torch.cuda.memory._record_memory_history(enabled=None)
    report(errors)


if __name__ == "__main__":
    main()
