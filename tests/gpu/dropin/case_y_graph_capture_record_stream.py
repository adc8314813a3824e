"""Tensor.record_stream inside a CUDA graph capture: captured code that forks a side stream
(a communication or prefetch stream joined into the capture, as DDP's and FSDP's overlapped
collectives and hand-written pipelines do), hands it a tensor with record_stream() and drops
the tensor before the side stream's work is done, then allocates more on the capture stream;
and the converse, a tensor made on the side stream, read on the capture stream after a join,
recorded there and dropped while the side stream allocates again.

With PyTorch's allocator a block freed during a capture with other streams recorded is not
reused during that capture (DeviceCachingAllocator::free puts it on
needs_events_deferred_until_no_capture; its events are recorded once no capture is under way),
so within the graph the freed tensor's memory is not given to the allocations that follow, and
replays are free of the race: in graph A the side stream sleeps, then reads `a` (3 * x) into
its output, while the capture stream, after `del a`, fills a new tensor with -7 and computes
with it, so every replay gives 6x + 1 from the side stream and x - 7 from the capture stream;
in graph B the capture stream sleeps, then reads `s` (made on the side stream) after the join,
while the side stream, after `del s`, fills a new tensor with -9: every replay gives the sum of
2x and x + 1 - 9. Four replays each with new inputs, eager tensors filled with 5 between
replays keep their value, and once the graphs and outputs are gone memory_allocated() is back
within one tensor of its baseline: PyTorch's allocator (2.11) keeps one tensor's block (16
MiB) allocated and reserved after the graphs are gone, one of those freed inside the captures
with another stream recorded (so the case asks no more of vmm).

Why vmm may differ: vmm's record_stream hook and its frees that wait for other streams
(stream_reclaim) are asked to act while a capture is under way, when vmm records and queries
no events: the freed block must stay out of the capture's later allocations (a block handed
back at once is reused by the capture, and the replay races), and the event it waits for
must still be recorded once the capture is over (or the block stays pending and its memory
never comes back).
"""
import torch
from dropin_report import baseline, report, settle

MIB = 1 << 20
N = 4 * MIB  # float32: 16 MiB
SLEEP = 20_000_000


def graph_a(x, side):
    a = x * 3
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        out_side = a * 2 + 1
    a.record_stream(side)
    del a
    b = torch.empty_like(x)
    b.fill_(-7.0)
    out_main = b + x
    torch.cuda.current_stream().wait_stream(side)
    return out_side, out_main


def graph_b(x, side):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        s = x * 2
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda._sleep(SLEEP)
    got = s + 0
    s.record_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        del s
        c = torch.empty_like(x)
        c.fill_(-9.0)
        out_side = c + x + 1
    torch.cuda.current_stream().wait_stream(side)
    return got + out_side


def capture(fn, x, side, cap):
    # Warm-up on the capture stream, as PyTorch asks.
    with torch.cuda.stream(cap):
        fn(x, side)
    cap.synchronize()
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=cap):
        out = fn(x, side)
    return g, out


def main():
    errors = []
    torch.empty(1, device="cuda")
    base, _, _ = baseline()
    side, cap = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(N, device="cuda")
    ga, (a_side, a_main) = capture(graph_a, x, side, cap)
    gb, b_out = capture(graph_b, x, side, cap)
    for r in range(4):
        x.copy_(torch.randn(N, device="cuda"))
        junk = [torch.full((n,), 5.0, device="cuda") for n in (N, N // 3, 1000)]
        ga.replay()
        gb.replay()
        torch.cuda.synchronize()
        if not torch.allclose(a_side, 6 * x + 1, rtol=1e-5, atol=1e-5):
            bad = int((~torch.isclose(a_side, 6 * x + 1, rtol=1e-5, atol=1e-5)).sum().item())
            errors.append(f"replay {r}: graph A's side stream read a freed-and-reused block: "
                          f"{bad} of {N} values wrong (e.g. {float(a_side[0].item())} for "
                          f"{float((6 * x + 1)[0].item())})")
        if not torch.allclose(a_main, x - 7, rtol=1e-5, atol=1e-5):
            errors.append(f"replay {r}: graph A's capture-stream output is wrong")
        want = 2 * x + x + 1 - 9
        if not torch.allclose(b_out, want, rtol=1e-5, atol=1e-4):
            bad = int((~torch.isclose(b_out, want, rtol=1e-5, atol=1e-4)).sum().item())
            errors.append(f"replay {r}: graph B's output is wrong in {bad} of {N} values (the "
                          f"side stream's tensor reused while the capture stream read it?)")
        if any(float(t.min().item()) != 5.0 or float(t.max().item()) != 5.0 for t in junk):
            errors.append(f"replay {r}: an eager tensor filled with 5 changed")
        del junk
    del ga, gb, a_side, a_main, b_out, x
    settle()
    # Within one tensor of the baseline: the block PyTorch's allocator keeps (see above).
    allocated = torch.cuda.memory_allocated()
    if allocated > base + N * 4:
        errors.append(f"after the graphs and their outputs were dropped memory_allocated() is "
                      f"{allocated}, more than one tensor ({N * 4}) above {base} before")
    report(errors)


if __name__ == "__main__":
    main()
