"""A tensor allocated and used on a side stream, dropped on the host while that stream still
works, must not be handed to allocations on another stream before the side stream is done.

PyTorch's allocator keeps a freed block for the stream that allocated it: allocations on the
default stream never get it without synchronization. So: on a side stream allocate x, sleep
on the GPU, then compute y = x * 2; drop x on the host at once; on the default stream (which
does not wait for the side stream) allocate and fill many tensors of x's size with 7; after
synchronizing, y must be all 2. Sizes from 1 KiB to 64 MiB, several rounds.

Why vmm may differ: vmm tags free blocks with streams and reclaims blocks other streams
freed once their events complete (ReclaimOtherStreams, NarrowAnyTo); a wrong tag or event
hands x's memory to the default stream early.
"""

import torch
from dropin_report import report


def main():
    torch.cuda.init()
    errors = []
    side = torch.cuda.Stream()
    for n in (256, 1 << 16, 1 << 20, 1 << 24):
        for rnd in range(3):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x = torch.full((n,), 1.0, device="cuda")
                torch.cuda._sleep(50_000_000)
                y = x * 2
            del x
            fills = [torch.empty(n, device="cuda").fill_(7.0) for _ in range(4)]
            torch.cuda.synchronize()
            bad = int((y != 2).sum().item())
            if bad:
                errors.append(f"n={n} round {rnd}: {bad} elements of y are not 2 (x's memory "
                              f"was given to the default stream while the side stream used it)")
            del y, fills
    report(errors)


if __name__ == "__main__":
    main()
