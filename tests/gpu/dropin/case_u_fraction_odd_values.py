"""torch.cuda.set_per_process_memory_fraction with unusual values, and
get_per_process_memory_fraction after each: nan, +-inf, -0.0, 0.0, 1e-300, 1.0, 1 (an int),
True, 1.0000001, -1e-9, a float subclass, a string, None, device forms ("cuda:0",
torch.device, "cpu"), and whether a 64 MiB tensor (after empty_cache) can be allocated under
the fractions that were accepted. Trainers set the fraction from a config value (a float
that may be nan after a bad division, an int 1 from YAML) and catch what it raises.

With PyTorch's allocator, torch.cuda's Python wrapper refuses non-floats (TypeError) and
values outside [0, 1] it can see (ValueError); nan and -0.0 pass that test and reach the
allocator, whose own check refuses nan (a RuntimeError, "invalid fraction") and takes -0.0
as 0. What each call did is not written here: the same probe runs in a child with PyTorch's
allocator (VMM_TORCH_ENABLE removed from its environment) and in this process, and the
outcomes must agree: returned (and the fraction read back, to 6 decimals, -0.0 as 0.0) or
raised (the exception's type, and whether the message says "out of memory").

Why vmm may differ: vmm checks the fraction itself (libvmm: an invalid argument, which the
plugin raises as ValueError) and keeps the value it was given rather than PyTorch's
bytes-over-total reading of it.
"""
import gc
import json
import os
import subprocess
import sys

from dropin_report import report

MIB = 1 << 20
PHRASES = ["out of memory"]


class Fraction(float):
    """A float subclass, as config libraries hand out."""


def probes():
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]
    setf = torch.cuda.set_per_process_memory_fraction
    getf = torch.cuda.get_per_process_memory_fraction

    def rec(name, fn):
        res.append([name, outcome(fn)])

    def read(device=None):
        return round(float(getf(device)), 6) + 0.0

    def alloc64():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        del t
        return "allocated"

    rec("get() at first", read)
    steps = [
        ("0.5", 0.5, True), ("nan", float("nan"), True), ("inf", float("inf"), False),
        ("-inf", float("-inf"), False), ("-0.0", -0.0, True), ("1.0 (a)", 1.0, True),
        ("0.0", 0.0, True), ("1.0 (b)", 1.0, True), ("1e-300", 1e-300, True),
        ("1 (int)", 1, False), ("True", True, False), ("1.0000001", 1.0000001, False),
        ("-1e-9", -1e-9, False), ("Fraction(0.25)", Fraction(0.25), True),
        ("'0.5' (str)", "0.5", False), ("None", None, False),
        ("0.9999999999", 0.9999999999, True),
    ]
    for label, value, try_alloc in steps:
        rec(f"set({label})", lambda value=value: setf(value))
        rec(f"get() after set({label})", read)
        if try_alloc:
            rec(f"64 MiB tensor after set({label})", alloc64)
    rec("set(0.75, 'cuda:0')", lambda: setf(0.75, "cuda:0"))
    rec("get('cuda') after it", lambda: read("cuda"))
    rec("get(torch.device('cuda', 0)) after it", lambda: read(torch.device("cuda", 0)))
    rec("set(0.5, torch.device('cuda'))", lambda: setf(0.5, torch.device("cuda")))
    rec("get(0) after it", lambda: read(0))
    rec("set(0.5, 'cpu')", lambda: setf(0.5, "cpu"))
    rec("get() after set(0.5, 'cpu')", read)
    rec("set(1.0) at the end", lambda: setf(1.0))
    rec("get() at the end", read)
    rec("64 MiB tensor at the end", alloc64)
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
