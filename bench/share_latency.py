#!/usr/bin/env python3
"""Share latency and imported-memory bandwidth, vmm against torch.multiprocessing (GPU).

Share latency is the time from the producer handing a CUDA tensor to a torch.multiprocessing
queue until the consumer has read its first element: export (or cudaIpcGetMemHandle), pickle,
transfer, import (map) and a first read. Each repetition sends a freshly allocated tensor, and
the consumer drops the previous one (unmapping it) before it answers, so each send finds it idle.
Modes: vmm with fabric handles (vmm-fabric), with POSIX fds (vmm-fd), with the handle type its
probe picks (vmm-auto: fabric where an IMEX channel allows, else fds), PyTorch's default
allocator (torch-native), and PyTorch with expandable segments (torch-expandable). Every row
says whether an IMEX channel existed and, for vmm, which handle type the descriptors carried.
Bandwidth compares a device-to-device copy out of imported memory with the same copy out of
memory the consumer allocated itself.

With --breakdown, each latency row is followed by a "share_breakdown" row: medians in
microseconds of where the latency went, parts that add up to it. export: the pickling reducer
in the producer (vmm's or PyTorch's reduce_tensor). transit: from the put until the consumer's
rebuild function starts, less the export (queue feeder thread, pipe, unpickling up to the
rebuild); for vmm, put_prepare (Queue.put's preparation of the tensors, in the producer's
thread) and to_feeder (from its end until the feeder's export starts) are parts of it, and
ready_wait (waiting for the put's CUDA event) and vmm_export (vmm_export_send) parts of the
export where the Python path takes it (vmm's CUDA module, where it was built, takes both in one
call: then export has no parts). import: the rebuild function (vmm's sharing.rebuild_tensor, split into
vmm_import, the C call, and wrap, the tensor over it; PyTorch's rebuild_cuda_tensor). unpickle_other: from the
end of the rebuild until the queue's get returns. first_read: from then until tensor[0].item()
returns. Timestamps are time.perf_counter_ns (CLOCK_MONOTONIC: one clock for all processes).

--settle-ms waits that long between allocating and filling a repetition's tensor and sending it,
so that the driver's background work after the previous repetition (the release of its memory
by both processes) is over before the clock starts.

--consumer-wait picks how the consumer waits for the next tensor, in every mode: "block" (the
queue's get: the consumer sleeps in a read of the queue's pipe and the kernel wakes it) or "poll"
(the consumer asks the queue whether something arrived in a loop, so it is already running when
the tensor comes: what a latency-critical consumer that keeps a core does; no wake-up is timed).

--cpus LIST (e.g. 0-7,16-23) runs every process of the benchmark on those CPUs (the spawned
processes inherit the mask): tests/gpu/run.sh passes the CPUs local to the GPU, as launchers
that bind ranks to their GPU's NUMA node do.

--queue picks the torch.multiprocessing queue for every mode: "queue" (multiprocessing.Queue:
put hands the object to a feeder thread, which pickles and writes it) or "simple"
(SimpleQueue: put pickles and writes in the caller's thread).

    python3 bench/share_latency.py --sizes 64M,1G,8G --reps 7 --out share.jsonl [--breakdown]
Prints one JSON object per result (and appends them to --out).
"""
import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

IMEX_CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"
# How long the producer waits for the consumer's answer before giving up on the mode.
RESULT_TIMEOUT_S = 60
# (name, start_ns, end_ns) of the calls timed by --breakdown in this process; the producer's
# reducer runs in the queue's feeder thread, hence the lock.
_stamps = []
_stamps_lock = threading.Lock()


def parse_cpus(text):
    """The set of CPUs in a list like 0-3,8,10-11."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def setup_mode(mode):
    """Configures the allocator of this process for `mode` (before CUDA is used)."""
    if mode.startswith("vmm"):
        import vmm_torch

        handle_type = {"vmm-fabric": "fabric", "vmm-fd": "posix_fd", "vmm-auto": "auto"}[mode]
        vmm_torch.enable(handle_type=handle_type)
        vmm_torch.install_reducers()


def imex_channel_exists():
    return os.path.exists(IMEX_CHANNEL)


def handle_type_of(mode, tensor):
    """The handle type of `tensor`'s descriptors in a vmm mode (None for PyTorch's modes)."""
    if not mode.startswith("vmm"):
        return None
    import vmm_torch

    return vmm_torch.export_tensor(tensor).descriptor.handle_type


def timed(fn, name):
    """`fn`, recording the start and end of each call in _stamps under `name`."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            with _stamps_lock:
                _stamps.append((name, start, end))
    return wrapper


def take_stamps():
    """{name: (start_ns, end_ns)} of the calls timed since the last take."""
    with _stamps_lock:
        taken = {name: (start, end) for name, start, end in _stamps}
        _stamps.clear()
    return taken


