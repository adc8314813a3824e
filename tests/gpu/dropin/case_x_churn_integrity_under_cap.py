"""Random allocation churn under a per-process cap, with every tensor's contents checked: a
long-running job (a server with requests of every size, an RL learner with varying rollout
buffers) whose tensors of 16 KiB to 384 MiB come and go on two streams, some made on one
stream from a tensor of the other (Tensor.record_stream, the source often dropped at once),
some queued behind GPU sleeps, with live memory kept near 3.5 GiB under a cap of what the
process held at the start plus 6 GiB; an allocation that raises OutOfMemoryError is handled
as such programs handle it (check and drop half of the live tensors, largest first, retry;
then all of them).

With PyTorch's allocator every tensor holds its value (its fill, or its source's value plus
one) from its making to its drop, whatever was allocated, freed or queued meanwhile on
either stream; an allocation with nothing live under the cap never fails; memory_allocated()
follows the live tensors (at least their bytes, at most 2 MiB more each); and once
everything is dropped and the cache emptied, memory_allocated() and memory_reserved() are
back where they were.

Why vmm may differ: near its cap vmm's pool switches its large arena to 4 MiB pages and
serves misses by moving the pages of free blocks to where the request goes (unmapping and
mapping them again: pool.h, reclaim_policy.h), reclaims blocks other streams freed once their
events complete, and moves memory between its small and large arenas; a page taken from a
block that is still live, still read by a queued kernel, or whose stream has not caught up,
corrupts a tensor here, and accounting that drifts shows as a spurious out of memory.
"""
import math
import random

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20
GIB = 1 << 30
CAP_EXTRA = 6 * GIB
TARGET_LIVE = int(3.5 * GIB)
OPS = 1500
SLEEP = 20_000_000  # cycles: about 10 ms
MIN_BYTES, MAX_BYTES = 16 << 10, 384 * MIB


def main():
    errors = []
    rng = random.Random(20261205)
    keep = torch.full((4096,), 3.0, device="cuda")
    base, res0, _ = baseline()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (res0 + CAP_EXTRA) / total))
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    live = {}  # key -> [tensor, value, stream index]
    counts = {"ooms": 0, "allocs": 0, "frees": 0, "derived": 0, "checks": 0, "bytes": 0}
    serial = [0]

    def fail(msg):
        if len(errors) < 8:
            errors.append(msg)

    def check(key, when):
        t, v, si = live[key]
        try:
            with torch.cuda.stream(streams[si]):
                mn, mx = torch.aminmax(t)
                got = torch.stack([mn, mx]).tolist()
        except torch.cuda.OutOfMemoryError:  # its two scalars did not fit: not checked
            return
        counts["checks"] += 1
        if got != [v, v]:
            fail(f"{when}: a tensor of {t.numel() * 4} bytes made on stream {si} holds "
                 f"min/max {got}, expected {v}")

    def drop(key):
        t, _, _ = live.pop(key)
        counts["bytes"] -= t.numel() * 4
        counts["frees"] += 1

    def add(t, v, si):
        serial[0] += 1
        live[serial[0]] = [t, v, si]
        counts["bytes"] += t.numel() * 4
        counts["allocs"] += 1

    def alloc(nelem, si, op):
        """A float32 tensor on stream si; on OutOfMemoryError drops half, then everything."""
        for attempt in range(3):
            try:
                with torch.cuda.stream(streams[si]):
                    return torch.empty(nelem, device="cuda")
            except torch.cuda.OutOfMemoryError:
                counts["ooms"] += 1
                keys = sorted(live, key=lambda k: -live[k][0].numel())
                if attempt == 0:
                    keys = keys[: max(1, len(keys) // 2)]
                for k in keys:
                    check(k, f"op {op}, before dropping it after an out of memory")
                    drop(k)
        fail(f"op {op}: a tensor of {nelem * 4} bytes raised OutOfMemoryError with nothing "
             f"live under a cap of {CAP_EXTRA} bytes above the start")
        return None

    for op in range(OPS):
        r = rng.random()
        if live and (r < 0.35 or counts["bytes"] > TARGET_LIVE):
            key = rng.choice(list(live))
            if rng.random() < 0.3:
                check(key, f"op {op}")
            drop(key)
        elif live and r < 0.47:
            # A tensor made on the other stream from a live one, which may be dropped at once
            # while that stream still reads it.
            key = rng.choice(list(live))
            src, v, si = live[key]
            so = 1 - si
            u = alloc(src.numel(), so, op)
            if u is None:
                del src
                continue
            streams[so].wait_stream(streams[si])
            with torch.cuda.stream(streams[so]):
                if rng.random() < 0.3:
                    torch.cuda._sleep(SLEEP)
                torch.add(src, 1.0, out=u)
            src.record_stream(streams[so])
            add(u, v + 1.0, so)
            counts["derived"] += 1
            del src, u
            if key in live and rng.random() < 0.5:
                drop(key)
        else:
            nbytes = int(math.exp(rng.uniform(math.log(MIN_BYTES), math.log(MAX_BYTES))))
            nelem = max(1, nbytes // 4)
            si = 0 if rng.random() < 0.7 else 1
            t = alloc(nelem, si, op)
            if t is None:
                continue
            v = float(1 + serial[0] % 1000)
            with torch.cuda.stream(streams[si]):
                if rng.random() < 0.1:
                    torch.cuda._sleep(SLEEP)
                t.fill_(v)
            add(t, v, si)
            del t
        if op % 150 == 149:
            for key in list(live):
                check(key, f"op {op}, checking every live tensor")
        if len(errors) >= 8:
            break

    torch.cuda.synchronize()
    for key in list(live):
        check(key, "at the end")
    allocated = torch.cuda.memory_allocated() - base
    if allocated < counts["bytes"]:
        fail(f"memory_allocated() is {allocated} bytes above the start with {counts['bytes']} "
             f"bytes in {len(live)} live tensors")
    elif allocated > counts["bytes"] + (len(live) + 1) * 2 * MIB:
        fail(f"memory_allocated() is {allocated} bytes above the start, more than 2 MiB a "
             f"tensor above the {counts['bytes']} bytes of {len(live)} live tensors")
    print(f"{counts['allocs']} allocations ({counts['derived']} across streams), "
          f"{counts['frees']} frees, {counts['checks']} checks, "
          f"{counts['ooms']} out-of-memory errors handled")
    live.clear()
    torch.cuda.set_per_process_memory_fraction(1.0)
    if float(keep.sum().item()) != 3.0 * keep.numel():
        fail("a small tensor made before the churn changed")
    settle()
    memory_back(errors, base, res0, "after the churn")
    report(errors)


if __name__ == "__main__":
    main()
