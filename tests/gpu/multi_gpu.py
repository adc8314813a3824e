#!/usr/bin/env python3
"""Two GPUs: a vmm tensor on cuda:0 mapped by another process on cuda:1, and the read bandwidth
of that imported peer memory against PyTorch's peer copy.

    python3 tests/gpu/multi_gpu.py [--handle-type auto|posix_fd|fabric] [--sizes 256M,1G,4G]
                                   [--out multi.jsonl]

The producer enables vmm with peer_devices=[1] (every chunk of its pools is also granted to
GPU 1) and installs the reducers; one consumer process, started with the spawn method, leaves
PyTorch's own allocator in place, so that vmm memory there is only what it imports.

share:     the producer fills a tensor on cuda:0 and sends it twice through a
           torch.multiprocessing queue: as the tensor itself (the reducers carry it as a
           descriptor; the consumer receives it mapped on cuda:0, the exporting device) and as a
           SharedTensor, which the consumer opens on cuda:1 (export_tensor(t).open(device=1)).
           The consumer checks both views, adds 1 to every byte through the cuda:1 one (a
           kernel on GPU 1 writing GPU 0's memory), checks that the cuda:0 view shows it, and
           the producer checks that its own tensor does.
bandwidth: for each size the producer sends a SharedTensor of a cuda:0 tensor; the consumer
           opens it on cuda:1 and times, with CUDA events on cuda:1 (median of 3 runs), copies
           into a tensor of GPU 1 out of
             imported_memcpy  the imported memory (a device-to-device copy on GPU 1),
             imported_kernel  the imported memory, read by an elementwise kernel on GPU 1,
             torch_peer_copy  a tensor of the consumer's own on cuda:0 (copy_ across devices:
                              PyTorch's peer copy, a cudaMemcpyAsync / cudaMemcpyPeerAsync
                              between the GPUs),
             local_copy       a tensor on cuda:1 (for scale).
           gbps is bytes read per second (bytes / time), 1e9 bytes per GB.

Prints one JSON object per line (and appends them to --out). Exits 1 when any bytes are wrong
or a process fails; with fewer than two GPUs it prints a "skipped" line and exits 0.
"""
import argparse
import json
import queue
import statistics
import sys
import traceback

import torch
import torch.multiprocessing as mp

PERIOD = 251  # the byte pattern repeats every PERIOD bytes
SHARE_BYTES = (64 << 20) + 4097  # not a multiple of anything the allocator uses
RUNS = 3