def time_export(mode):
    """Times the reducer that pickles this process's tensors (after setup_mode)."""
    from multiprocessing.reduction import ForkingPickler

    if mode.startswith("vmm"):
        import vmm_torch.reductions as reductions
        import vmm_torch.sharing as sharing

        # Parts of the put (in the producer's thread) and of the export (in the feeder).
        reductions.prepare_send = timed(reductions.prepare_send, "put_prepare")
        sharing.wait_until_ready = timed(sharing.wait_until_ready, "ready_wait")
        sharing.export_send = timed(sharing.export_send, "vmm_export")
    else:
        import torch.multiprocessing.reductions as reductions
    ForkingPickler.register(torch.Tensor, timed(reductions.reduce_tensor, "export"))


def time_import(mode):
    """Times the rebuild of received tensors: unpickling looks the rebuild function up as a
    module attribute (vmm_torch.sharing.rebuild_tensor), and the rebuild its helpers as
    attributes of vmm_torch.sharing."""
    if mode.startswith("vmm"):
        import vmm_torch.sharing as sharing

        sharing.rebuild_tensor = timed(sharing.rebuild_tensor, "import")
        sharing.import_descriptor = timed(sharing.import_descriptor, "vmm_import")
        sharing.wrap_import = timed(sharing.wrap_import, "wrap")
    else:
        import torch.multiprocessing.reductions as reductions

        reductions.rebuild_cuda_tensor = timed(reductions.rebuild_cuda_tensor, "import")


def next_job(jobs, wait):
    """The next object on `jobs`, waiting as --consumer-wait says."""
    if wait == "poll":
        while jobs.empty():
            pass
    return jobs.get()


def consumer(mode, jobs, results, breakdown, wait):
    setup_mode(mode)
    if breakdown:
        time_import(mode)
    torch.cuda.init()
    while True:
        take_stamps()
        item = next_job(jobs, wait)
        got = time.perf_counter_ns()
        if item is None:
            return
        t0, tensor, measure_bandwidth = item
        first = tensor[0].item()  # the first read: waits for the import and a kernel
        t1 = time.perf_counter_ns()
        stamps = take_stamps()
        bandwidth = copy_bandwidth(tensor) if measure_bandwidth else None
        # Unmapped before answering: the producer's next send finds this process idle, not
        # still closing the previous import.
        del tensor, item
        results.put({"latency_ns": t1 - t0, "first": first, "bandwidth": bandwidth,
                     "got_ns": got, "stamps": stamps})


def split_latency(t0, r, stamps):
    """The parts of one repetition's latency in ns (see --breakdown), which add up to it, from
    the producer's `stamps` and the consumer's answer `r`; None if a timed call did not run."""
    if "export" not in stamps or "import" not in r["stamps"]:
        print(f"breakdown: no export or import timed ({stamps}, {r['stamps']})", file=sys.stderr)
        return None
    (e0, e1), (i0, i1) = stamps["export"], r["stamps"]["import"]
    got, t1 = r["got_ns"], t0 + r["latency_ns"]
    parts = {"export": e1 - e0, "transit": i0 - t0 - (e1 - e0), "import": i1 - i0,
             "unpickle_other": got - i1, "first_read": t1 - got}
    for name in ("vmm_import", "wrap"):  # parts of the import
        if name in r["stamps"]:
            parts[name] = r["stamps"][name][1] - r["stamps"][name][0]
    for name in ("put_prepare", "ready_wait", "vmm_export"):  # parts of the put and export
        if name in stamps:
            parts[name] = stamps[name][1] - stamps[name][0]
    if "put_prepare" in stamps:  # from the end of the put's preparation to the export
        parts["to_feeder"] = e0 - stamps["put_prepare"][1]
    return parts


def copy_bandwidth(src, iters=20):
    """GB/s of copying `src` into a new tensor, and of the same copy from local memory."""
    dst = torch.empty_like(src)
    local = src.clone()

    def timed(source):
        dst.copy_(source)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(source)
        stop.record()
        torch.cuda.synchronize()
        return 2 * src.numel() * src.element_size() * iters / (start.elapsed_time(stop) / 1e3) / 1e9

    imported = statistics.median(timed(src) for _ in range(3))
    native = statistics.median(timed(local) for _ in range(3))
    del dst, local
    return {"imported_gbs": imported, "native_gbs": native}


