"""Tensor.record_stream keeps a block from being reused while another stream still uses it
(PyTorch's own test_record_stream, plus a larger and a smaller variant).

A pinned host tensor is copied non_blocking to the GPU on a side stream; the copy is used on
the current stream after a long GPU sleep, with tmp.record_stream(current stream); tmp is
dropped on the host at once; a new allocation on the side stream, zeroed there, must not get
tmp's memory while the delayed read is pending, so the result is [1, 2, 3, 4] (and the same
with 1 MiB and 64 MiB tensors).

Why vmm may differ: vmm's record_stream hook and its stream-ordered reuse with events decide
when a freed block may be handed out again (stream_reclaim, Pool::RecordStream).
"""

import torch
from dropin_report import report


def run(n, cycles):
    src = torch.arange(1, n + 1, dtype=torch.float32).pin_memory()
    result = torch.empty(n, device="cuda")
    stream = torch.cuda.Stream()
    ptr = [None]

    def perform_copy():
        with torch.cuda.stream(stream):
            tmp = src.cuda(non_blocking=True)
            ptr[0] = tmp.data_ptr()
        torch.cuda.current_stream().wait_stream(stream)
        tmp.record_stream(torch.cuda.current_stream())
        torch.cuda._sleep(cycles)  # delay the copy below
        result.copy_(tmp)

    perform_copy()
    with torch.cuda.stream(stream):
        tmp2 = torch.empty(n, device="cuda")
        tmp2.zero_()
        reused_too_soon = tmp2.data_ptr() == ptr[0]
    torch.cuda.synchronize()
    ok = torch.equal(result.cpu(), src)
    return ok, reused_too_soon


def main():
    torch.cuda.init()
    errors = []
    for n in (4, 1 << 18, 1 << 24):
        ok, early = run(n, 100_000_000)
        if not ok:
            errors.append(f"n={n}: the delayed read saw other data (memory reused too soon)")
        if early:
            errors.append(f"n={n}: the block was handed out again while the recorded stream "
                          f"still used it")
    report(errors)


if __name__ == "__main__":
    main()