def pattern(n, seed, device):
    """n bytes: byte i is (7 * i + seed) % PERIOD (a view of a buffer of whole periods)."""
    block = ((torch.arange(PERIOD, device=device, dtype=torch.int32) * 7 + seed) % PERIOD)
    return block.to(torch.uint8).repeat(-(-n // PERIOD))[:n]


def emit(record, out):
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


# --- Consumer (GPU 1) ---------------------------------------------------------------------------

def check_share(on_zero, shared, seed):
    """Checks the tensor received on cuda:0 and the SharedTensor opened on cuda:1, and writes
    through the latter."""
    n = on_zero.numel()
    expected = pattern(n, seed, "cuda:0")
    result = {
        "received_device": str(on_zero.device),
        "received_ok": on_zero.device == torch.device("cuda", 0)
                       and bool(torch.equal(on_zero, expected)),
    }
    on_one = shared.open(device=1)
    result["opened_device"] = str(on_one.device)
    result["opened_ok"] = (on_one.device == torch.device("cuda", 1)
                           and bool(torch.equal(on_one, expected.to("cuda:1"))))
    on_one.add_(1)  # uint8: wraps at 256
    torch.cuda.synchronize(1)
    result["write_seen_on_cuda0"] = bool(torch.equal(on_zero, expected + 1))
    return result


def timed_ms(copy, iters):
    """Median milliseconds of one `copy`, from CUDA events on cuda:1."""
    copy()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    samples = []
    with torch.cuda.device(1):
        for _ in range(RUNS):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                copy()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / iters)
    torch.cuda.synchronize(0)
    return statistics.median(samples)


def measure_bandwidth(shared, seed, iters):
    """Opens `shared` on cuda:1 and times the copies of the module docstring."""
    imported = shared.open(device=1)
    n = imported.numel()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    dst.copy_(imported)
    ok = bool(torch.equal(dst, pattern(n, seed, "cuda:1")))
    peer_source = torch.ones(n, dtype=torch.uint8, device="cuda:0")
    local_source = torch.ones(n, dtype=torch.uint8, device="cuda:1")
    copies = {
        "imported_memcpy": lambda: dst.copy_(imported),
        "torch_peer_copy": lambda: dst.copy_(peer_source),
        "local_copy": lambda: dst.copy_(local_source),
    }
    if n % 4 == 0:
        words, out = imported.view(torch.int32), dst.view(torch.int32)
        copies["imported_kernel"] = lambda: torch.bitwise_xor(words, 0, out=out)
    rows = []
    for method, copy in copies.items():
        ms = timed_ms(copy, iters)
        rows.append({"method": method, "ms": ms, "gbps": n / (ms / 1e3) / 1e9})
    return {"ok": ok, "rows": rows}


def consumer(jobs, results):
    try:
        import vmm_torch  # noqa: F401  (the reducers' rebuild function lives there)

        torch.cuda.init()
        while True:
            job = jobs.get()
            if job is None:
                return
            if job[0] == "share":
                results.put(check_share(*job[1:]))
            else:
                results.put(measure_bandwidth(*job[1:]))
            del job
    except Exception:  # reported to the producer, which fails the run
        results.put({"error": traceback.format_exc()})


# --- Producer (GPU 0) ---------------------------------------------------------------------------

class ConsumerFailed(Exception):
    pass


def receive(results, timeout):
    result = results.get(timeout=timeout)
    if "error" in result:
        raise ConsumerFailed(result["error"])
    return result


def run_share(vmm_torch, jobs, results, args):
    seed = 3
    t = pattern(SHARE_BYTES, seed, "cuda:0")
    in_pool = vmm_torch.in_vmm_pool(t)
    shared = vmm_torch.export_tensor(t)
    torch.cuda.synchronize(0)
    jobs.put(("share", t, shared, seed))
    result = receive(results, args.timeout)
    result["producer_sees_write"] = bool(torch.equal(t, pattern(SHARE_BYTES, seed, "cuda:0") + 1))
    ok = in_pool and all(result[k] for k in ("received_ok", "opened_ok", "write_seen_on_cuda0",
                                            "producer_sees_write"))
    emit({"test": "share_on_peer", "bytes": SHARE_BYTES, "in_vmm_pool": in_pool,
          "handle_type": str(shared.descriptor.handle_type), **result, "ok": ok}, args.out)
    return ok


def run_bandwidth(vmm_torch, jobs, results, args, size):
    seed = 5
    t = pattern(size, seed, "cuda:0")
    shared = vmm_torch.export_tensor(t)
    torch.cuda.synchronize(0)
    iters = max(5, min(50, (16 << 30) // size))
    jobs.put(("bandwidth", shared, seed, iters))
    result = receive(results, args.timeout)
    gbps = {}
    for row in result["rows"]:
        gbps[row["method"]] = row["gbps"]
        emit({"test": "bandwidth", "bytes": size, "iters": iters, **row}, args.out)
    emit({"test": "bandwidth_summary", "bytes": size, "data_ok": result["ok"],
          "handle_type": str(shared.descriptor.handle_type),
          "imported_vs_torch_peer_copy": gbps["imported_memcpy"] / gbps["torch_peer_copy"]},
         args.out)
    del t, shared
    return result["ok"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--handle-type", default="auto", choices=("auto", "posix_fd", "fabric"))
    p.add_argument("--sizes", default="256M,1G,4G",
                   help="bandwidth sizes, comma-separated (empty: the share check alone)")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for a result")
    p.add_argument("--out", default="", help="file to append the JSON lines to")
    args = p.parse_args()

    gpus = torch.cuda.device_count()  # does not initialise PyTorch's CUDA state
    if gpus < 2:
        emit({"test": "multi_gpu", "skipped": f"needs two GPUs, this machine has {gpus}"},
             args.out)
        return 0
    import vmm_torch

    try:
        sizes = [vmm_torch.parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    vmm_torch.enable(handle_type=args.handle_type, peer_devices=[1])
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(jobs, results))
    proc.start()
    ok = True
    try:
        ok &= run_share(vmm_torch, jobs, results, args)
        for size in sizes:
            ok &= run_bandwidth(vmm_torch, jobs, results, args, size)
    except ConsumerFailed as e:
        emit({"test": "multi_gpu", "error": f"consumer failed:\n{e}"}, args.out)
        ok = False
    except queue.Empty:
        emit({"test": "multi_gpu", "error": f"no result from the consumer in {args.timeout} s"},
             args.out)
        ok = False
    finally:
        jobs.put(None)
        proc.join(60)
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    if proc.exitcode != 0:
        emit({"test": "multi_gpu", "error": f"consumer exit code {proc.exitcode}"}, args.out)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
