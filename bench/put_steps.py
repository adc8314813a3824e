#!/usr/bin/env python3
"""Times each step of Queue.put's preparation of a vmm CUDA tensor and of its export, in one
process (GPU): medians in microseconds over --reps fresh tensors."""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VMM_SEND_BUDGET", "0")
import torch  # noqa: E402
import vmm_torch  # noqa: E402
from vmm_torch import reductions, sharing  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default=64 << 20, type=int)
    ap.add_argument("--reps", default=40, type=int)
    args = ap.parse_args()
    vmm_torch.enable()
    reductions.install_reducers()
    dev = torch.device("cuda", 0)
    steps = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter_ns()
        r = fn(*a)
        steps.setdefault(name, []).append((time.perf_counter_ns() - t0) / 1e3)
        return r

    keep = []
    for i in range(args.reps + 3):
        t = torch.empty(args.size, dtype=torch.uint8, device=dev)
        t.fill_(i % 251)
        torch.cuda.synchronize()
        timed("is_cuda+layout", lambda: (t.is_cuda, t.layout, t.requires_grad, t.is_leaf))
        base = timed("storage_address", sharing.storage_address, t)
        kind = timed("send_kind_marked", sharing.send_kind_marked, base)
        key = timed("ready_key", sharing.ready_key, t, base)
        ev = timed("record_ready", sharing.record_ready, t.device)
        timed("note_ready_event", sharing.note_ready_event, key, ev)
        timed("wait_for_send_room", sharing.wait_for_send_room)
        u = torch.empty(args.size, dtype=torch.uint8, device=dev)
        u.fill_(1)
        torch.cuda.synchronize()
        timed("prepare_send(total)", reductions.prepare_send, u)
        timed("prepare_send(tuple)", reductions.prepare_send, (u, 1))
        timed("current_stream", torch.cuda.current_stream, dev)
        payload = timed("send_payload(export)", sharing.send_payload, t, base, kind)
        keep.append((t, u, payload))
    out = {k: round(statistics.median(v[3:]), 2) for k, v in steps.items()}
    print(json.dumps(dict(bench="put_steps", size=args.size, us=out)))


if __name__ == "__main__":
    main()
