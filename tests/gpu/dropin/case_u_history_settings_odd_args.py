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
import json
import os
import pickle
import subprocess
import sys
import tempfile

from dropin_report import report

MIB = 1 << 20
PHRASES = ["out of memory"]


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


# --- the comparison harness (the same in every case_u_* program) -----------------------------


def outcome(fn):
    """What fn() did: {"kind": "returned", "value": ...} (the value as fn summarised it) or
    {"kind": "raised", "type": ..., "phrases": [...], "text": ...}."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001  (what is raised is the outcome)
        try:
            text = str(e)
        except Exception:  # noqa: BLE001
            text = ""
        lines = text.strip().splitlines()
        low = text.lower()
        return {"kind": "raised", "type": type(e).__name__,
                "phrases": [p for p in PHRASES if p in low],
                "text": lines[0][:200] if lines else ""}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = f"<{type(value).__name__}>"
    return {"kind": "returned", "value": value}


def same(a, b):
    """Whether two outcomes agree in what programs see: returned (and the value) or raised (the
    exception's type and the key phrases of its message)."""
    if a is None or b is None or a["kind"] != b["kind"]:
        return False
    if a["kind"] == "returned":  # as JSON: a tuple is a list, nan equals nan
        return json.dumps(a["value"], sort_keys=True) == json.dumps(b["value"], sort_keys=True)
    return a["type"] == b["type"] and a["phrases"] == b["phrases"]


def show(o):
    if o is None:
        return "(missing)"
    if o["kind"] == "returned":
        return f"returned {o['value']!r}"
    return f"raised {o['type']} {o['phrases']} {o['text']!r}"


def child_env():
    """This program's environment without VMM_TORCH_ENABLE: PyTorch's own allocator (the
    runner's sitecustomize only adds vmm_torch's folder; vmm is enabled by that variable)."""
    return {k: v for k, v in os.environ.items() if k != "VMM_TORCH_ENABLE"}


def start_probe(args, env):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe"] + args,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_probe(proc, label, errors, timeout=50):
    """The outcomes a probe process printed (a list of [name, outcome]), or None."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        errors.append(f"{label}: the probe process hung")
        return None
    lines = [line for line in out.splitlines() if line.startswith("OUTCOMES ")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(err.strip().splitlines()[-5:])
        errors.append(f"{label}: the probe process exited {proc.returncode} without outcomes: "
                      f"{tail}")
        return None
    return json.loads(lines[-1][len("OUTCOMES "):])


def compare(native, mine, errors, skip=()):
    """Prints the table native | this process and adds each disagreement to `errors`."""
    theirs = dict((name, o) for name, o in native)
    ours = dict((name, o) for name, o in mine)
    names = [name for name, _ in native] + [n for n, _ in mine if n not in theirs]
    mode = "vmm" if os.environ.get("VMM_TORCH_ENABLE") else "native"
    print(f"{'probe':44s} | PyTorch's allocator (child) | this process ({mode})")
    for name in names:
        a, b = theirs.get(name), ours.get(name)
        flag = "  " if same(a, b) else "!="
        print(f"{flag} {name:41s} | {show(a)} | {show(b)}")
        if name in skip:
            continue
        if not same(a, b):
            errors.append(f"{name}: PyTorch's allocator {show(a)}; here {show(b)}")


def emit(results):
    print("OUTCOMES " + json.dumps(results))


def main():
    if "--probe" in sys.argv:
        emit(probes())
        return
    errors = []
    child = start_probe([], child_env())
    mine = probes()
    native = finish_probe(child, "PyTorch's allocator", errors)
    if native is not None:
        backend = dict(native).get("_backend", {}).get("value")
        if backend != "native":
            errors.append(f"the child meant to run PyTorch's allocator has backend {backend!r}")
        compare(native, mine, errors, skip=("_backend",))
    report(errors)


if __name__ == "__main__":
    main()
