#!/usr/bin/env python3
"""vmm_torch.distributed.broadcast / all_gather against torch.distributed's own (gloo).

    python3 bench/dist_bench.py --ranks 4 --sizes 64M,1G            # GPU machine
    python3 bench/dist_bench.py --host --ranks 3 --sizes 1M,16M     # anywhere (CPU)

For each handle type (posix_fd, then fabric) it starts `--ranks` processes (spawn) that join a
gloo process group. On the GPU each calls vmm_torch.enable(handle_type=...) before CUDA is
used, so its CUDA tensors live in vmm's pools; with --host they use Pool("host") tensors
instead. Rank 0 makes an int32 tensor of each size filled with a pattern, and it measures,
as medians over the repetitions:

- vmm_ms: vmm_torch.distributed.broadcast until every rank has mapped the tensor and read its
  first element (rank 0's clock from a barrier to the barrier after the reads);
- torch_broadcast_ms: torch.distributed.broadcast of the same data into a tensor each rank
  allocated beforehand, until every rank has read its first element;

then checks every element on every rank. One JSON line per (size, handle type), with
ratio = vmm_ms / torch_broadcast_ms (below 1: vmm is faster), and one for all_gather at the
first size. Fabric handles need an IMEX channel; where pools cannot use them the fabric
launch prints a "skipped" line. Exit status: 1 on any data mismatch or failed rank, else 0.
"""

import argparse
import datetime
import json
import os
import queue
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ELEMENT = torch.int32
ELEMENT_BYTES = 4
LARGE_BYTES = 512 << 20  # sizes from here on run at most LARGE_REPS repetitions
LARGE_REPS = 3
TIME_LIMIT_S = 220  # all launches together; the GPU run's step allows 300
GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def tensor_bytes(text):
    """Bytes of a size like "64M" or "1G" (vmm_torch.parse_size), a positive multiple of 4."""
    from vmm_torch import parse_size

    value = parse_size(text)
    if value <= 0 or value % ELEMENT_BYTES:
        raise ValueError(f"size {text} is not a positive multiple of 4 bytes")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--sizes", default="64M,1G", help="comma-separated, e.g. 64M,1G")
    p.add_argument("--handle-types", default="posix_fd,fabric")
    p.add_argument("--reps", type=int, default=5,
                   help=f"repetitions per size (at most {LARGE_REPS} from "
                        f"{LARGE_BYTES >> 20} MiB on)")
    p.add_argument("--host", action="store_true",
                   help="use Pool('host') CPU tensors instead of CUDA (no GPU needed)")
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                   help="seconds for all launches together; ranks still running are stopped")
    p.add_argument("--inject-mismatch", action="store_true",
                   help="testing: rank 1 corrupts the first broadcast; must exit 1")
    args = p.parse_args(argv)
    args.size_texts = [s.strip() for s in args.sizes.split(",") if s.strip()]
    try:
        args.size_bytes = [tensor_bytes(s) for s in args.size_texts]
    except ValueError as e:
        p.error(str(e))
    args.handle_type_list = [h.strip() for h in args.handle_types.split(",") if h.strip()]
    if args.ranks < 2:
        p.error("--ranks must be at least 2")
    return args


# --- Tensors ------------------------------------------------------------------------------

class Tensors:
    """Where a rank's tensors come from: vmm (the enabled allocator, or a host pool) for what
    vmm shares, plain PyTorch for torch.distributed's destination buffers."""

    def __init__(self, host, handle_type):
        import vmm_torch

        self.host = host
        if host:
            self.device = torch.device("cpu")
            self.pool = vmm_torch.Pool("host", handle_type=handle_type)
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pool = None

    def vmm(self, numel):
        """An uninitialised tensor in vmm's memory."""
        if self.pool is not None:
            return self.pool.empty((numel,), dtype=ELEMENT, shareable=True)
        return torch.empty(numel, dtype=ELEMENT, device=self.device)

    def plain(self, numel):
        """An uninitialised tensor for torch.distributed (on the GPU also vmm's memory, since
        vmm is PyTorch's allocator there)."""
        return torch.empty(numel, dtype=ELEMENT, device=self.device)

    def pattern(self, numel, seed):
        return torch.arange(numel, dtype=ELEMENT, device=self.device).add_(seed)

    def fill(self, t, seed):
        torch.arange(t.numel(), dtype=ELEMENT, device=self.device, out=t).add_(seed)
        self.sync()
        return t

    def matches(self, t, seed):
        return t is not None and bool(torch.equal(t, self.pattern(t.numel(), seed)))

    def sync(self):
        if not self.host:
            torch.cuda.synchronize(self.device)


def first_element(t):
    """Reads element 0 (on the GPU: a device read and a synchronisation)."""
    return int(t[0].item())


