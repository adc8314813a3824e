"""Memory monitors in both processes of a producer/consumer pair: a thread that reads
torch.cuda.memory_stats() and torch.cuda.memory_snapshot() and calls empty_cache() in a loop
(a watchdog, a metrics exporter, a memory-profiling hook), in a producer that streams CUDA
tensors through a torch.multiprocessing queue (`put`, then `del`) and in a consumer that keeps
a random window of what it received and drops the rest in random order.

With PyTorch's allocator memory_stats() and memory_snapshot() are each read under the
allocator's lock, so every read is self-consistent whatever the other threads and the other
process do: in memory_stats(), for every core statistic current >= 0, peak >= current,
allocated - freed == current (nothing resets them), the large and small pools add up to "all",
reserved_bytes >= allocated_bytes and active_bytes >= allocated_bytes; in the snapshot, every
segment's blocks (sizes > 0, states active_allocated, active_pending_free or inactive) add up
to its total_size, and its allocated_size is the sum of its active_allocated blocks; and
empty_cache() never disturbs a tensor in flight: 400 tensors of 512 B to 24 MiB arrive with
their values, and the consumer's kept ones still hold them at the end. After the streaming,
with everything received dropped and the producer's sends let go (ipc_collect() polled,
sender_memory.py), the producer's memory_allocated() is back where it was, its snapshot's
active_allocated blocks add up to memory_allocated(), its segments to memory_reserved(), and
torch.cuda._memory_viz.segsum() accepts the snapshot.

Why vmm may differ: in a sender vmm has state of its own beside free and allocated blocks
(exported chunks whose free space is retired while receivers map them, blocks held until
acknowledged, spare chunks) changed by background threads (the fd server and release thread
taking the consumer's reports), and in a receiver imports closed by a background closer; the
statistics and the snapshot are built from that state while it changes, and empty_cache()
releases chunks beside exports and holds.
"""
import random
import sys
import threading
import time

import torch
import torch.multiprocessing as mp
from dropin_report import report
from sender_memory import memory_back_error

MIB = 1 << 20
SENDS = 400
TIMEOUT = 60
STATES = ("active_allocated", "active_pending_free", "inactive")
CORE = ("allocation", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
        "inactive_split", "inactive_split_bytes", "requested_bytes")


def stats_problems(stats):
    out = []
    for name in CORE:
        for pool in ("all", "large_pool", "small_pool"):
            key = f"{name}.{pool}"
            cur, peak = stats.get(key + ".current"), stats.get(key + ".peak")
            alloc, freed = stats.get(key + ".allocated"), stats.get(key + ".freed")
            if None in (cur, peak, alloc, freed):
                continue
            if cur < 0 or peak < cur:
                out.append(f"{key}: current {cur}, peak {peak}")
            if alloc - freed != cur:
                out.append(f"{key}: allocated {alloc} - freed {freed} != current {cur}")
        parts = [stats.get(f"{name}.{pool}.current") for pool in ("all", "large_pool",
                                                                  "small_pool")]
        if None not in parts and parts[0] != parts[1] + parts[2]:
            out.append(f"{name}: all {parts[0]} != large {parts[1]} + small {parts[2]}")
    alloc = stats.get("allocated_bytes.all.current", 0)
    if stats.get("reserved_bytes.all.current", 0) < alloc:
        out.append(f"reserved_bytes {stats.get('reserved_bytes.all.current')} < allocated_bytes "
                   f"{alloc}")
    if stats.get("active_bytes.all.current", 0) < alloc:
        out.append(f"active_bytes {stats.get('active_bytes.all.current')} < allocated_bytes "
                   f"{alloc}")
    return out


def snapshot_problems(segments):
    out = []
    for seg in segments:
        blocks = seg.get("blocks", [])
        sizes = [b.get("size", 0) for b in blocks]
        states = {b.get("state") for b in blocks}
        if any(s <= 0 for s in sizes) or not states <= set(STATES):
            out.append(f"segment at {seg.get('address')}: block sizes {sizes[:6]}, states "
                       f"{sorted(map(str, states))}")
        if sum(sizes) != seg.get("total_size"):
            out.append(f"segment at {seg.get('address')}: blocks add up to {sum(sizes)}, "
                       f"total_size {seg.get('total_size')}")
        allocated = sum(b["size"] for b in blocks if b.get("state") == "active_allocated")
        if "allocated_size" in seg and seg["allocated_size"] != allocated:
            out.append(f"segment at {seg.get('address')}: allocated_size "
                       f"{seg['allocated_size']}, its active_allocated blocks {allocated}")
    return out


