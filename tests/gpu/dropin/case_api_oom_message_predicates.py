"""Out-of-memory errors as libraries recognise them: the batch-size finders of Hugging Face
Accelerate (find_executable_batch_size, also behind transformers' auto_find_batch_size),
toma and PyTorch Lightning (BatchSizeFinder) decide from the exception's message whether to
halve the batch and retry, and re-raise anything else.

With PyTorch's allocator a request that does not fit raises torch.cuda.OutOfMemoryError, a
RuntimeError with a single argument whose message begins "CUDA out of memory. Tried to
allocate", so Accelerate's older test and toma's (`"CUDA out of memory." in e.args[0]`),
Accelerate's current one (`" out of memory." in e.args[0]`) and Lightning's (`"CUDA" in ...
and "out of memory" in ...`) all accept it. The case caps the process with
set_per_process_memory_fraction at what it holds plus 1.5 GiB (get_per_process_memory_fraction,
where this PyTorch has it, returns the fraction set) and runs an Accelerate-style finder whose
step makes two tensors of `batch` MiB each, from a batch of 8192 down: 8192, 4096 and 2048 fail
at the first tensor, 1024 at the second, 512 fits (4 OOMs, and the finder ends at 512);
the handler prints memory_summary() and empties the cache, as training scripts do. Then, with
the cap lifted, a 1 TiB request is tested the same way. Afterwards memory_allocated() is back
at the baseline and a tensor made before is intact. Where Accelerate is installed its own
should_reduce_batch_size is asked too.

Why vmm may differ: vmm raises the error itself, with its own message
(vmm_cuda_allocator.cpp: OutOfMemory, ThrowLastError), and enforces the fraction with its own
cap (device_cap.h).
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20
GIB = 1 << 30
ROW = MIB // 4  # float32 elements of one MiB


def accelerate_old(e):  # Accelerate before 0.30, toma, blackhc.toma, many copies of them
    return isinstance(e, RuntimeError) and len(e.args) == 1 and \
        "CUDA out of memory." in str(e.args[0])


def accelerate_new(e):  # accelerate.utils.memory.should_reduce_batch_size today
    return isinstance(e, RuntimeError) and len(e.args) == 1 and \
        " out of memory." in str(e.args[0])


def lightning(e):  # lightning.pytorch.utilities.memory.is_cuda_out_of_memory
    return isinstance(e, RuntimeError) and len(e.args) == 1 and \
        "CUDA" in str(e.args[0]) and "out of memory" in str(e.args[0])


PREDICATES = [("Accelerate<0.30/toma 'CUDA out of memory.'", accelerate_old),
              ("Accelerate ' out of memory.'", accelerate_new),
              ("Lightning 'CUDA' + 'out of memory'", lightning)]
try:
    from accelerate.utils.memory import should_reduce_batch_size as _installed
    PREDICATES.append(("installed accelerate.should_reduce_batch_size", _installed))
except Exception:  # noqa: BLE001  (not installed, or an import error of its own)
    pass


def judge(where, e, errors):
    """Records which library predicates refuse OOM error `e`."""
    if not isinstance(e, torch.cuda.OutOfMemoryError):
        errors.append(f"{where}: {type(e).__name__} instead of torch.cuda.OutOfMemoryError")
        return
    refused = [name for name, pred in PREDICATES if not pred(e)]
    if refused:
        head = str(e.args[0] if e.args else e).splitlines()[0][:160]
        errors.append(f"{where}: the OOM is not recognised by {', '.join(refused)} "
                      f"(args has {len(e.args)} item(s); message: {head!r})")


def step(batch):
    """A training step's worth of memory: two tensors of `batch` MiB."""
    x = torch.empty(batch * ROW, device="cuda")
    x.fill_(1.0)
    y = x * 2.0
    return float(y[-1].item())


def main():
    keep = torch.full((MIB,), 3.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    errors = []
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = (torch.cuda.memory_reserved() + 3 * GIB // 2) / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None and abs(getter() - fraction) > 1e-6:
        errors.append(f"get_per_process_memory_fraction() = {getter()}, set {fraction}")

    # find_executable_batch_size, as Accelerate writes it (the predicate decides; here the
    # exception type does, so that the rest of the case runs, and the predicates are judged).
    batch, tried, ooms, result = 8192, [], 0, None
    while batch > 0:
        tried.append(batch)
        try:
            result = step(batch)
            break
        except RuntimeError as e:
            if not isinstance(e, torch.cuda.OutOfMemoryError):
                errors.append(f"batch {batch}: {type(e).__name__}: {str(e)[:200]}")
                break
            ooms += 1
            if ooms == 1:
                judge(f"batch {batch} over the memory fraction", e, errors)
            summary = torch.cuda.memory_summary(abbreviated=True)
            if "CUDA OOMs" not in summary:
                errors.append("memory_summary() after an OOM has no 'CUDA OOMs' line")
            gc.collect()
            torch.cuda.empty_cache()
            batch //= 2
    if (batch, ooms, result) != (512, 4, 2.0):
        errors.append(f"the batch-size finder tried {tried}: ended at {batch} with {ooms} OOMs "
                      f"and step result {result}; expected 512 after 4 OOMs, result 2.0")

    torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        errors.append("a 1 TiB tensor did not raise")
    except RuntimeError as e:
        judge("a 1 TiB request", e, errors)
    gc.collect()
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"after the OOMs memory_allocated is {torch.cuda.memory_allocated()}, "
                      f"{base} before")
    if float(keep.sum().item()) != 3.0 * MIB:
        errors.append("a tensor made before the OOMs changed")
    after = torch.full((256 * ROW,), 1.0, device="cuda")
    if float(after.sum().item()) != 256.0 * ROW:
        errors.append("a 256 MiB tensor made after the OOMs is wrong")
    del after, keep
    report(errors)


if __name__ == "__main__":
    main()
