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
plugin raised as ValueError before it raised RuntimeError as PyTorch's allocator does) and
keeps the value it was given rather than PyTorch's bytes-over-total reading of it.
"""
import gc

from outcome_compare import against_native, outcome

MIB = 1 << 20


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


if __name__ == "__main__":
    against_native(probes)
