"""Tensor.record_stream on several streams at once: a tensor made on the current stream is
read by three side streams, each after a GPU sleep of its own length (the longest last), is
recorded on each of them (on one twice, and through a view too: record_stream keys the
storage), and is dropped on the host at once; then the program allocates hard: more tensors
of its size and one twice as large on the current stream, and tensors of its size on the side
stream that finishes first; all are filled with other values.

With PyTorch's allocator a block freed after record_stream goes back only once an event
recorded at the free on every recorded stream has completed ("memory will not be reused
until all work queued on the recorded streams at the time of the free is done"), so every
side stream's result (x * k, read after its sleep) is exact, for tensors of 4 KiB to 160 MiB,
three rounds each; memory_allocated() no longer counts the dropped tensor at once (the block
is only pending) and is back at its baseline once everything is dropped.

Why vmm may differ: vmm keeps a freed block's recorded streams (Pool::RecordStream,
stream_uses) and orders its reuse with events; a miss may move free chunks to where a request
needs memory (reclaim_policy.h) or hand a block to another stream once the events it waits
for complete: a use that only the first or the last recorded stream covers, or a pending
block taken as free, gives a side stream other bytes.
"""
import torch
from dropin_report import report

MIB = 1 << 20
DELAYS = (10_000_000, 40_000_000, 100_000_000)  # GPU cycles: about 5, 20 and 50 ms


def check(outs, n, rnd, errors):
    for k, early, late in outs:
        for what, t, want in (("before its sleep", early, 1.5), ("after its sleep", late, 3.0 * k)):
            bad = int((t != want).sum().item())
            if bad:
                errors.append(f"n={n} round {rnd}: side stream {k} read x {what} and {bad} of {n} "
                              f"values are not {want} (x's memory was reused while a recorded "
                              f"stream still read it)")


def one_round(n, rnd, sides, errors):
    cur = torch.cuda.current_stream()
    x = torch.full((n,), 3.0, device="cuda")
    outs = []
    for k, (side, delay) in enumerate(zip(sides, DELAYS), start=1):
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            early = x * 0.5
            torch.cuda._sleep(delay)
            late = x * float(k)
        outs.append((k, early, late))
        x.record_stream(side)
    x[n // 2:].record_stream(sides[1])  # a view: the same storage
    x.record_stream(sides[0])  # twice on one stream
    x.record_stream(cur)  # its own stream: nothing to wait for
    before = torch.cuda.memory_allocated()
    del x
    dropped = before - torch.cuda.memory_allocated()
    if dropped < 4 * n:
        errors.append(f"n={n} round {rnd}: dropping the recorded tensor lowered "
                      f"memory_allocated() by {dropped}, less than its {4 * n} bytes")
    junk = [torch.full((n,), -1.0, device="cuda") for _ in range(3)]
    junk.append(torch.full((2 * n,), -1.0, device="cuda"))
    with torch.cuda.stream(sides[0]):
        junk += [torch.full((n,), -2.0, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    check(outs, n, rnd, errors)


def main():
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    base = torch.cuda.memory_allocated()
    sides = [torch.cuda.Stream() for _ in DELAYS]
    for n in (1024, 256 * 1024 + 128, 6 * MIB, 40 * MIB):  # float32 elements
        for rnd in range(3):
            one_round(n, rnd, sides, errors)
        if len(errors) > 12:
            break
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"at the end memory_allocated() is {torch.cuda.memory_allocated()}, "
                      f"{base} at the start")
    report(errors)


if __name__ == "__main__":
    main()
