"""An allocator configuration applied again after start-up, naming the backend: a launcher's
PYTORCH_CUDA_ALLOC_CONF string handed down and set at run time
(torch.cuda.memory._set_allocator_settings("backend:native,expandable_segments:False")), the
torch._C function it calls, used directly, and what _accelerator_getAllocatorSettings()
read written back. With PyTorch's allocator in place, naming the backend the process started
with is accepted and changes nothing (run EV: "backend:native" returned None, and tensors
made afterwards were right); naming another raises.

What each call does with PyTorch's allocator is not written here: the probes run in a child
with PyTorch's allocator and in this process, and must agree (outcome_compare.py).

Why vmm may differ (docs/DESIGN.md §2g, "A backend named at run time"): PyTorch's
configuration parser requires a backend named at run time to be the allocator in place, and
vmm's is named "vmm", so the parser's internal assertion raised RuntimeError (run EV);
vmm_torch now leaves the start-up backend's item out before PyTorch parses the string.
"""
import warnings

from outcome_compare import a_tensor_works, against_native, outcome


def probes():
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]

    def rec(name, fn):
        res.append([name, outcome(fn)])

    warnings.simplefilter("ignore", FutureWarning)  # the function's deprecation notice
    setter = torch.cuda.memory._set_allocator_settings
    for text in ("backend:native", "backend:native,expandable_segments:False",
                 "max_split_size_mb:64, backend : native", "backend:cudaMallocAsync",
                 "expandable_segments:False"):
        rec(f"_set_allocator_settings({text!r})", lambda text=text: setter(text))
        rec(f"a tensor after {text!r}", a_tensor_works)
    direct = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if direct is not None:
        rec("torch._C._accelerator_setAllocatorSettings('backend:native')",
            lambda: direct("backend:native"))
        if read is not None:
            rec("what _accelerator_getAllocatorSettings() read, written back",
                lambda: direct(read()))
    rec("a tensor at the end", a_tensor_works)
    return res


if __name__ == "__main__":
    against_native(probes)
