"""The cumulative statistics of torch.cuda.memory_stats() while private pools come and go: a
torch.cuda.MemPool used, its object dropped while some of its tensors live on, a CUDA graph
captured, replayed and deleted, reset_accumulated_memory_stats() called while both pools are
alive, empty_cache() giving their memory back, and a second MemPool made and dropped (a
serving engine that keeps a KV cache in a MemPool and re-captures graphs on a model update,
logging memory_stats() at each step as torchtitan's and Megatron's memory monitors do).

memory_stats() documents each statistic as a non-negative integer, "allocated" as the
historical total increase and "freed" as the historical total decrease of "current". With
PyTorch's allocator a device keeps one set of statistics for all its pools, every change going
through increase_stat / decrease_stat, so at every point, for every core statistic (allocation,
allocated_bytes, segment, reserved_bytes, active, active_bytes, inactive_split,
inactive_split_bytes, requested_bytes; all, large_pool, small_pool): current - (current at the
last reset) == allocated - freed; allocated and freed never decrease between two resets; peak
>= current; every value is an int >= 0 (max_split_size aside); num_device_alloc and
num_device_free never decrease; max_memory_reserved() >= memory_reserved() >=
memory_allocated(). Right after reset_accumulated_memory_stats() every allocated and freed,
num_ooms and num_alloc_retries is 0. At the end memory_allocated() is back at its baseline and
empty_cache() brings memory_reserved() back to where it was.

Why vmm may differ: vmm keeps statistics per pool (the device pool, each private pool) and
adds them up; a private pool that is gone leaves its totals and counters to the GPU's
("what it still held counted as freed", ProcessState::Retire), and resets must reach pools
alive and pools gone alike: a pool counted in neither or both, a total that falls, or a
reset that misses a pool breaks the equation a monitor computes.
"""
import torch
from dropin_report import baseline, core_stats, memory_back, report, settle

MIB = 1 << 20
COUNTERS = ("num_device_alloc", "num_device_free")


class Monitor:
    def __init__(self, errors):
        self.errors = errors
        self.reset()

    def reset(self):
        torch.cuda.reset_accumulated_memory_stats()
        self.at_reset = core_stats()
        self.last = self.at_reset
        stats = torch.cuda.memory_stats()
        self.last_counters = {k: stats.get(k, 0) for k in COUNTERS}
        dirty = [f"{k}.{m}={v[m]}" for k, v in self.at_reset.items()
                 for m in ("allocated", "freed") if v.get(m, 0)]
        dirty += [f"{k}={stats[k]}" for k in ("num_ooms", "num_alloc_retries") if stats.get(k, 0)]
        if dirty:
            self.errors.append(f"after reset_accumulated_memory_stats: {', '.join(dirty[:8])}")

    def check(self, where):
        stats = torch.cuda.memory_stats()
        bad = [f"{k}={v!r}" for k, v in stats.items()
               if not isinstance(v, int) or isinstance(v, bool) or
               (v < 0 and k != "max_split_size")]
        if bad:
            self.errors.append(f"{where}: not non-negative ints: {', '.join(bad[:6])}")
        st = core_stats()
        for name, s in st.items():
            moved = s.get("current", 0) - self.at_reset.get(name, {}).get("current", 0)
            net = s.get("allocated", 0) - s.get("freed", 0)
            if moved != net:
                self.errors.append(f"{where}: {name}: current moved by {moved} since the reset "
                                   f"but allocated - freed is {net}")
            if s.get("peak", 0) < s.get("current", 0):
                self.errors.append(f"{where}: {name}: peak {s.get('peak')} < current "
                                   f"{s.get('current')}")
            before = self.last.get(name, {})
            for m in ("allocated", "freed"):
                if s.get(m, 0) < before.get(m, 0):
                    self.errors.append(f"{where}: {name}.{m} fell from {before.get(m)} to "
                                       f"{s.get(m)} without a reset")
        for k in COUNTERS:
            if stats.get(k, 0) < self.last_counters.get(k, 0):
                self.errors.append(f"{where}: {k} fell from {self.last_counters[k]} to "
                                   f"{stats.get(k, 0)}")
        self.last = st
        self.last_counters = {k: stats.get(k, 0) for k in COUNTERS}
        if not (torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
                >= torch.cuda.memory_allocated()):
            self.errors.append(f"{where}: not max_memory_reserved() >= memory_reserved() >= "
                               f"memory_allocated()")


def body(x, scratch_numel):
    t = torch.empty(scratch_numel, device="cuda")  # a temporary freed inside the capture
    t.fill_(2.0)
    y = (x * t[: x.numel()]).relu()
    del t
    return y.cumsum(0) / x.numel()


def main():
    errors = []
    keep = torch.ones(1000, device="cuda")
    base, res0, _ = baseline()
    mon = Monitor(errors)

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        in_pool = [torch.full((n,), float(i), device="cuda")
                   for i, n in enumerate((100, 5000, 300_000, 3 * MIB, 9 * MIB))]
    mon.check("after tensors were made in a MemPool")
    del in_pool[1], in_pool[2]
    mon.check("after two MemPool tensors were freed")

    x = torch.randn(MIB, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(x, 2 * MIB)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = body(x, 2 * MIB)
    g.replay()
    torch.cuda.synchronize()
    mon.check("after a CUDA graph was captured and replayed")

    mon.reset()
    mon.check("right after a reset with a MemPool and a graph alive")
    more = torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")
    g.replay()
    torch.cuda.synchronize()
    mon.check("after eager work with both pools alive")

    del g
    mon.check("after the graph was deleted")
    want = float(body(x, 2 * MIB)[-1].item())
    if abs(float(y[-1].item()) - want) > 1e-3 * max(1.0, abs(want)):
        errors.append(f"the deleted graph's output reads {float(y[-1].item())}, expected {want}")
    del y
    mon.check("after the graph's output was freed")
    del pool
    mon.check("after the MemPool object was dropped (two of its tensors alive)")
    del in_pool
    mon.check("after the dropped MemPool's last tensors were freed")
    settle()
    mon.check("after empty_cache")

    pool2 = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool2):
        t2 = [torch.empty(n, dtype=torch.uint8, device="cuda")
              for n in (512, 2 * MIB + 1, 30 * MIB)]
    mon.check("after a second MemPool was used")
    del t2
    mon.check("after its tensors were freed")
    del pool2
    settle()
    mon.check("after the second MemPool was dropped and the cache emptied")
    torch.cuda.reset_peak_memory_stats()
    st = core_stats()
    stale = [f"{k}.peak={v.get('peak')} current={v.get('current')}" for k, v in st.items()
             if v.get("peak") != v.get("current")]
    if stale:
        errors.append(f"after reset_peak_memory_stats: {', '.join(stale[:6])}")
    mon.check("after reset_peak_memory_stats")

    del more, x
    settle()
    mon.check("at the end")
    memory_back(errors, base, res0, "at the end")
    del keep
    report(errors)


if __name__ == "__main__":
    main()
