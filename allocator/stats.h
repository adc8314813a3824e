// stats.h: the pool's statistics, declared once as lists of fields.
//
// Each byte or count statistic is a Stat (stat.h) {current, peak, allocated, freed} with PyTorch's
// meanings: `allocated` and `freed` are cumulative increases and decreases, so that
// current == allocated - freed. Counters only go up. The lists below are the single source
// for the struct, for the JSON dump and for the PyTorch-named keys (stats_json.h), so a new
// statistic is one line here.
//
// Snapshot lists the pool's contiguous mapped segments, the physical chunks behind them, and
// every block with its state, for people and for PyTorch's memory visualizer.
#ifndef VMM_ALLOCATOR_STATS_H_
#define VMM_ALLOCATOR_STATS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allocator/block.h"
#include "allocator/stat.h"

namespace vmm {

// X(name, pytorch_key, what): byte statistics.
#define VMM_BYTE_STATS(X)                                                                  \
  X(allocated_bytes, "allocated_bytes", "bytes handed out, rounded to the block size")     \
  X(requested_bytes, "requested_bytes", "bytes callers asked for")                         \
  X(active_bytes, "active_bytes", "allocated bytes plus freed bytes still used by streams") \
  X(reserved_bytes, "reserved_bytes", "physical bytes mapped by the pool")                 \
  X(inactive_split_bytes, "inactive_split_bytes", "cached free bytes")                     \
  X(exported_bytes, "exported_bytes", "physical bytes in chunks that have been exported")

// X(name, pytorch_key, what): count statistics.
#define VMM_COUNT_STATS(X)                                                          \
  X(allocation, "allocation", "live allocations")                                   \
  X(active, "active", "allocations plus freed blocks still used by streams")        \
  X(segment, "segment", "physical chunks")                                          \
  X(inactive_split, "inactive_split", "cached free blocks")                         \
  X(exported_chunks, "exported_chunks", "chunks that have been exported")

// X(name, pytorch_key, what): counters.
#define VMM_COUNTERS(X)                                                                   \
  X(num_device_alloc, "num_device_alloc", "growths: physical memory created and mapped")  \
  X(num_device_free, "num_device_free", "releases: physical memory unmapped and released") \
  X(num_alloc_retries, "num_alloc_retries", "allocations retried after trimming the cache") \
  X(num_ooms, "num_ooms", "allocations that failed for lack of memory")                   \
  X(num_sync_all_streams, "num_sync_all_streams", "device synchronisations before release") \
  X(driver_create, "driver_calls.create", "cuMemCreate calls")                            \
  X(driver_release, "driver_calls.release", "cuMemRelease calls")                         \
  X(driver_map, "driver_calls.map", "cuMemMap calls")                                     \
  X(driver_unmap, "driver_calls.unmap", "cuMemUnmap calls")                               \
  X(driver_set_access, "driver_calls.set_access", "cuMemSetAccess calls")                 \
  X(driver_export, "driver_calls.export", "cuMemExportToShareableHandle calls")           \
  X(driver_event, "driver_calls.event", "event record/query calls for stream ordering")   \
  X(num_exports, "num_exports", "blocks exported")                                        \
  X(num_export_reuses, "num_export_reuses",                                               \
    "spare exported chunks reused (for a send or as plain memory) once released by all")  \
  X(num_chunk_moves, "num_chunk_moves",                                                   \
    "free chunks unmapped and mapped again where a miss needed memory (no growth)")       \
  X(moved_bytes, "moved_bytes", "bytes of the free chunks moved (num_chunk_moves' bytes)")  \
  X(num_range_extensions, "num_range_extensions",                                         \
    "address ranges reserved after the pool's first, where no gap held a request")         \
  X(num_page_switches, "num_page_switches",                                               \
    "pools without pages that began growing in pressure_page pages (pool_options.h)")     \
  X(num_small_spills, "num_small_spills",                                                 \
    "blocks of up to small_size served by the large arena (small range full, or no memory)") \
  X(num_sync_stream, "num_sync_stream",                                                   \
    "stream synchronisations: before moving or exporting free memory that stream last "  \
    "used, and for a free whose stream could take no event")

// X(name): the statistics above that PyTorch's DeviceStats (c10/core/CachingDeviceAllocator.h)
// also keeps, under the same name (their key above is that name too). The one list of which
// vmm statistic is which of PyTorch's: the JSON keys (stats_json.h) and the C interface's
// vmm_torch_stats (torch_plugin/vmm_c.h) are both made from it.
#define VMM_TORCH_STATS(X)                                                                \
  X(allocation) X(segment) X(active) X(inactive_split) X(allocated_bytes) X(reserved_bytes) \
  X(active_bytes) X(inactive_split_bytes) X(requested_bytes)

// X(name): the counters above that PyTorch's DeviceStats also keeps, under the same name.
#define VMM_TORCH_COUNTERS(X)                                                          \
  X(num_alloc_retries) X(num_ooms) X(num_sync_all_streams) X(num_device_alloc) X(num_device_free)

// The arenas of a pool, as PyTorch's pool types: the small arena (requests up to
// PoolOptions::small_size) is PyTorch's small_pool, the large arena its large_pool.
enum ArenaKind : int { kSmallArena = 0, kLargeArena = 1, kNumArenas = 2 };
// The arena of `addr` in a pool whose large arena begins at `large_base`.
inline ArenaKind ArenaKindAt(uintptr_t addr, uintptr_t large_base) {
  return addr >= large_base ? kLargeArena : kSmallArena;
}
// "small" or "large", as the JSON forms name them.
inline const char* ArenaName(int kind) { return kind == kLargeArena ? "large" : "small"; }

// The statistics PyTorch keeps per pool type (VMM_TORCH_STATS), for one arena.
struct ArenaStats {
#define VMM_DECLARE_ARENA_STAT(name) Stat name;
  VMM_TORCH_STATS(VMM_DECLARE_ARENA_STAT)
#undef VMM_DECLARE_ARENA_STAT
};

struct PoolStats {
#define VMM_DECLARE_STAT(name, key, what) Stat name;
  VMM_BYTE_STATS(VMM_DECLARE_STAT)
  VMM_COUNT_STATS(VMM_DECLARE_STAT)
#undef VMM_DECLARE_STAT
#define VMM_DECLARE_COUNTER(name, key, what) int64_t name = 0;
  VMM_COUNTERS(VMM_DECLARE_COUNTER)
#undef VMM_DECLARE_COUNTER

