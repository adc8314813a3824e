#!/usr/bin/env python3
"""Python-side cost of sending a vmm tensor through torch.multiprocessing (host backend).

Not a test: a micro-benchmark of the parts of a share that are vmm_torch's own Python and
LibTorch code, on the host backend (no GPU needed), in one process. Medians in microseconds
over --iters iterations, each timed with time.perf_counter_ns:

    reduce      vmm_torch.reductions.reduce_tensor(t): the producer's export (bench/
                share_latency.py's "export").
    dumps       ForkingPickler.dumps(t) with the reducers installed: reduce_tensor plus
                pickling the payload (what a queue's feeder thread does).
    loads       pickle.loads(payload): unpickling and the rebuild, import included (a fresh
                mapping each time: the previous tensor is gone).
    import      the import C call alone (vmm_import through ctypes, then released untimed).
    wrap        the tensor over an import alone (vmm_torch.sharing.wrap_import, the "wrap"
                of share_latency.py), the import reference retained untimed.

    bazel run -c opt //bench:share_overhead_bench -- [--iters 2000] [--handle-type fabric]
or, with the libraries built: PYTHONPATH=torch_plugin/python \
    VMM_LIB_DIR=bazel-bin/torch_plugin/python/vmm_torch python3 bench/share_overhead_bench.py
"""

import argparse
import ctypes
import gc
import json
import pickle
import statistics
import time
from multiprocessing.reduction import ForkingPickler

import torch

import vmm_torch
from vmm_torch import _lib, _signatures, reductions, sharing


def median_us(fn, iters, setup=None, teardown=None):
    """Median of `iters` timed calls of fn(state), state = setup() (untimed); teardown(result)
    runs untimed after each call."""
    samples = []
    gc.collect()
    for _ in range(iters):
        state = setup() if setup else None
        start = time.perf_counter_ns()
        result = fn(state)
        samples.append(time.perf_counter_ns() - start)
        if teardown:
            teardown(result)
        del result
    return statistics.median(samples) / 1e3


def main(argv=None):
    """Runs the benchmark, prints its results as one JSON line and returns them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--handle-type", default="fabric", choices=["fabric", "posix_fd"])
    p.add_argument("--shape", default="256,1024", help="tensor shape, comma separated")
    a = p.parse_args(argv)
    shape = tuple(int(s) for s in a.shape.split(","))
    vmm = _lib.vmm()
    vmm_torch.install_reducers()
    results = {"handle_type": a.handle_type, "shape": list(shape), "iters": a.iters}
    with vmm_torch.Pool("host", handle_type=a.handle_type) as pool:
        t = pool.empty(shape, dtype=torch.float32, shareable=True)
        t.fill_(1.5)
        payload = bytes(ForkingPickler.dumps(t))
        results["payload_bytes"] = len(payload)
        results["reduce_us"] = median_us(lambda _: reductions.reduce_tensor(t), a.iters)
        results["dumps_us"] = median_us(lambda _: ForkingPickler.dumps(t), a.iters)
        results["loads_us"] = median_us(lambda _: pickle.loads(payload), a.iters)
        assert float(pickle.loads(payload)[0, 0]) == 1.5

        data = vmm_torch.export_tensor(t).descriptor.to_bytes()

        def release(import_id):
            vmm.vmm_import_release(ctypes.c_void_p(import_id))

        results["import_us"] = median_us(
            lambda _: vmm.vmm_import(data, len(data), -1, _signatures.BACKEND_HOST, 0), a.iters,
            teardown=release)

        # wrap over one import kept open (so that the mapping outlives each tensor).
        import_id = sharing.import_descriptor(data, -1, _signatures.BACKEND_HOST)
        strides = tuple(t.stride())
        def wrap(_):
            return sharing.wrap_import(import_id, shape, strides, 0, torch.float32)
        results["wrap_us"] = median_us(
            wrap, a.iters, setup=lambda: _lib.check(vmm.vmm_import_retain(import_id)))
        release(import_id)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
