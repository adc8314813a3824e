"""A CUDA data prefetcher and an asynchronous result writer, as training and inference loops
write them (apex's data_prefetcher, Lightning's and many inference servers' variants): batches
of pinned host memory are copied to the GPU with non_blocking=True on a side stream one batch
ahead; the consumer makes its stream wait for that stream, calls record_stream(current) on
the batch and drops it when done; results are copied back GPU -> pinned host with
non_blocking=True on a third stream, the GPU result freed right after with
record_stream(d2h stream), and the host copy read only once an event recorded after it has
completed. The consumer's stream lags behind on purpose (a GPU sleep before each batch's
work), so every free happens while the GPU still has work queued on the freed tensor, and
batch sizes vary (1 KiB to 32 MiB) so freed blocks are reused by the next batches and
results.

With PyTorch's allocator a block freed after record_stream is handed out again only once an
event recorded at the free on each recorded stream has completed; so every result read on the
host equals batch * 3 + 1 for its own batch (the host inputs are refilled only after the
event of the copy that read them), and the GPU-side checksums equal the host-side ones.

Why vmm may differ: vmm keeps a freed block pending on per-stream events (stream_reclaim,
Pool::RecordStream) and reuses blocks across streams once those events complete; a block
handed to the next prefetch (side stream) or result (consumer stream) while the lagging
stream still reads or the d2h copy has not yet read it shows as a wrong result on the host.
"""
import torch
from dropin_report import report

ROUNDS = 48
SIZES = [256, 4096, 65_536, 1 << 20, 3 << 20, 8 << 20, 300_001, 17, 2 << 20, 5 << 20]  # f32
SLEEP = 2_000_000  # cycles: about 1 ms before each batch's work
HOST_SLOTS = 3


def fill_host(buf, n, i):
    """Batch i: n float32 values i + (k % 1000) / 1000 (exact in float32 after * 3 + 1)."""
    buf[:n].copy_(torch.arange(n, dtype=torch.float32).remainder_(1000).div_(1000).add_(i))


def expected(n, i):
    """Batch i's result, batch * 3 + 1, computed on the host in float32 as the GPU does."""
    want = torch.empty(n, dtype=torch.float32)
    fill_host(want, n, i)
    return want.mul_(3).add_(1)


class Prefetcher:
    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.slots = [torch.empty(max(SIZES), dtype=torch.float32).pin_memory()
                      for _ in range(HOST_SLOTS)]
        self.slot_events = [None] * HOST_SLOTS
        self.i = 0
        self.next = None
        self.preload()

    def preload(self):
        if self.i >= ROUNDS:
            self.next = None
            return
        i, n = self.i, SIZES[self.i % len(SIZES)]
        slot = i % HOST_SLOTS
        if self.slot_events[slot] is not None:
            self.slot_events[slot].synchronize()  # the copy that read this slot is done
        fill_host(self.slots[slot], n, i)
        with torch.cuda.stream(self.stream):
            gpu = self.slots[slot][:n].to("cuda", non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.slot_events[slot] = ev
            scratch = torch.empty(n, device="cuda")  # the side stream also allocates
            scratch.fill_(-5.0)
            del scratch
        self.next = (i, n, gpu)
        self.i += 1

    def __next__(self):
        if self.next is None:
            raise StopIteration
        torch.cuda.current_stream().wait_stream(self.stream)
        i, n, gpu = self.next
        gpu.record_stream(torch.cuda.current_stream())
        self.preload()
        return i, n, gpu

    def __iter__(self):
        return self


def main():
    torch.cuda.init()
    errors = []
    d2h = torch.cuda.Stream()
    pending = []  # (i, n, host result, event)
    gpu_sums = []  # (i, GPU checksum tensor)
    expected_sums = {}

    def drain(keep):
        while len(pending) > keep:
            i, n, host, ev = pending.pop(0)
            ev.synchronize()
            want = expected(n, i)
            if not torch.equal(host, want):
                bad = int((host != want).sum().item())
                errors.append(f"batch {i} ({n} elements): {bad} values of the result read back "
                              f"differ (e.g. {host[(host != want).nonzero()[0]].tolist()})")

    for i, n, batch in Prefetcher():
        torch.cuda._sleep(SLEEP)  # the consumer lags: the batch's copy and frees are queued
        out = batch * 3 + 1
        del batch  # freed with its record_stream(current) while the stream still runs
        gpu_sums.append((i, out.double().sum()))
        expected_sums[i] = float(expected(n, i).double().sum().item())
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(d2h):
            host.copy_(out, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        out.record_stream(d2h)
        del out  # freed while the d2h copy is queued behind the lagging stream
        junk = torch.empty(n, device="cuda")  # likely the size just freed: must not be it yet
        junk.fill_(-1.0)
        del junk
        pending.append((i, n, host, ev))
        drain(4)
    drain(0)
    torch.cuda.synchronize()
    for i, s in gpu_sums:
        got, want = float(s.item()), expected_sums[i]
        if abs(got - want) > 1e-9 * abs(want) + 1e-6:
            errors.append(f"batch {i}: checksum on the GPU {got}, expected {want}")
    if len(gpu_sums) != ROUNDS:
        errors.append(f"{len(gpu_sums)} batches consumed, {ROUNDS} produced")
    report(errors[:12])


if __name__ == "__main__":
    main()