  // The same statistics of each arena, indexed by ArenaKind: for every Stat field, the
  // arenas' current, allocated and freed add up to the pool's (their peaks need not).
  ArenaStats arena[kNumArenas];

  // Derived when the stats are read.
  int64_t largest_free_block = 0;
  // 1 - largest free block / cached free bytes: 0 when the cache is one block (or empty).
  double fragmentation = 0;
};

// Adds every field of `s` to `t` (a peak so summed is at least the peak of the sum).
inline void AddStat(const Stat& s, Stat& t) {
  t.current += s.current;
  t.peak += s.peak;
  t.allocated += s.allocated;
  t.freed += s.freed;
}

// Calls `f(from.x, to.x)` on every Stat x: the byte and count statistics, then each arena's.
template <typename F>
void ForEachStatPair(const PoolStats& from, PoolStats& to, F&& f) {
#define VMM_EACH_STAT(name, key, what) f(from.name, to.name);
  VMM_BYTE_STATS(VMM_EACH_STAT)
  VMM_COUNT_STATS(VMM_EACH_STAT)
#undef VMM_EACH_STAT
  for (int a = 0; a < kNumArenas; ++a) {
#define VMM_EACH_ARENA_STAT(name) f(from.arena[a].name, to.arena[a].name);
    VMM_TORCH_STATS(VMM_EACH_ARENA_STAT)
#undef VMM_EACH_ARENA_STAT
  }
}

// Calls `f` on every Stat of `stats`, in ForEachStatPair's order.
template <typename F>
void ForEachStat(PoolStats& stats, F&& f) {
  ForEachStatPair(stats, stats, [&f](const Stat&, Stat& s) { f(s); });
}

// Every peak of `stats` at least that of `floor` (the peaks a GPU's figures reached before a
// pool that is gone took its own out of their sum).
inline void RaisePeaks(const PoolStats& floor, PoolStats& stats) {
  ForEachStatPair(floor, stats, [](const Stat& f, Stat& s) { s.peak = std::max(s.peak, f.peak); });
}

// Every statistic's peak back to its current value.
inline void ResetPeaks(PoolStats& stats) {
  ForEachStat(stats, [](Stat& s) { s.ResetPeak(); });
}

// Every statistic's cumulative figures and every counter back to 0 (current and peak stay).
inline void ResetAccumulated(PoolStats& stats) {
  ForEachStat(stats, [](Stat& s) { s.ResetAccumulated(); });
#define VMM_RESET_COUNTER(name, key, what) stats.name = 0;
  VMM_COUNTERS(VMM_RESET_COUNTER)
#undef VMM_RESET_COUNTER
}

// What a pool that is gone leaves in its GPU's statistics (PyTorch's totals never fall): its
// cumulative figures, what it still held counted as freed, and its counters, with the
// releases of its teardown (~Pool unmaps and releases each chunk it still holds: one
// segment each); nothing current and no peak (the GPU's byte peaks are kept apart:
// device_cap.h).
inline PoolStats RetiredStats(const PoolStats& pool) {
  PoolStats out;
  ForEachStatPair(pool, out, [](const Stat& s, Stat& t) {
    t.allocated = s.allocated;
    t.freed = s.freed + s.current;
  });
#define VMM_RETIRE_COUNTER(name, key, what) out.name = pool.name;
  VMM_COUNTERS(VMM_RETIRE_COUNTER)
#undef VMM_RETIRE_COUNTER
  const int64_t chunks = pool.segment.current;
  out.num_device_free += chunks;
  out.driver_unmap += chunks;
  out.driver_release += chunks;
  return out;
}

// Adds the statistics of one more pool to `total` (the statistics of several pools as one, e.g.
// a GPU's): every field of a Stat and every counter is summed, so a peak is the sum of the
// pools' peaks (at least the peak of the sum, and equal to it when one pool alone allocated);
// largest_free_block is the largest of the pools' and fragmentation is derived again.
inline void AddPoolStats(const PoolStats& pool, PoolStats& total) {
  ForEachStatPair(pool, total, AddStat);
#define VMM_ADD_COUNTER(name, key, what) total.name += pool.name;
  VMM_COUNTERS(VMM_ADD_COUNTER)
#undef VMM_ADD_COUNTER
  total.largest_free_block = std::max(total.largest_free_block, pool.largest_free_block);
  const int64_t free_bytes = total.inactive_split_bytes.current;
  total.fragmentation = free_bytes == 0 ? 0.0
                                        : 1.0 - static_cast<double>(total.largest_free_block) /
                                                    static_cast<double>(free_bytes);
}

struct BlockInfo {
  uintptr_t addr = 0;
  size_t size = 0;
  size_t requested = 0;
  BlockState state = BlockState::kFree;
  Stream stream = 0;
};

struct ChunkInfo {
  uintptr_t addr = 0;
  size_t size = 0;
  bool exported = false;
  bool dedicated = false;
  bool observed = false;  // exported once; the export observer may keep its handle (chunk_map.h)
};

// A maximal run of adjacent mapped chunks of one arena, and the blocks inside it.
struct SegmentInfo {
  uintptr_t addr = 0;
  size_t size = 0;
  std::vector<ChunkInfo> chunks;
  std::vector<BlockInfo> blocks;
  bool large = false;  // in the large arena (else the small one)
};

struct Snapshot {
  // Set by whoever owns the pool, not by the pool (0 when it does not say): the process's id
  // of the pool (torch_plugin: 0 for a device pool) and, for a private pool, PyTorch's
  // MempoolId (TorchSnapshot's "segment_pool_id").
  int64_t pool_id = 0;
  uint64_t mempool_id[2] = {0, 0};
  int device = 0;
  std::string backend;
  std::string device_uuid;
  uintptr_t reserved_base = 0;  // the pool's reserved virtual range
  size_t reserved_size = 0;
  size_t granularity = 0;
  std::vector<SegmentInfo> segments;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_STATS_H_
