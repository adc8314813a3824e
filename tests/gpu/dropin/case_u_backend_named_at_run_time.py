"""torch.cuda.memory._set_allocator_settings("backend:native") at run time, as a program does
that applies an allocator configuration string again after start-up (a launcher's settings
handed down, a trainer's flag): with PyTorch's allocator in place, naming its own backend is
accepted and changes nothing (run EV: returned None, and tensors made afterwards are right).

Why vmm may differ (docs/DESIGN.md §2g, "A backend named at run time"): PyTorch's
configuration parser requires a backend named at run time to be the allocator in place, and
vmm's is named "vmm", so the parser's internal assertion raised RuntimeError (run EV);
vmm_torch now leaves the start-up backend's item out before PyTorch parses the string.
"""
import warnings

import torch
from dropin_report import report

N = 1 << 20


def main():
    errors = []
    torch.empty(1, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the function's deprecation notice
        try:
            torch.cuda.memory._set_allocator_settings("backend:native")
        except RuntimeError as e:
            errors.append(f"_set_allocator_settings('backend:native') raised RuntimeError: "
                          f"{str(e).splitlines()[0][:200]}")
    t = torch.full((N,), 2.0, device="cuda")
    if float(t.sum(dtype=torch.float64).item()) != 2.0 * N:
        errors.append("a tensor made afterwards sums wrong")
    report(errors)


if __name__ == "__main__":
    main()
