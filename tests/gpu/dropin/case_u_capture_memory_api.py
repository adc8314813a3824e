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
import json
import os
import subprocess
import sys

from dropin_report import report

MIB = 1 << 20
PHRASES = ["out of memory"]
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
        names = sys.argv[sys.argv.index("--probe") + 1:]
        emit(probe(names))
        return
    errors = []
    runs = [(group, start_probe(group, child_env()), start_probe(group, dict(os.environ)))
            for group in GROUPS]
    native, mine = [], []
    for group, theirs, ours in runs:
        a = finish_probe(theirs, f"{group[0]}... with PyTorch's allocator", errors)
        b = finish_probe(ours, f"{group[0]}... in this program's environment", errors)
        if a is not None and b is not None:
            native += a
            mine += b
            backend = dict(a).get("_backend", {}).get("value")
            if backend != "native":
                errors.append(f"the process meant to run PyTorch's allocator has backend "
                              f"{backend!r}")
    compare([o for o in native if o[0] != "_backend"], [o for o in mine if o[0] != "_backend"],
            errors)
    report(errors)


if __name__ == "__main__":
    main()
