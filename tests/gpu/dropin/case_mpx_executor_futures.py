"""concurrent.futures.ProcessPoolExecutor(mp_context=torch.multiprocessing.get_context("spawn"))
with CUDA tensors as call arguments (slices of one tensor) and CUDA tensors in the results:
submit + as_completed, map with chunksize, and a call that raises.

With PyTorch's allocator the call items go through the executor's call queue (a
multiprocessing Queue that the executor's manager thread fills; its feeder thread pickles),
the results come back through its result SimpleQueue (pickled in the worker): every result
is a CUDA tensor equal to slice * k, a worker's exception arrives as itself, and the parent's
tensor is unchanged. The parent drops every result before shutdown (a producer must outlive
its consumers' use of what it sent).

Why vmm may differ: Queue.put of the call items runs in the executor's manager thread, not
the caller's (vmm prepares the tensors there, recording the ready event on that thread's
current stream); the call items are _CallItem objects (the put's dry run of pickle walks
them); results are sends from worker processes, whose memory they stay in until the parent
lets go; shutdown ends the workers with their sends acknowledged.
"""
import gc
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch
import torch.multiprocessing as mp
from dropin_report import report

SLICES = 12
LEN = 1024


def scale(x, k):
    return x * k, float(x.double().sum().item())


def boom(x):
    raise ValueError(f"refused a tensor of {x.numel()} elements")


def main():
    ctx = mp.get_context("spawn")
    base = torch.arange(SLICES * LEN, dtype=torch.float32, device="cuda")
    keep = base.clone()
    errors = []
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as ex:
        futures = {ex.submit(scale, base[i * LEN:(i + 1) * LEN], i): i for i in range(SLICES)}
        for fut in as_completed(futures, timeout=90):
            i = futures[fut]
            out, seen = fut.result()
            want = base[i * LEN:(i + 1) * LEN] * i
            if not out.is_cuda or not torch.equal(out, want):
                errors.append(f"submit {i}: the result differs from slice * {i}")
            if seen != float(base[i * LEN:(i + 1) * LEN].double().sum().item()):
                errors.append(f"submit {i}: the worker read sum {seen}")
            del out, want
        del futures, fut
        args = [base[i * LEN:(i + 1) * LEN:3] for i in range(SLICES)]  # strided slices
        results = list(ex.map(scale, args, range(SLICES), chunksize=4, timeout=90))
        for i, (out, _) in enumerate(results):
            if not torch.equal(out, args[i] * i):
                errors.append(f"map {i}: the result differs")
        del results
        try:
            ex.submit(boom, base[:77]).result(timeout=90)
            errors.append("a worker's ValueError did not reach the caller")
        except ValueError as e:
            if "77 elements" not in str(e):
                errors.append(f"the worker's exception arrived as {e!r}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"a worker's ValueError arrived as {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.synchronize()
    if not torch.equal(base, keep):
        errors.append("the parent's tensor changed")
    report(errors)


if __name__ == "__main__":
    main()