def answer(results, proc, timeout_s=RESULT_TIMEOUT_S):
    """The next object `proc` puts on `results`; raises at once if `proc` died (a mode that
    cannot run here), after `timeout_s` if it hangs."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = proc.is_alive()  # before the get: an answer sent before dying is read
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            if not alive:
                raise RuntimeError(f"{proc.name} died (exit status {proc.exitcode})")
            if time.monotonic() > deadline:
                raise


def run_mode(mode, sizes, reps, bandwidth_size, breakdown, queue_kind, settle_s, wait):
    ctx = mp.get_context("spawn")
    env_before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if mode == "torch-expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    jobs = ctx.SimpleQueue() if queue_kind == "simple" else ctx.Queue()
    results = ctx.Queue()
    proc = ctx.Process(target=consumer, args=(mode, jobs, results, breakdown, wait),
                       name="consumer")
    proc.start()
    out = []
    tags = {"imex_channel": imex_channel_exists(), "handle_type": None,
            "cpus": len(os.sched_getaffinity(0))}
    try:
        for size in sizes:
            latencies, parts = [], []
            bandwidth = None
            for rep in range(reps + 1):  # the first repetition warms up
                measure = size == bandwidth_size and rep == reps
                t = torch.full((size,), 7, dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                if rep == 0:  # the warm-up: its export is not timed
                    tags["handle_type"] = handle_type_of(mode, t)
                print(f"{mode}: {size} bytes, repetition {rep}", file=sys.stderr, flush=True)
                time.sleep(settle_s)
                take_stamps()
                t0 = time.perf_counter_ns()
                jobs.put((t0, t, measure))
                r = answer(results, proc)
                assert r["first"] == 7, r
                if rep > 0:
                    latencies.append(r["latency_ns"])
                    # The export ended before the consumer could answer.
                    split = breakdown and split_latency(t0, r, take_stamps())
                    if split:
                        parts.append(split)
                if r["bandwidth"]:
                    bandwidth = r["bandwidth"]
                del t
                torch.cuda.synchronize()
            row = {"bench": "share_latency", "mode": mode, **tags, "queue": queue_kind,
                   "consumer_wait": wait, "settle_ms": settle_s * 1e3, "bytes": size,
                   "median_ms": statistics.median(latencies) / 1e6,
                   "min_ms": min(latencies) / 1e6, "reps": reps}
            out.append(row)
            print(json.dumps(row), flush=True)
            if parts:
                row = {"bench": "share_breakdown", "mode": mode, **tags, "queue": queue_kind,
                       "consumer_wait": wait, "settle_ms": settle_s * 1e3, "bytes": size,
                       **{f"{k}_us": statistics.median(p[k] for p in parts) / 1e3
                          for k in parts[0]}}
                out.append(row)
                print(json.dumps(row), flush=True)
            if bandwidth:
                row = {"bench": "imported_bandwidth", "mode": mode, **tags, "bytes": size,
                       **bandwidth,
                       "ratio": bandwidth["imported_gbs"] / bandwidth["native_gbs"]}
                out.append(row)
                print(json.dumps(row), flush=True)
    finally:
        jobs.put(None)
        proc.join(60)
        if env_before is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_before
    return out


def producer(mode, sizes, reps, bandwidth_size, breakdown, queue_kind, settle_s, wait, out):
    setup_mode(mode)
    if breakdown:
        time_export(mode)
    if mode == "torch-expandable":
        assert "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    out.put(run_mode(mode, sizes, reps, bandwidth_size, breakdown, queue_kind, settle_s, wait))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64M,1G,8G")
    p.add_argument("--modes", default="vmm-fabric,vmm-fd,torch-native,torch-expandable")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--bandwidth-size", default="1G")
    p.add_argument("--queue", choices=("queue", "simple"), default="queue",
                   help="the queue that carries the tensors (see above)")
    p.add_argument("--consumer-wait", choices=("block", "poll"), default="block",
                   help="how the consumer waits for a tensor (see above)")
    p.add_argument("--settle-ms", type=float, default=0.0,
                   help="pause before each send (see above)")
    p.add_argument("--cpus", default="", help="run on these CPUs only (see above)")
    p.add_argument("--out", default="")
    p.add_argument("--breakdown", action="store_true",
                   help="also report where the latency goes (export, transit, import, ...)")
    a = p.parse_args()
    # Imported here, in this process only: the producers of PyTorch's modes stay without vmm.
    from vmm_torch import parse_size

    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
        bandwidth_size = parse_size(a.bandwidth_size)
    except ValueError as e:
        p.error(str(e))
    if a.cpus:
        os.sched_setaffinity(0, parse_cpus(a.cpus))
    ctx = mp.get_context("spawn")
    rows = []
    for mode in a.modes.split(","):
        if mode == "torch-expandable":
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        q = ctx.Queue()
        # Each mode in its own producer process: the allocator is chosen per process.
        args = (mode, sizes, a.reps, bandwidth_size, a.breakdown, a.queue,
                a.settle_ms / 1e3, a.consumer_wait, q)
        proc = ctx.Process(target=producer, args=args, name="producer")
        proc.start()
        try:
            rows += answer(q, proc, len(sizes) * (a.reps + 1) * RESULT_TIMEOUT_S)
        except Exception as e:  # a mode that cannot run here (no IMEX channel for fabric...)
            rows.append({"bench": "share_latency", "mode": mode,
                         "imex_channel": imex_channel_exists(), "error": repr(e)})
            print(json.dumps(rows[-1]), flush=True)
        proc.join(60)
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