def monitor(stop, problems, who):
    """Reads the statistics and the snapshot and empties the cache until `stop` is set (at
    least once); the first problems it finds go to `problems`."""
    reads = 0
    try:
        while True:
            found = stats_problems(torch.cuda.memory_stats())
            found += snapshot_problems(torch.cuda.memory_snapshot())
            torch.cuda.empty_cache()
            reads += 1
            if found and len(problems) < 6:
                problems.append(f"{who} monitor, read {reads}: {'; '.join(found[:3])}")
            if stop.is_set():
                break
            time.sleep(0.001)
    except Exception as e:  # noqa: BLE001
        problems.append(f"{who} monitor: {type(e).__name__}: {str(e)[:300]}")
    return reads


def consumer(q, reply, done):
    rng = random.Random(1)
    problems = []
    stop = threading.Event()
    th = threading.Thread(target=monitor, args=(stop, problems, "consumer"))
    torch.ones(1, device="cuda")
    th.start()
    try:
        kept, bad = {}, []
        for _ in range(SENDS):
            i, t = q.get(timeout=TIMEOUT)
            if float(t[0].item()) != float(i) or float(t[-1].item()) != float(i):
                bad.append(i)
            kept[i] = t
            del t
            while len(kept) > 16:  # drop one at random
                del kept[rng.choice(list(kept))]
        torch.cuda.synchronize()
        bad += [i for i, t in kept.items() if not bool((t == float(i)).all().item())]
        kept.clear()
        stop.set()
        th.join(30)
        torch.cuda.synchronize()
        reply.put(("done", bad[:5], problems))
        done.wait(TIMEOUT)
    except Exception as e:  # noqa: BLE001
        stop.set()
        reply.put(("error", f"{type(e).__name__}: {str(e)[:400]}", problems))


def main():
    errors = []
    rng = random.Random(0)
    ctx = mp.get_context("spawn")
    q, reply, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=consumer, args=(q, reply, done), daemon=True)
    p.start()
    side = torch.cuda.Stream()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    problems = []
    stop = threading.Event()
    th = threading.Thread(target=monitor, args=(stop, problems, "producer"))
    th.start()
    scratch = []
    for i in range(SENDS):
        n = rng.choice((128, 1000, 65536, 300_000, rng.randrange(128, 6 * MIB)))
        stream = side if i % 3 == 0 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            t = torch.full((n,), float(i), device="cuda")
            scratch.append(torch.empty(rng.randrange(1, 2 * MIB), dtype=torch.uint8,
                                       device="cuda"))
        if stream is side:
            side.synchronize()  # the queue's feeder thread sends from the default stream
        q.put((i, t))
        del t
        if len(scratch) > 6:
            del scratch[rng.randrange(len(scratch))]
    del scratch
    try:
        got = reply.get(timeout=TIMEOUT)
    except Exception:  # noqa: BLE001
        got = ("error", f"no answer (consumer alive: {p.is_alive()})", [])
    stop.set()
    th.join(30)
    if got[0] == "error":
        errors.append(f"the consumer failed: {got[1]}")
    elif got[1]:
        errors.append(f"the consumer read wrong values in sends {got[1]}")
    errors += got[2] + problems

    done.set()
    p.join(30)
    err = memory_back_error(base, "consumer")
    if err:
        errors.append(err)
    # A quiet moment: two reads of the statistics that agree around one snapshot.
    deadline = time.monotonic() + 5
    while True:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        snap = torch.cuda.memory._snapshot()
        again = torch.cuda.memory_stats()
        keys = ("allocated_bytes.all.current", "reserved_bytes.all.current")
        if all(stats[k] == again[k] for k in keys) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    segments = snap["segments"]
    found = stats_problems(stats) + snapshot_problems(segments)
    if found:
        errors.append(f"at the end: {'; '.join(found[:3])}")
    allocated = sum(b["size"] for s in segments for b in s["blocks"]
                    if b.get("state") == "active_allocated")
    if allocated != stats["allocated_bytes.all.current"]:
        errors.append(f"at the end the snapshot's active_allocated blocks add up to "
                      f"{allocated}, memory_stats() says {stats['allocated_bytes.all.current']}")
    if sum(s["total_size"] for s in segments) != stats["reserved_bytes.all.current"]:
        errors.append(f"at the end the snapshot's segments add up to "
                      f"{sum(s['total_size'] for s in segments)}, memory_stats() says "
                      f"{stats['reserved_bytes.all.current']} reserved")
    try:
        from torch.cuda import _memory_viz
        _memory_viz.segsum(snap)
    except Exception as e:  # noqa: BLE001
        errors.append(f"_memory_viz.segsum() refused the snapshot: {type(e).__name__}: {e}")
    report(errors)


if __name__ == "__main__":
    sys.exit(main())
