"""The comparison of the case_u_* programs: each runs the same probes (calls with odd
arguments) with PyTorch's allocator, in a child whose environment lacks VMM_TORCH_ENABLE,
and in this program's environment (natively PyTorch's allocator again, under the runner's
vmm mode vmm's), and requires the two to agree on what programs see: a call returned (and
the value, as the probe summarised it) or raised (the exception's type and the key phrases of
its message, PHRASES; the message itself is printed, not compared: PyTorch's and vmm's words
differ). What PyTorch does is never written in the programs.

A probe process prints one line "OUTCOMES <json>": a list of [name, outcome]. A probe list
whose first entry is "_backend" (torch.cuda.get_allocator_backend()) lets the comparison
check that the child really ran PyTorch's allocator.
"""
import json
import os
import subprocess
import sys

from dropin_report import report

#: Parts of a message compared beside the exception's type (programs match them).
PHRASES = ["out of memory"]


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
    """The running program again, as a probe process with `args` after "--probe"."""
    script = os.path.abspath(sys.argv[0])
    return subprocess.Popen([sys.executable, script, "--probe"] + list(args), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def a_tensor_works():
    """A tensor made now, its sum read back (3 * 2**20): what a probe list ends with, to show
    the allocator still serves after the odd calls."""
    import gc

    import torch
    gc.collect()
    torch.cuda.synchronize()
    t = torch.full((1 << 20,), 3.0, device="cuda")
    return float(t.sum(dtype=torch.float64).item())


def emit(results):
    print("OUTCOMES " + json.dumps(results))


def _check_backend(native, errors):
    backend = dict(native).get("_backend", {}).get("value")
    if backend != "native":
        errors.append(f"the process meant to run PyTorch's allocator has backend {backend!r}")


def against_native(probes):
    """A program's main: probes() (a list of [name, outcome]) in a child with PyTorch's
    allocator and in this process, compared; or, run as a probe ("--probe"), its outcomes."""
    if "--probe" in sys.argv:
        emit(probes())
        return
    errors = []
    child = start_probe([], child_env())
    mine = probes()
    native = finish_probe(child, "PyTorch's allocator", errors)
    if native is not None:
        _check_backend(native, errors)
        compare(native, mine, errors, skip=("_backend",))
    report(errors)


def groups_against_native(groups, probe):
    """A program's main where each group of probes needs fresh processes (a call that may
    break a capture must not spoil the next): for each group (a list of strings), probe(group)
    runs in a pair of probe processes, one with PyTorch's allocator and one in this program's
    environment, all pairs at once; the outcomes are compared together."""
    if "--probe" in sys.argv:
        emit(probe(sys.argv[sys.argv.index("--probe") + 1:]))
        return
    errors = []
    runs = [(group, start_probe(group, child_env()), start_probe(group, dict(os.environ)))
            for group in groups]
    native, mine = [], []
    for group, theirs, ours in runs:
        label = group[0] + ("..." if len(group) > 1 else "")
        a = finish_probe(theirs, f"{label} with PyTorch's allocator", errors)
        b = finish_probe(ours, f"{label} in this program's environment", errors)
        if a is not None and b is not None:
            native += a
            mine += b
            _check_backend(a, errors)
    compare([o for o in native if o[0] != "_backend"], [o for o in mine if o[0] != "_backend"],
            errors)
    report(errors)


def named_groups_against_native(groups):
    """groups_against_native for probes grouped by name: `groups` maps a name to a function
    f(torch, rec) that records outcomes with rec(probe_name, fn); each group runs in its own
    pair of probe processes (CUDA made first), its outcomes named "group: probe_name"."""
    def probe(args):
        import torch
        torch.empty(1, device="cuda")
        group = args[0]
        res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]

        def rec(name, fn):
            res.append([f"{group}: {name}", outcome(fn)])

        groups[group](torch, rec)
        return res

    groups_against_native([[g] for g in groups], probe)
