#!/usr/bin/env python3
"""Times the steps of a send of a vmm CUDA tensor in one process (GPU): Queue.put's preparation
(reductions.prepare_send) and the feeder thread's export (reductions.reduce_tensor), each as
the package takes it (one call of vmm's CUDA module each where it was built) and step by step
through the Python path; medians in microseconds over --reps fresh tensors. The send budget
is off and every export is acknowledged at once, so nothing is held between repetitions."""
import argparse
import json
import os
import queue
import statistics
import threading
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
    module = sharing.cuda_module()
    steps = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter_ns()
        r = fn(*a)
        steps.setdefault(name, []).append((time.perf_counter_ns() - t0) / 1e3)
        return r

    def fresh():
        t = torch.empty(args.size, dtype=torch.uint8, device=dev)
        t.fill_(1)
        torch.cuda.synchronize()
        return t

    # The exports run where a queue's feeder thread would: one long-lived thread of that name
    # (the name decides), as a queue keeps its feeder.
    jobs, answers = queue.Queue(), queue.Queue()

    def feeder():
        while True:
            job = jobs.get()
            if job is None:
                return
            answers.put(job[0](*job[1:]))

    thread = threading.Thread(target=feeder, name=sharing.FEEDER_THREAD, daemon=True)
    thread.start()

    def in_feeder(fn, *a):
        jobs.put((fn,) + a)
        return answers.get()

    for _ in range(args.reps + 3):
        t = fresh()
        timed("prepare_send(tensor)", reductions.prepare_send, t)
        _, payload = in_feeder(timed, "reduce_tensor(feeder)", reductions.reduce_tensor, t)
        sharing.ack_send(payload[len(sharing.PAYLOAD_FIELDS)], wait=True)
        t = fresh()
        timed("prepare_send((tensor, 1))", reductions.prepare_send, (t, 1))
        _, payload = in_feeder(reductions.reduce_tensor, t)
        sharing.ack_send(payload[len(sharing.PAYLOAD_FIELDS)], wait=True)
        # The Python path, step by step.
        t = fresh()
        timed("attributes", lambda: (t.is_cuda, t.layout, t.requires_grad, t.is_leaf))
        base = timed("storage_address", sharing.storage_address, t)
        kind = timed("send_kind_marked", sharing.send_kind_marked, base)
        timed("ready_key", sharing.ready_key, t, base)
        timed("record_ready", sharing.record_ready, t, base)
        timed("wait_for_send_room", sharing.wait_for_send_room)
        timed("current_stream", torch.cuda.current_stream, dev)
        payload = timed("send_payload(export, stream synchronised)", sharing.send_payload, t,
                        base, kind)
        sharing.ack_send(payload[len(sharing.PAYLOAD_FIELDS)], wait=True)
        if module is not None:
            t = fresh()
            timed("module.prepare_send", module.prepare_send, t)
            _, data, ticket = timed("module.export_send", module.export_send, t)
            sharing.ack_send(ticket, wait=True)
    jobs.put(None)
    thread.join()
    out = {k: round(statistics.median(v[3:]), 2) for k, v in steps.items()}
    print(json.dumps(dict(bench="put_steps", size=args.size, cuda_module=module is not None,
                          us=out)))


if __name__ == "__main__":
    main()
