"""torch.cuda.set_sync_debug_mode("error"): a training process checked to make no host
synchronisation in its loop (PyTorch raises on any synchronising CUDA call it makes) allocates
and frees through many sizes and streams, and hands CUDA tensors to another process (a logger
or evaluator) through a Pipe and a torch.multiprocessing Queue.

With PyTorch's allocator none of this synchronises: allocations and frees (record_stream
included) only record and query events, raw caching_allocator_alloc / _delete on a stream
likewise, and a CUDA tensor is sent as an IPC handle with an interprocess event recorded on the
sender's current stream that the receiver's stream waits on (CudaIPCSentData: no
stream_synchronize below its limit of 1000 events in use). So no call raises, in the caller
(Connection.send pickles there) or in the queue's feeder thread, and the spawned receiver reads
the values that were queued behind a long GPU sleep.

Why vmm may differ: vmm's reducer makes the sending thread wait until the tensor's writes are
done before it exports (torch.cuda.current_stream().synchronize() outside a queue's feeder
thread, an event wait or torch.cuda.synchronize() in it): a synchronising call that PyTorch's
sync debug mode refuses.
"""

import queue

import torch
import torch.multiprocessing as mp
from dropin_report import report

N = 1 << 20
CYCLES = 200_000_000


def child(conn, q, results):
    try:
        if not conn.poll(25):
            raise RuntimeError("nothing arrived over the pipe")
        a = conn.recv()
        b = q.get(timeout=25)
        results.put(("ok", float(a.double().sum().item()), float(b.double().sum().item())))
        del a, b
    except Exception as e:  # noqa: BLE001
        results.put(("error", f"{type(e).__name__}: {e}"))


def churn():
    """Allocations and frees of many sizes on two streams, with record_stream and raw blocks:
    nothing here synchronises the host."""
    side = torch.cuda.Stream()
    keep = []
    for i in range(300):
        n = 1 + (i * 7919) % (4 << 20)
        t = torch.empty(n, device="cuda")
        t.fill_(1.0)
        if i % 3 == 0:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                keep.append(t * 2)
            t.record_stream(side)
            torch.cuda.current_stream().wait_stream(side)
        if len(keep) > 10:
            keep.pop(0)
        del t
    ptrs = [torch.cuda.caching_allocator_alloc(1 << (10 + i % 12), stream=side) for i in range(24)]
    for p in ptrs:
        torch.cuda.caching_allocator_delete(p)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big.fill_(3)
    del big, keep


def main():
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(child_conn, q, results), daemon=True)
    p.start()
    torch.empty(1, device="cuda")
    errors = []
    answer = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = "allocating and freeing"
        churn()
        a = torch.empty(N, device="cuda")
        b = torch.empty(N, device="cuda")
        torch.cuda._sleep(CYCLES)  # the fills below are still queued when the sends pickle
        a.fill_(2.0)
        b.fill_(3.0)
        step = "Connection.send of a CUDA tensor"
        parent_conn.send(a)
        step = "Queue.put of a CUDA tensor"
        q.put(b)
        step = "waiting for the receiver"
        answer = results.get(timeout=35)  # the mode stays on while the feeder thread pickles b
    except queue.Empty:
        errors.append("the receiver reported nothing within 35 s (a send was lost: the queue's "
                      "feeder thread may have failed under sync debug mode)")
    except RuntimeError as e:
        errors.append(f"{step} raised under set_sync_debug_mode('error'): {str(e)[:300]}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if answer is not None:
        if answer[0] == "error":
            errors.append(f"the receiver failed: {answer[1][:300]}")
        elif answer[1:] != (2.0 * N, 3.0 * N):
            errors.append(f"the receiver read sums {answer[1:]}, expected {(2.0 * N, 3.0 * N)}")
    if errors:
        p.kill()
        report(errors)
    p.join(30)
    if p.exitcode != 0:
        errors.append(f"the receiver exited with {p.exitcode}")
    del a, b
    report(errors)


if __name__ == "__main__":
    main()