# --- Timed operations (every rank runs them; rank 0's clock counts) ------------------------

def timed(body):
    """Seconds from a barrier to the barrier after `body` ran on every rank; and its value."""
    dist.barrier()
    start = time.perf_counter()
    value = body()
    dist.barrier()
    return time.perf_counter() - start, value


def vmm_broadcast_once(tensors, numel, seed, corrupt=False):
    """(seconds, data ok on this rank) for one vmm_torch.distributed.broadcast from rank 0."""
    import vmm_torch.distributed as vdist

    rank = dist.get_rank()
    source = tensors.fill(tensors.vmm(numel), seed) if rank == 0 else None

    def body():
        out = vdist.broadcast(source, src=0)
        return out, first_element(out)

    seconds, (out, first) = timed(body)
    if corrupt and rank == 1:
        out[numel // 2] = -1
        tensors.sync()
    dist.barrier()
    ok = first == seed and tensors.matches(out, seed)
    dist.barrier()  # nobody frees before everyone has checked
    return seconds, ok


def torch_broadcast_once(tensors, buffer, source, seed):
    """(seconds, data ok on this rank) for one torch.distributed.broadcast from rank 0 into
    `buffer` (rank 0 sends `source`, filled with `seed`'s pattern)."""
    rank = dist.get_rank()
    if rank == 0:
        tensors.fill(source, seed)
    else:
        buffer.fill_(-1)
        tensors.sync()
    target = source if rank == 0 else buffer

    def body():
        dist.broadcast(target, src=0)
        return first_element(target)

    seconds, first = timed(body)
    return seconds, first == seed and tensors.matches(target, seed)


def vmm_all_gather_once(tensors, numel, seed):
    import vmm_torch.distributed as vdist

    rank = dist.get_rank()
    mine = tensors.fill(tensors.vmm(numel), seed + rank)

    def body():
        parts = vdist.all_gather(mine)
        return parts, [first_element(p) for p in parts]

    seconds, (parts, firsts) = timed(body)
    ok = all(f == seed + r and tensors.matches(p, seed + r)
             for r, (p, f) in enumerate(zip(parts, firsts)))
    dist.barrier()
    return seconds, ok


def torch_all_gather_once(tensors, buffers, mine, seed):
    rank = dist.get_rank()
    tensors.fill(mine, seed + rank)
    for b in buffers:
        b.fill_(-1)
    tensors.sync()

    def body():
        dist.all_gather(buffers, mine)
        return [first_element(b) for b in buffers]

    seconds, firsts = timed(body)
    ok = all(f == seed + r and tensors.matches(b, seed + r)
             for r, (b, f) in enumerate(zip(buffers, firsts)))
    return seconds, ok


# --- One launch: all sizes for one handle type ---------------------------------------------

def all_ranks_ok(ok):
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    return all(flags)


def median_ms(seconds):
    return round(statistics.median(seconds) * 1e3, 3)


def record(op, args, handle_type, text, nbytes, reps, vmm_s, torch_s, ok):
    vmm_ms, torch_ms = median_ms(vmm_s), median_ms(torch_s)
    return {"bench": "dist", "op": op, "backend": "host" if args.host else "cuda",
            "handle_type": handle_type, "ranks": args.ranks, "size": text, "bytes": nbytes,
            "reps": reps, "vmm_ms": vmm_ms, f"torch_{op}_ms": torch_ms,
            "ratio": round(vmm_ms / torch_ms, 4) if torch_ms else None,
            "vmm_ms_all": [round(s * 1e3, 3) for s in vmm_s],
            f"torch_{op}_ms_all": [round(s * 1e3, 3) for s in torch_s],
            "ok": ok, "torch": torch.__version__}


def reps_for(args, nbytes):
    return args.reps if nbytes < LARGE_BYTES else max(1, min(args.reps, LARGE_REPS))


def bench_broadcast(args, tensors, handle_type, text, nbytes, index):
    numel = nbytes // ELEMENT_BYTES
    reps = reps_for(args, nbytes)
    rank = dist.get_rank()
    vmm_s, torch_s, ok = [], [], True
    for rep in range(reps):
        corrupt = args.inject_mismatch and index == 0 and rep == 0
        seconds, good = vmm_broadcast_once(tensors, numel, 100 * index + rep + 1, corrupt)
        vmm_s.append(seconds)
        ok &= good
    buffer = tensors.plain(numel) if rank != 0 else None
    source = tensors.plain(numel) if rank == 0 else None
    for rep in range(reps):
        seconds, good = torch_broadcast_once(tensors, buffer, source, 100 * index + rep + 51)
        torch_s.append(seconds)
        ok &= good
    del buffer, source
    ok = all_ranks_ok(ok)
    return record("broadcast", args, handle_type, text, nbytes, reps, vmm_s, torch_s, ok)


def bench_all_gather(args, tensors, handle_type, text, nbytes):
    numel = nbytes // ELEMENT_BYTES
    reps = reps_for(args, nbytes)
    vmm_s, torch_s, ok = [], [], True
    for rep in range(reps):
        seconds, good = vmm_all_gather_once(tensors, numel, 1000 * (rep + 1))
        vmm_s.append(seconds)
        ok &= good
    buffers = [tensors.plain(numel) for _ in range(args.ranks)]
    mine = tensors.plain(numel)
    for rep in range(reps):
        seconds, good = torch_all_gather_once(tensors, buffers, mine, 1000 * (rep + 1) + 500)
        torch_s.append(seconds)
        ok &= good
    del buffers, mine
    ok = all_ranks_ok(ok)
    return record("all_gather", args, handle_type, text, nbytes, reps, vmm_s, torch_s, ok)


def probe(tensors, handle_type):
    """None if this rank's vmm tensors export with `handle_type`, else why not."""
    import vmm_torch

    try:
        t = tensors.vmm(1)
        used = vmm_torch.export_tensor(t).descriptor.handle_type
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if used != handle_type:
        return f"pool exports {used} handles, not {handle_type}"
    return None


def warm_up(tensors):
    """One small untimed round of each operation (starts threads, sockets, contexts)."""
    numel = (2 << 20) // ELEMENT_BYTES
    vmm_broadcast_once(tensors, numel, 7)
    buffer = tensors.plain(numel)
    torch_broadcast_once(tensors, buffer, buffer, 8)


def run_rank(rank, args, handle_type, init_method, results):
    """One rank of one launch: rank 0 puts each record on `results`."""
    import vmm_torch

    if not args.host:
        vmm_torch.enable(handle_type=handle_type)  # before CUDA is used
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=args.ranks, timeout=GROUP_TIMEOUT)
    tensors = Tensors(args.host, handle_type)
    problems = [None] * args.ranks
    dist.all_gather_object(problems, probe(tensors, handle_type))
    if any(problems):
        if rank == 0:
            reason = next(p for p in problems if p)
            results.put({"bench": "dist", "handle_type": handle_type, "skipped": reason})
    else:
        warm_up(tensors)
        for index, (text, nbytes) in enumerate(zip(args.size_texts, args.size_bytes)):
            rec = bench_broadcast(args, tensors, handle_type, text, nbytes, index)
            if rank == 0:
                results.put(rec)
        rec = bench_all_gather(args, tensors, handle_type, args.size_texts[0],
                               args.size_bytes[0])
        if rank == 0:
            results.put(rec)
    dist.barrier()
    dist.destroy_process_group()


