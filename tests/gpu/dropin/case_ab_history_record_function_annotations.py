"""What a memory snapshot records besides allocations and frees, as memory-debugging guides
use it: the torch.profiler.record_function regions ("forward", "optimizer step") that
_record_memory_history() turns into the snapshot's "external_annotations" (START and END
entries with the region's name, the device and a time), which PyTorch's memory viewer draws
over the timeline to show which phase allocated what, from the recording thread and, with
global_record_annotations=True, from other threads; the annotations in a _dump_snapshot()
file; the stack of the call that made a segment (a segment's "frames"); and the pinned-memory
options of PYTORCH_CUDA_ALLOC_CONF as the snapshot's "allocator_settings" report them.

What PyTorch's allocator does is not written here: each group of probes runs in a fresh
process with PyTorch's allocator and in one with this program's environment, and the
outcomes must agree (outcome_compare.py).

Why vmm may differ: _record_memory_history() registers RecordFunction callbacks that call the
allocator's recordAnnotation(), which vmm's allocator (a CUDAPluggableAllocator) does not
override (the base class drops the annotation); vmm's snapshot() builds segments, their
frames and the settings itself.
"""
import os
import pickle
import tempfile
import threading

from outcome_compare import named_groups_against_native

ME = os.path.basename(__file__)


def ours(snap):
    return [a for a in snap.get("external_annotations", [])
            if str(a.get("name", "")).startswith("ab_")]


def recording(torch, rec, global_annotations):
    kw = {"global_record_annotations": True} if global_annotations else {}
    rec("_record_memory_history(...)", lambda: torch.cuda.memory._record_memory_history(
        max_entries=100_000, stacks="python", **kw))
    keep = []

    def worker():
        with torch.profiler.record_function("ab_other_thread"):
            keep.append(torch.full((1000,), 1.0, device="cuda"))
    with torch.profiler.record_function("ab_phase_one"):
        keep.append(torch.empty(1 << 20, device="cuda"))
    with torch.autograd.profiler.record_function("ab_phase_two"):
        keep.append(torch.empty(4096, device="cuda"))
        with torch.profiler.record_function("ab_inner"):
            keep.append(torch.empty(96 << 20, dtype=torch.uint8, device="cuda"))  # new segment
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    ann = ours(snap)
    rec("the snapshot has 'external_annotations'", lambda: "external_annotations" in snap)
    rec("this thread's annotations: [name, stage] in order", lambda: [
        [a.get("name"), a.get("stage")] for a in ann if a.get("name") != "ab_other_thread"])
    rec("another thread's annotations", lambda: sorted(
        [a.get("name"), a.get("stage")] for a in ann if a.get("name") == "ab_other_thread"))
    rec("annotation keys", lambda: sorted({k for a in ann for k in a}))
    rec("annotation devices and time types", lambda: sorted(
        {f"{a.get('device')}:{type(a.get('time_us')).__name__}" for a in ann}))

    def between():
        t = [e["time_us"] for e in snap["device_traces"][0]
             if e["action"] == "alloc" and e["addr"] == keep[0].data_ptr()]
        se = {a.get("stage"): a.get("time_us") for a in ann if a.get("name") == "ab_phase_one"}
        if not t or "START" not in se or "END" not in se:
            return None
        return se["START"] <= t[-1] <= se["END"]
    rec("phase one's allocation lies between its START and END", between)

    def seg_frames():
        p = keep[2].data_ptr()
        seg = [s for s in snap["segments"] if s["address"] <= p < s["address"] + s["total_size"]]
        blk = [b for s in seg for b in s["blocks"] if b["address"] == p]
        names = lambda fr: any(f.get("filename", "").endswith(ME) for f in fr)  # noqa: E731
        return [bool(seg) and names(seg[0].get("frames", [])),
                bool(blk) and names(blk[0].get("frames", []))]
    rec("96 MiB tensor: [its segment's frames, its block's frames] name this file", seg_frames)

    def dumped():
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.pickle")
            torch.cuda.memory._dump_snapshot(path)
            with open(path, "rb") as f:
                return len(ours(pickle.load(f)))
    rec("annotations in a _dump_snapshot() file", dumped)
    rec("_record_memory_history(enabled=None)",
        lambda: torch.cuda.memory._record_memory_history(enabled=None))
    rec("annotations in a snapshot once recording stopped",
        lambda: len(ours(torch.cuda.memory._snapshot())))


def settings(torch, rec):
    snap = torch.cuda.memory._snapshot()
    st = snap.get("allocator_settings", {})
    rec("allocator_settings keys", lambda: sorted(st))
    for key in ("pinned_use_cuda_host_register", "pinned_num_register_threads"):
        rec(f"allocator_settings[{key!r}]", lambda key=key: st.get(key))
    x = torch.ones(1 << 20).pin_memory()
    rec("a pinned tensor copied to the GPU and back", lambda: float(x.cuda().cpu().sum().item()))


GROUPS = {"thread_local": lambda t, r: recording(t, r, False),
          "global": lambda t, r: recording(t, r, True), "settings": settings}


if __name__ == "__main__":
    # Pinned-memory options, which apply whichever device allocator is in place.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ("pinned_use_cuda_host_register:True,"
                                             "pinned_num_register_threads:4")
    named_groups_against_native(GROUPS)
