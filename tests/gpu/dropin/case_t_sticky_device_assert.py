"""A device-side assertion caught by the program, which then does what training scripts' error
handlers do, and ends.

A CUDA kernel that reads an index out of range (a class label past the number of classes, a
token id past the vocabulary: here `src[idx]` with an index of 2**40) trips a device-side
assertion, a sticky CUDA error: from then on every CUDA call of the process that needs the GPU
fails. Programs catch it (a RuntimeError), log torch.cuda.memory_allocated(),
max_memory_allocated(), memory_stats(), memory_summary() and a memory snapshot, drop tensors,
delete a captured CUDA graph (its output kept) and a torch.cuda.MemPool object (its tensors
kept), try to allocate, call empty_cache(), and end: through the end of the script with CUDA
tensors alive in module globals, through sys.exit(3), or by letting an exception escape (exit
status 1); and once more through the end of the script with CUDA_LAUNCH_BLOCKING=1, which users
set to find such an error (there the error is raised by the indexing itself; no CUDA graph is
captured in that run).

What PyTorch's allocator does after such an error is not written here: each of the four runs is
a child process started twice at once, with PyTorch's allocator (VMM_TORCH_ENABLE removed from
its environment) and with this program's environment (vmm under the runner's vmm run), and the
two must agree on:
 - the exit status (no signal, no hang: each child has 40 s);
 - the host-side reads of the allocator's state and the drops and deletions (memory_allocated()
   > 0, max_memory_allocated() >= memory_allocated(), memory_stats()'s keys, memory_summary(),
   memory_snapshot(), reset_peak_memory_stats(), dropping tensors, deleting the graph and the
   MemPool): returned (and the summary of the value) or raised; RuntimeError and its subclasses
   (torch.AcceleratorError, torch.cuda.OutOfMemoryError) count as one kind;
 - for the calls that need the GPU (a tensor of a size the cache holds, a new 256 MiB tensor,
   empty_cache(), torch.cuda.synchronize()): none raises an exception outside RuntimeError's
   family; empty_cache() (error handlers call it) raises exactly where and what PyTorch's
   allocator raises (torch.AcceleratorError for the CUDA error, where torch has it: programs
   catch that type), and so does the new tensor where both raise (vmm may map new memory
   without a call that reports the error: with CUDA_LAUNCH_BLOCKING=1 it returned the tensor,
   which, like one from either cache, no kernel can use);
 - stderr: no line saying "terminate called", "Segmentation fault", "double free", "Aborted",
   "core dumped" or "Fatal Python error" where PyTorch's run has none.

Why vmm may differ: vmm's frees, its private pools' teardown (the deleted graph's pool and the
MemPool's, closed at their last release: a device synchronisation, unmaps and releases), its
cache release and its exit hooks make driver calls that PyTorch's allocator does not make
there; after a sticky error each of them fails. A failure raised from a deleter, a C++
destructor or an exit hook ends the process (std::terminate), and one that loops or waits on
the broken context hangs it.
"""
import json
import os
import subprocess
import sys
import time

from dropin_report import report
from outcome_compare import child_env

MIB = 1 << 20
CHILD_TIMEOUT = 40
CRASH_WORDS = ("terminate called", "segmentation fault", "double free", "aborted",
               "core dumped", "fatal python error")
RUNS = [("end", {}), ("exit3", {}), ("raise", {}), ("end", {"CUDA_LAUNCH_BLOCKING": "1"})]

# Held to the end of the child (module globals: dropped by the interpreter's exit).
HELD = []