def rank_main(rank, args, handle_type, init_method, results):
    try:
        run_rank(rank, args, handle_type, init_method, results)
        results.put(("done", rank, None))
    except BaseException:
        results.put(("failed", rank, traceback.format_exc()))


# --- The launcher ---------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(procs, results, deadline):
    """Prints records as they come; returns (records, failures) once every rank is done,
    one failed, or the deadline passed."""
    records, failures, done = [], [], set()
    while len(done) < len(procs) and not failures:
        try:
            item = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                failures.append(f"timed out with ranks {sorted(set(range(len(procs))) - done)}"
                                f" still running")
            elif any(p.exitcode not in (None, 0) for p in procs):
                failures.append("a rank exited with " + ", ".join(
                    f"rank {i}: {p.exitcode}" for i, p in enumerate(procs) if p.exitcode))
            continue
        if isinstance(item, dict):
            print(json.dumps(item), flush=True)
            records.append(item)
        elif item[0] == "done":
            done.add(item[1])
        else:
            failures.append(f"rank {item[1]} failed:\n{item[2]}")
    return records, failures


def launch(args, handle_type, deadline):
    """Runs every rank of one handle type until `deadline` (time.monotonic()) at the latest;
    returns (records, failures)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, args, handle_type, init_method, results))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    try:
        return collect(procs, results, deadline)
    finally:
        for proc in procs:
            proc.join(10)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo over loopback
    failed = False
    deadline = time.monotonic() + args.time_limit
    for handle_type in args.handle_type_list:
        records, failures = launch(args, handle_type, deadline)
        for failure in failures:
            print(f"dist_bench: {handle_type}: {failure}", file=sys.stderr, flush=True)
        bad = [r for r in records if r.get("ok") is False]
        for r in bad:
            print(f"dist_bench: DATA MISMATCH in {r['op']} {r['size']} {handle_type}",
                  file=sys.stderr, flush=True)
        failed |= bool(failures or bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
