"""An inference process that captures a CUDA graph over weights it received from a trainer
process (RL colocated training and generation: the trainer shares its weights through
torch.multiprocessing once, the generator captures its decode step as a CUDA graph reading
them, and each training step updates the weights in place), plus a fresh bias tensor sent at
each step that the generator copies into its graph's static buffer and drops at once (the
update_weights_from_ipc_handles pattern).

With PyTorch's allocator a received CUDA tensor maps the sender's memory (CUDA IPC), so a graph
captured in the receiver over it reads, at every replay, what the sender wrote last; a received
tensor dropped right after a copy goes (its IPC mapping closes in the dropping thread). So: the
spawned generator receives the 512 x 512 weight, warms up and captures y = x @ W.T + b (cuBLAS
in the capture, on a stream of its own) with its own static x and b; for four rounds the
trainer scales W in place (W0 * (r + 2)), synchronizes, and sends a new bias tensor full of r;
the generator copies it into b, drops it, replays and finds y equal to x @ (W0 * (r + 2)).T + r
(W0 is its own copy of the first weights); it also captures a second graph in round 2 (after
imports were dropped) and checks it; the trainer's weight keeps its data_ptr and values
throughout.

Why vmm may differ: the weight is a vmm import in the generator (the sender's physical chunks
mapped into the receiver's range), read by a captured graph; each bias is an import dropped
while graphs exist, whose close synchronizes the device and unmaps on a background thread
(import_closer.h), possibly while the generator replays or captures; the trainer's sends are
held until acknowledged, and its weight must stay where it is.
"""
import queue as queue_mod

import torch
import torch.multiprocessing as mp
from dropin_report import report

D = 512
ROUNDS = 4


def generator(q, reply):
    errs = []
    try:
        torch.manual_seed(1)
        w = q.get(timeout=30)
        w0 = w.clone()
        x = torch.randn(64, D, device="cuda")
        b = torch.zeros(D, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(2):
                torch.addmm(b, x, w.t())  # cuBLAS workspace for this stream, before capture
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            y = torch.addmm(b, x, w.t())
        reply.put(("ready", []))
        g2 = y2 = None
        for r in range(ROUNDS):
            msg = q.get(timeout=30)
            rnd, bias = msg
            b.copy_(bias)
            del bias, msg
            g.replay()
            want = x @ (w0 * (r + 2)).t() + r
            if not torch.allclose(y, want, rtol=1e-4, atol=1e-3):
                errs.append(f"round {r}: the graph over the received weight gives a result off "
                            f"by {float((y - want).abs().max().item())}")
            if float(w[0, 0].item()) != float((w0[0, 0] * (r + 2)).item()):
                errs.append(f"round {r}: the received weight does not show the sender's update")
            if r == 2:
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2, stream=stream):
                    y2 = torch.relu(torch.addmm(b, x, w.t())) * 2
            if g2 is not None:
                g2.replay()
                if not torch.allclose(y2, torch.relu(want) * 2, rtol=1e-4, atol=1e-3):
                    errs.append(f"round {r}: the graph captured after imports were dropped "
                                f"gives a wrong result")
            torch.cuda.synchronize()
            reply.put((f"round {r}", errs))
            errs = []
        del g, g2, y, y2, w
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        errs.append(f"generator: {type(e).__name__}: {str(e)[:300]}")
        reply.put(("error", errs))
        return
    reply.put(("done", errs))


def main():
    errors = []
    torch.manual_seed(0)
    w = torch.randn(D, D, device="cuda") / 32
    w0 = w.clone()
    ptr = w.data_ptr()
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=generator, args=(q, reply), daemon=True)
    p.start()
    q.put(w)

    def answer(what):
        try:
            tag, errs = reply.get(timeout=40)
        except queue_mod.Empty:
            errors.append(f"no answer from the generator ({what}) within 40 s")
            return False
        errors.extend(errs)
        return tag not in ("error",)

    ok = answer("capture")
    for r in range(ROUNDS):
        if not ok:
            break
        w.copy_(w0 * (r + 2))
        torch.cuda.synchronize()
        bias = torch.full((D,), float(r), device="cuda")
        q.put((r, bias))
        del bias
        ok = answer(f"round {r}")
    if ok:
        answer("the end")
    p.join(20)
    if p.is_alive():
        errors.append("the generator did not exit")
        p.kill()
    elif p.exitcode != 0:
        errors.append(f"the generator exited with status {p.exitcode}")
    if w.data_ptr() != ptr:
        errors.append("the trainer's weight moved")
    if not torch.equal(w, w0 * (ROUNDS + 1)):
        errors.append("the trainer's weight does not hold its last update")
    report(errors)


if __name__ == "__main__":
    main()
