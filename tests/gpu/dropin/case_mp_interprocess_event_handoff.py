"""Two processes take turns writing shared CUDA tensors and order the writes with
interprocess CUDA events (torch.cuda.Event(interprocess=True), sent through
torch.multiprocessing, which reduces an event to its IPC handle), never synchronizing the
writer's device: a producer/consumer pair passing buffers with GPU-side hand-offs (what
PyTorch's own test_event_handle_importer / _exporter check for the events alone).

With PyTorch's allocator a CUDA tensor is sent where it lies (its receiver maps the sender's
memory), so writes made after the send are seen by the other process. The parent sends a
16 MiB zero tensor with an interprocess event; the child answers with a tensor of its own and
an event of its own. Four rounds: the parent, on a side stream, sleeps on the GPU, fills its
tensor with k and records its event, then tells the child by a queue (the fill is still
queued); the child's current stream waits on the parent's event and every value it reads is
k; the child then, on a side stream of its own, sleeps, fills its tensor with 10 + k, records
its event and answers; the parent's current stream waits on the child's event and every
value of the child's tensor is 10 + k. The parent's tensor kept its data_ptr throughout.

Why vmm may differ: both tensors are vmm sends (the receiver maps the sender's physical
chunks: an import), so the other process's writes land in memory that vmm mapped twice and
that must stay the sender's tensor's memory after the send; the events travel beside them in
the same message (Queue.put's dry run of pickle passes over them).
"""
import torch
import torch.multiprocessing as mp
from dropin_report import report

N = 1 << 22  # float32 elements: 16 MiB
ROUNDS = 4
SLEEP = 50_000_000  # GPU cycles, about 25 ms


def child(to_child, to_parent):
    try:
        t, e = to_child.get(timeout=60)
        mine = torch.zeros(N, device="cuda")
        my_event = torch.cuda.Event(interprocess=True)
        side = torch.cuda.Stream()
        to_parent.put(("ready", mine, my_event))
        while True:
            msg = to_child.get(timeout=60)
            if msg[0] == "stop":
                break
            k = msg[1]
            torch.cuda.current_stream().wait_event(e)
            wrong = int((t != float(k)).sum().item())
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP)
                mine.fill_(10.0 + k)
                my_event.record(side)
            to_parent.put(("seen", k, wrong))
        del t, e
    except Exception as ex:  # noqa: BLE001
        to_parent.put(("error", f"{type(ex).__name__}: {ex}"))


def main():
    ctx = mp.get_context("spawn")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(to_child, to_parent), daemon=True)
    p.start()
    errors = []
    t = torch.zeros(N, device="cuda")
    ptr = t.data_ptr()
    e = torch.cuda.Event(interprocess=True)
    side = torch.cuda.Stream()
    to_child.put((t, e))
    first = to_parent.get(timeout=120)
    if first[0] != "ready":
        errors.append(f"the child failed: {first[1:]}")
    else:
        _, theirs, their_event = first
        for k in range(1, ROUNDS + 1):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP)
                t.fill_(float(k))
                e.record(side)
            to_child.put(("check", k))
            msg = to_parent.get(timeout=60)
            if msg[0] != "seen":
                errors.append(f"round {k}: the child failed: {msg[1:]}")
                break
            if msg[2]:
                errors.append(f"round {k}: after waiting on the parent's event the child read "
                              f"{msg[2]} of {N} values that are not {k}")
            torch.cuda.current_stream().wait_event(their_event)
            wrong = int((theirs != 10.0 + k).sum().item())
            if wrong:
                errors.append(f"round {k}: after waiting on the child's event {wrong} of {N} "
                              f"values of the child's tensor are not {10 + k}")
        if t.data_ptr() != ptr:
            errors.append("the parent's tensor changed its data_ptr after it was sent")
        torch.cuda.synchronize()
        if float(t[0].item()) != float(ROUNDS):
            errors.append(f"the parent's tensor reads {float(t[0].item())}, expected {ROUNDS}")
        del theirs, their_event
    to_child.put(("stop",))
    p.join(60)
    if p.exitcode not in (0, None):
        errors.append(f"the child exited with {p.exitcode}")
    report(errors)


if __name__ == "__main__":
    main()
