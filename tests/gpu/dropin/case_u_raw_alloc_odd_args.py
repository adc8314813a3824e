"""torch.cuda.caching_allocator_alloc / caching_allocator_delete with unusual arguments, as
bridges to other libraries (CuPy's, Numba's, TensorRT's and custom kernels' workspace hooks)
call them: size 0 and 1, streams given as 0, 1 (cudaStreamLegacy), 2 (cudaStreamPerThread),
True, a torch.cuda.Stream and its int handle, a string, a float and an Event; devices as
"cuda:0", torch.device and "cpu"; deleting 0, a pointer inside a block, a pointer freed
already, an address never allocated and -1; and the statistics a raw block
moves (allocation.all.current +1 for a 1-byte block).

What each call does with PyTorch's allocator is not written here: the same probe runs in a
child with PyTorch's allocator (VMM_TORCH_ENABLE removed from its environment) and in this
process, and the outcomes must agree: returned (a pointer summarised as "null" or
"pointer") or raised (the exception's type; the message is printed, not compared: PyTorch
says "invalid device pointer", CUDAPluggableAllocator "Trying to free a pointer not
allocated here", and programs do not match either). Negative sizes are not tried: PyTorch
reads the size as ssize_t and hands it on as size_t, where its own rounding overflows.

Why vmm may differ: a raw request goes through CUDAPluggableAllocator's bookkeeping to vmm's
Malloc and PoolStream (which treats streams 0, 1 and 2 apart), and a delete through vmm's
raw_delete (null and restored blocks first).
"""
import gc
import json
import os
import subprocess
import sys

from dropin_report import report

MIB = 1 << 20
PHRASES = ["out of memory"]


def probes():
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]
    alloc = torch.cuda.caching_allocator_alloc
    delete = torch.cuda.caching_allocator_delete
    side = torch.cuda.Stream()

    def rec(name, fn):
        res.append([name, outcome(fn)])

    def kind(p):
        if not isinstance(p, int):
            return type(p).__name__
        return "null" if p == 0 else "pointer"

    def alloc_delete(n, **kw):
        p = alloc(n, **kw)
        k = kind(p)
        if p:
            torch.cuda.synchronize()
            delete(p)
        return k

    rec("alloc(0)", lambda: kind(alloc(0)))
    rec("alloc(0, stream=side)", lambda: kind(alloc(0, stream=side)))
    rec("delete(0)", lambda: delete(0))
    rec("delete(0) again", lambda: delete(0))
    rec("alloc(1) + delete", lambda: alloc_delete(1))
    for label, stream in (("0", 0), ("1 (legacy)", 1), ("2 (per-thread)", 2), ("True", True),
                          ("side Stream", side), ("side.cuda_stream", side.cuda_stream),
                          ("'x'", "x"), ("1.5", 1.5), ("an Event", torch.cuda.Event())):
        rec(f"alloc(4096, stream={label}) + delete",
            lambda stream=stream: alloc_delete(4096, stream=stream))
    rec("alloc(3 MiB, stream=side) + delete", lambda: alloc_delete(3 * MIB, stream=side))
    for label, device in (("'cuda:0'", "cuda:0"), ("torch.device('cuda')", torch.device("cuda")),
                          ("0", 0), ("'cpu'", "cpu")):
        rec(f"alloc(4096, device={label}) + delete",
            lambda device=device: alloc_delete(4096, device=device))

    def under_side_stream():
        with torch.cuda.stream(side):
            return alloc_delete(8192)
    rec("alloc(8192) under torch.cuda.stream(side)", under_side_stream)

    def interior():
        p = alloc(MIB)
        try:
            delete(p + 256)
        finally:
            torch.cuda.synchronize()
            delete(p)
    rec("delete(a pointer 256 bytes into a block)", interior)

    def twice():
        p = alloc(4096)
        delete(p)
        delete(p)
    rec("delete(p) twice (the second)", twice)
    rec("delete(0x3039, never allocated)", lambda: delete(12345))
    rec("delete(-1)", lambda: delete(-1))
    # Not probed: delete(None) and delete(1.5). With PyTorch's allocator (torch 2.11) the
    # binding returns with a Python error still set ("an integer is required"), which surfaces
    # as a SystemError in whatever C call comes next: not an outcome a program can rely on.

    def counted():
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.current"]
        alloc_before = torch.cuda.memory_allocated()
        p = alloc(1)
        during = torch.cuda.memory_stats()["allocation.all.current"]
        grew = torch.cuda.memory_allocated() > alloc_before
        delete(p)
        after = torch.cuda.memory_stats()["allocation.all.current"]
        return [during - before, grew, after - before]
    rec("allocation.all.current +, allocated grew, back (1-byte raw block)", counted)

    def zero_counted():
        before = torch.cuda.memory_stats()["allocation.all.current"]
        p = alloc(0)
        delete(p)
        return torch.cuda.memory_stats()["allocation.all.current"] - before
    rec("allocation.all.current after alloc(0) + delete", zero_counted)

    def still_works():
        gc.collect()
        torch.cuda.synchronize()
        t = torch.full((MIB,), 3.0, device="cuda")
        return float(t.sum(dtype=torch.float64).item())
    rec("a tensor afterwards", still_works)
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
