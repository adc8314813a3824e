"""An object whose __getstate__ / __reduce__ builds CUDA tensors while it is pickled (it
ships its weights in half precision, or a contiguous copy of a strided view) goes through a
torch.multiprocessing queue.

With PyTorch's allocator the tensors made during pickling (in the queue's feeder thread) are
shared like any other: the receiver gets the object with the converted tensors.

Why vmm may differ (with the pool option isolate_sends=1; by default vmm sends in
place): vmm's Queue.put prepares the tensors it finds by a dry run of pickle in
the caller (moving small ones into chunks of their own); the feeder thread's real pickling
calls __getstate__ again and gets new tensors that were never prepared, which vmm refuses to
move in the feeder thread ("was the queue's put bypassed?"): the receiver gets an error.
"""

import torch
import torch.multiprocessing as mp
from dropin_report import report


class HalfPacked:
    """Keeps float32 weights, travels as float16."""

    def __init__(self, w, step):
        self.w = w
        self.step = step

    def __getstate__(self):
        return {"w16": self.w.half(), "step": self.step}

    def __setstate__(self, state):
        self.w = state["w16"].float()
        self.step = state["step"]


class Rows:
    """Travels as a contiguous copy of every other row."""

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        return (Rows, (self.t[::2].contiguous(),))


def child(q, reply):
    out = []
    for _ in range(2):
        try:
            obj = q.get(timeout=60)
            if isinstance(obj, HalfPacked):
                out.append(("half", obj.step, float(obj.w.double().sum().item())))
            else:
                out.append(("rows", tuple(obj.t.shape), float(obj.t.double().sum().item())))
            del obj
        except Exception as e:  # noqa: BLE001
            out.append(("error", f"{type(e).__name__}: {e}", 0.0))
    reply.put(out)


def main():
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, reply), daemon=True)
    p.start()
    w = torch.full((1000,), 0.25, device="cuda")
    t = torch.arange(64 * 16, dtype=torch.float32, device="cuda").reshape(64, 16)
    q.put(HalfPacked(w, 7))
    q.put(Rows(t))
    got = reply.get(timeout=90)
    errors = []
    want = [("half", 7, 250.0), ("rows", (32, 16), float(t[::2].double().sum().item()))]
    for g, e in zip(got, want):
        if g[0] == "error":
            errors.append(f"the receiver got an error instead of the object: {g[1][:300]}")
        elif g[:2] != e[:2] or abs(g[2] - e[2]) > 1e-3:
            errors.append(f"received {g}, expected {e}")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
