"""memory_stats() against memory_snapshot(), count by count, and the counters of device
calls, as memory monitors read them (torchtitan's and Megatron's memory reports log
num_alloc_retries, num_ooms and the peaks; memory_viz and memory_summary() print both views).

With PyTorch's allocator both views are the allocator's one state, so at any moment with
nothing queued: allocation.all.current is the number of "active_allocated" blocks of the
snapshot, active.all.current the number of active blocks (allocated or pending free) and
active_bytes.all.current their bytes; allocated_bytes.small_pool.current and
.large_pool.current are the bytes of the active_allocated blocks in segments whose
segment_type is "small" and "large", and reserved_bytes.small_pool / .large_pool .current the
total_size of those segments. That holds after allocations of 1 byte to 48 MiB with holes,
after a tensor is dropped while a side stream it was recorded on still runs (its block
pending: counted in active, not in allocation), and after everything is freed. And: a 256 MiB
tensor made with nothing cached raises num_device_alloc (a cudaMalloc) and
reserved_bytes.large_pool.current by at least its bytes; freeing it and empty_cache() raise
num_device_free and num_sync_all_streams and lower reserved_bytes.all.current by at least its
bytes; right after reset_peak_memory_stats() every ".peak" of these statistics equals its
".current" and max_memory_reserved() equals memory_reserved(). (requested_bytes is not
compared: with PyTorch's allocator on torch 2.11 a block freed while a recorded stream ran
stays in requested_bytes.all.current after everything is freed.)

Why vmm may differ: vmm's statistics (vmm_device_torch_stats) and its snapshot
(vmm_snapshot_get) are two reports built from its pools' bookkeeping, its small arena is
PyTorch's small pool, and its counters count growths, releases and device synchronisations
of its own; a block counted in one report and not in the other shows here. (vmm documents
that its "segment" counts physical chunks where a snapshot segment is a run of them, and that
inactive_split counts every cached block: those two are not compared.)
"""
import torch
from dropin_report import report

MIB = 1 << 20
CORE = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
        "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")


def from_snapshot():
    v = {"allocated_count": 0, "active_count": 0, "active_bytes": 0, "requested": 0,
         "allocated": {"small": 0, "large": 0}, "reserved": {"small": 0, "large": 0}}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        kind = seg.get("segment_type")
        if kind not in ("small", "large"):
            kind = "large" if seg.get("is_large", True) else "small"
        v["reserved"][kind] += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                v["allocated_count"] += 1
                v["allocated"][kind] += b["size"]
                v["requested"] += b.get("requested_size", 0)
            if b["state"] in ("active_allocated", "active_pending_free"):
                v["active_count"] += 1
                v["active_bytes"] += b["size"]
    return v


def from_stats(s):
    return {"allocated_count": s["allocation.all.current"],
            "active_count": s["active.all.current"],
            "active_bytes": s["active_bytes.all.current"],
            "requested": s["requested_bytes.all.current"],
            "allocated": {"small": s["allocated_bytes.small_pool.current"],
                          "large": s["allocated_bytes.large_pool.current"]},
            "reserved": {"small": s["reserved_bytes.small_pool.current"],
                         "large": s["reserved_bytes.large_pool.current"]}}


def compare(where, errors):
    """Both views, read between two identical reads of memory_stats() (a view that changes
    meanwhile, as a background release might make it, is read again)."""
    for _ in range(5):
        before = from_stats(torch.cuda.memory_stats())
        snap = from_snapshot()
        after = from_stats(torch.cuda.memory_stats())
        if before == after:
            break
    names = {"allocated_count": "allocation.all.current vs active_allocated blocks",
             "active_count": "active.all.current vs active blocks",
             "active_bytes": "active_bytes.all.current vs the bytes of active blocks"}
    for key, text in names.items():
        if after[key] != snap[key]:
            errors.append(f"{where}: {text}: {after[key]} != {snap[key]}")
    for kind in ("small", "large"):
        if after["allocated"][kind] != snap["allocated"][kind]:
            errors.append(f"{where}: allocated_bytes.{kind}_pool.current "
                          f"{after['allocated'][kind]} != bytes of active_allocated blocks in "
                          f"{kind} segments {snap['allocated'][kind]}")
        if after["reserved"][kind] != snap["reserved"][kind]:
            errors.append(f"{where}: reserved_bytes.{kind}_pool.current "
                          f"{after['reserved'][kind]} != total_size of {kind} segments "
                          f"{snap['reserved'][kind]}")


def main():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    errors = []
    compare("at the start", errors)

    keep = []
    sizes = [1, 700, 4096, 100_000, MIB, MIB + 1, 3 * MIB + 100, 12 * MIB, 48 * MIB, 200]
    for i, n in enumerate(sizes * 3):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        if i % 3 != 1:
            keep.append(t)
    del t
    torch.cuda.synchronize()
    compare("after 30 allocations with holes", errors)

    side = torch.cuda.Stream()
    x = torch.ones(4 * MIB, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 100 ms
        y = x * 2
    x.record_stream(side)
    del x
    compare("with a freed block pending on a side stream", errors)
    torch.cuda.synchronize()
    del y
    compare("after the side stream finished", errors)

    del keep
    torch.cuda.synchronize()
    compare("after everything was freed", errors)

    torch.cuda.empty_cache()
    s0 = torch.cuda.memory_stats()
    big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    big.fill_(1)
    s1 = torch.cuda.memory_stats()
    if s1.get("num_device_alloc", 0) <= s0.get("num_device_alloc", 0):
        errors.append(f"a 256 MiB tensor made with nothing cached left num_device_alloc at "
                      f"{s1.get('num_device_alloc')}")
    grew = s1["reserved_bytes.large_pool.current"] - s0["reserved_bytes.large_pool.current"]
    if grew < 256 * MIB:
        errors.append("a 256 MiB tensor made with nothing cached raised "
                      "reserved_bytes.large_pool.current by less than 256 MiB")
    compare("with a 256 MiB tensor", errors)
    del big
    torch.cuda.empty_cache()
    s2 = torch.cuda.memory_stats()
    if s2.get("num_device_free", 0) <= s1.get("num_device_free", 0):
        errors.append(f"empty_cache() after a 256 MiB tensor was freed left num_device_free at "
                      f"{s2.get('num_device_free')}")
    if s2.get("num_sync_all_streams", 0) <= s1.get("num_sync_all_streams", 0):
        errors.append(f"empty_cache() left num_sync_all_streams at "
                      f"{s2.get('num_sync_all_streams')}")
    if s1["reserved_bytes.all.current"] - s2["reserved_bytes.all.current"] < 256 * MIB:
        errors.append("freeing a 256 MiB tensor and empty_cache() lowered "
                      "reserved_bytes.all.current by less than 256 MiB")
    compare("after empty_cache()", errors)

    scratch = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (5 * MIB, 300, 70 * MIB)]
    del scratch
    torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    for name in CORE:
        for pool in ("all", "small_pool", "large_pool"):
            key = f"{name}.{pool}"
            if f"{key}.peak" in stats and stats[f"{key}.peak"] != stats.get(f"{key}.current"):
                errors.append(f"right after reset_peak_memory_stats() {key}.peak is "
                              f"{stats[f'{key}.peak']}, current {stats.get(f'{key}.current')}")
    if torch.cuda.max_memory_reserved() != torch.cuda.memory_reserved():
        errors.append(f"right after reset_peak_memory_stats() max_memory_reserved() is "
                      f"{torch.cuda.max_memory_reserved()}, memory_reserved() "
                      f"{torch.cuda.memory_reserved()}")
    report(errors)


if __name__ == "__main__":
    main()
