// stats.h: the pool's statistics, declared once as lists of fields.
//
// Each byte or count statistic is a Stat {current, peak, allocated, freed} with PyTorch's
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

namespace vmm {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;

  void Increase(int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void Decrease(int64_t n) {
    current -= n;
    freed += n;
  }
  void ResetPeak() { peak = current; }
  void ResetAccumulated() { allocated = freed = 0; }
};

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
    "exported chunks reused for a shareable block once every receiver released them")

struct PoolStats {
#define VMM_DECLARE_STAT(name, key, what) Stat name;
  VMM_BYTE_STATS(VMM_DECLARE_STAT)
  VMM_COUNT_STATS(VMM_DECLARE_STAT)
#undef VMM_DECLARE_STAT
#define VMM_DECLARE_COUNTER(name, key, what) int64_t name = 0;
  VMM_COUNTERS(VMM_DECLARE_COUNTER)
#undef VMM_DECLARE_COUNTER

  // Derived when the stats are read.
  int64_t largest_free_block = 0;
  // 1 - largest free block / cached free bytes: 0 when the cache is one block (or empty).
  double fragmentation = 0;
};

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
};

// A maximal run of adjacent mapped chunks, and the blocks inside it.
struct SegmentInfo {
  uintptr_t addr = 0;
  size_t size = 0;
  std::vector<ChunkInfo> chunks;
  std::vector<BlockInfo> blocks;
};

struct Snapshot {
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