def fam(fn):
    """What fn() did, with RuntimeError and its subclasses as one kind."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001  (what is raised is the outcome)
        kind = "RuntimeError" if isinstance(e, RuntimeError) else type(e).__name__
        text = str(e).strip().splitlines()
        return {"kind": "raised", "type": kind, "exact": type(e).__name__,
                "text": text[0][:200] if text else ""}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = f"<{type(value).__name__}>"
    return {"kind": "returned", "value": value}


def show(o):
    if o is None:
        return "(missing)"
    if o["kind"] == "returned":
        return f"returned {o['value']!r}"
    return f"raised {o['exact']} ({o['type']}) {o['text']!r}"


def child(mode):
    import gc

    import torch

    graphs = os.environ.get("CUDA_LAUNCH_BLOCKING") != "1"
    out = []

    def rec(name, how, fn):
        out.append([name, how, fam(fn)])

    rec("_backend", "skip", torch.cuda.get_allocator_backend)
    keep = [torch.full((n,), float(i), device="cuda")
            for i, n in enumerate((1, 1000, 300_000, 3 * MIB, 33 * MIB))]
    box = {"pool": torch.cuda.MemPool()}
    with torch.cuda.use_mem_pool(box["pool"]):
        pooled = [torch.ones(n, device="cuda") for n in (1000, 2 * MIB)]
    static_in = torch.ones(MIB, device="cuda")
    static_out = None
    if graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static_in * 2 + 1  # warm up off the default stream, as PyTorch asks
        torch.cuda.current_stream().wait_stream(side)
        box["graph"] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(box["graph"]):
            static_out = static_in * 2 + 1
        static_in.fill_(2.0)
        box["graph"].replay()
    src = torch.arange(4096, dtype=torch.float32, device="cuda")
    bad = torch.tensor([0, 1 << 40], dtype=torch.int64, device="cuda")
    spare = torch.empty(8 * MIB, device="cuda")  # 32 MiB, freed: a cached block (after the
    del spare  # capture, which empties the cache)
    torch.cuda.synchronize()
    if graphs and float(static_out[0].item()) != 5.0:
        print("the graph's replay is wrong before the error", file=sys.stderr)
    HELD.extend([keep, pooled, static_in, static_out])

    def trip():
        picked = src[bad]  # index 2**40 of 4096 elements: a device-side assertion
        torch.cuda.synchronize()
        return float(picked.sum().item())
    rec("the out-of-range index (then synchronize)", "strict", trip)

    rec("memory_allocated() > 0", "strict", lambda: torch.cuda.memory_allocated() > 0)
    rec("max_memory_allocated() >= memory_allocated()", "strict",
        lambda: torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated())
    rec("memory_stats() has allocated_bytes.all.current", "strict",
        lambda: "allocated_bytes.all.current" in torch.cuda.memory_stats())
    rec("memory_summary() is text", "strict",
        lambda: isinstance(torch.cuda.memory_summary(), str))
    rec("memory_snapshot() lists segments", "strict",
        lambda: len(torch.cuda.memory_snapshot()) > 0)
    rec("reset_peak_memory_stats()", "strict", torch.cuda.reset_peak_memory_stats)

    def drop_some():
        del keep[:3]
        gc.collect()
        return len(keep)
    rec("dropping three tensors", "strict", drop_some)

    def drop_pool():
        del box["pool"]
        gc.collect()
        return True
    rec("deleting the MemPool object (its tensors live)", "strict", drop_pool)

    if graphs:
        def drop_graph():
            del box["graph"]
            gc.collect()
            return True
        rec("deleting the CUDA graph (its output lives)", "strict", drop_graph)

    rec("memory_allocated() > 0 after the drops", "strict",
        lambda: torch.cuda.memory_allocated() > 0)
    rec("a tensor of a size the cache holds (32 MiB)", "loose",
        lambda: torch.empty(8 * MIB, device="cuda").numel())
    rec("a new 256 MiB tensor", "type-if-raised",
        lambda: torch.empty(256 * MIB, dtype=torch.uint8, device="cuda").numel())
    rec("empty_cache()", "same-type", torch.cuda.empty_cache)
    rec("torch.cuda.synchronize() again", "loose", torch.cuda.synchronize)
    rec("memory_stats() at the end has its keys", "strict",
        lambda: "reserved_bytes.all.current" in torch.cuda.memory_stats())
    print("OUTCOMES " + json.dumps(out), flush=True)
    sys.stderr.flush()
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise RuntimeError("the job gives up after a CUDA error")


def start(mode, extra, env):
    env = dict(env)
    env.update(extra)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, deadline):
    """(returncode or "hung", outcomes or None, stderr)."""
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return "hung", None, err
    lines = [line for line in out.splitlines() if line.startswith("OUTCOMES ")]
    return proc.returncode, (json.loads(lines[-1][len("OUTCOMES "):]) if lines else None), err


def crash_lines(err):
    return [line for line in err.splitlines()
            if any(w in line.lower() for w in CRASH_WORDS)]


def compare_run(label, native, mine, errors):
    n_rc, n_out, n_err = native
    m_rc, m_out, m_err = mine
    if n_rc == "hung" or n_out is None:
        errors.append(f"{label}: PyTorch's allocator's run did not finish as expected "
                      f"(status {n_rc}); stderr: {' | '.join(n_err.strip().splitlines()[-5:])}")
        return
    backend = {name: o for name, _, o in n_out}.get("_backend", {}).get("value")
    if backend != "native":
        errors.append(f"{label}: the run meant to use PyTorch's allocator has backend "
                      f"{backend!r}")
    if m_rc != n_rc:
        errors.append(f"{label}: exit status {m_rc}, {n_rc} with PyTorch's allocator; stderr: "
                      f"{' | '.join(m_err.strip().splitlines()[-6:])}")
    new_crash = crash_lines(m_err) if not crash_lines(n_err) else []
    if new_crash:
        errors.append(f"{label}: stderr says {new_crash[:3]}")
    if m_out is None:
        errors.append(f"{label}: no outcomes printed (status {m_rc}); stderr: "
                      f"{' | '.join(m_err.strip().splitlines()[-6:])}")
        return
    theirs = {name: (how, o) for name, how, o in n_out}
    print(f"--- {label}: exit status {n_rc} (PyTorch's allocator) / {m_rc} (here)")
    for name, how, o in m_out:
        if how == "skip":
            continue
        t = theirs.get(name, (how, None))[1]
        print(f"   {name:48s} | {show(t)} | {show(o)}")
        if t is None:
            errors.append(f"{label}: {name}: not run with PyTorch's allocator")
            continue
        if how == "strict":
            if o["kind"] != t["kind"] or (o["kind"] == "returned" and o["value"] != t["value"]) \
                    or (o["kind"] == "raised" and o["type"] != t["type"]):
                errors.append(f"{label}: {name}: PyTorch's allocator {show(t)}; here {show(o)}")
        elif how == "same-type" and (o["kind"] != t["kind"] or o.get("exact") != t.get("exact")):
            errors.append(f"{label}: {name}: PyTorch's allocator {show(t)}; here {show(o)}")
        elif how == "type-if-raised" and o["kind"] == t["kind"] == "raised" \
                and o["exact"] != t["exact"]:
            errors.append(f"{label}: {name}: PyTorch's allocator {show(t)}; here {show(o)}")
        elif o["kind"] == "raised" and o["type"] != "RuntimeError":
            errors.append(f"{label}: {name}: {show(o)}, outside RuntimeError's family "
                          f"(PyTorch's allocator: {show(t)})")


def main():
    errors = []
    deadline = time.monotonic() + CHILD_TIMEOUT
    pairs = [(mode, extra, start(mode, extra, child_env()), start(mode, extra, os.environ))
             for mode, extra in RUNS]
    for mode, extra, theirs, ours in pairs:
        label = mode + (" with CUDA_LAUNCH_BLOCKING=1" if extra else "")
        compare_run(label, finish(theirs, deadline), finish(ours, deadline), errors)
    report(errors)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[sys.argv.index("--child") + 1])
    else:
        main()
