// stats_json.h: the pool's statistics and snapshots as JSON, in vmm's own form and in the forms
// PyTorch's tools read.
//
// Every statistic comes from the field lists of stats.h (VMM_BYTE_STATS, VMM_COUNT_STATS,
// VMM_COUNTERS), so a statistic added there appears here without a change to this file.
//
// StatsToJson(stats): vmm's form, one key per field of PoolStats:
//   {"allocated_bytes": {"current": .., "peak": .., "allocated": .., "freed": ..}, ...,
//    "num_device_alloc": .., "driver_create": .., ..., "largest_free_block": ..,
//    "fragmentation": .., "arenas": {"small": {"allocated_bytes": {..}, ...}, "large": {..}}}
//   ("arenas": stats.h's VMM_TORCH_STATS of each arena, PoolStats::arena).
//
// TorchMemoryStats(stats): the flat dict of torch.cuda.memory_stats(), for code and dashboards
// written against PyTorch:
//   - a statistic whose key is one of PyTorch's (stats.h's VMM_TORCH_STATS: allocation,
//     segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
//     inactive_split_bytes, requested_bytes) becomes "KEY.all.current", "KEY.all.peak",
//     "KEY.all.allocated" and "KEY.all.freed", and the same of the small arena and of the
//     large one "KEY.small_pool.*" and "KEY.large_pool.*" (PyTorch's pool types; vmm's small
//     arena serves requests up to the pool's small_size, 1 MiB as in PyTorch unless the large
//     arena grows in pages, then 256 KiB);
//   - a counter whose key is one of PyTorch's (VMM_TORCH_COUNTERS: num_alloc_retries, num_ooms,
//     num_sync_all_streams, num_device_alloc, num_device_free) becomes "KEY";
//   - everything else is vmm's own and is prefixed "vmm.": "vmm.exported_bytes.current",
//     "vmm.driver_calls.create", "vmm.num_exports", "vmm.largest_free_block" and
//     "vmm.fragmentation" (the one value that is not an integer).
//   PyTorch's "max_split_size", "oversize_allocations.*" and "oversize_segments.*" have no
//   vmm counterpart and are absent.
//   (The C interface's vmm_torch_stats, made from the same lists, fills PyTorch's struct
//   instead: see torch_plugin/vmm_c.h.)
//   Where the meanings differ slightly: "segment" counts physical chunks (cuMemCreate
//   allocations, PyTorch's cudaMalloc segments); "inactive_split(_bytes)" counts every cached
//   free block (PyTorch counts only the free parts of partly used segments);
//   "num_device_alloc"/"num_device_free" count growths and chunk releases.
//
// TorchSnapshot(snapshots): the dict torch.cuda.memory._snapshot() returns, one Snapshot per
// device, so that torch.cuda._memory_viz (segment and memory plots, segsum) and PyTorch's
// memory visualizer render vmm's pool:
//   {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//                  "requested_size", "stream", "segment_type", "segment_pool_id",
//                  "vmm_pool", "is_expandable", "frames", "blocks": [{"address", "size",
//                  "requested_size", "state", "frames"}, ...]}, ...],
//    "device_traces": [[], ...]}
//   - A segment is a maximal run of mapped chunks of one arena (SegmentInfo); its blocks tile
//     it, so their sizes add up to "total_size". Segments grow and shrink by mapping, as
//     PyTorch's expandable segments do: "is_expandable" is true. "segment_type" is "small" in
//     the small arena and "large" in the large one; "segment_pool_id" is the Snapshot's
//     mempool_id ([0, 0], the default pool, unless its owner named a private pool) and
//     "vmm_pool" its pool_id.
//   - "stream" is the stream of the segment's allocated and pending blocks when they all
//     share one, else 0: a vmm segment belongs to no single stream.
//   - Block states: kAllocated -> "active_allocated"; kPendingFree -> "active_pending_free";
//     kFree -> "inactive"; kRetired -> "inactive" with "vmm_state": "retired" (free memory in
//     an exported chunk, never reused and released with its chunk). Segments never hold
//     kUnmapped blocks. "requested_size" is the caller's size for active blocks and 0 for
//     inactive ones.
//   - "allocated_size" and "requested_size" of a segment add up its active_allocated blocks,
//     "active_size" its active_allocated and active_pending_free blocks.
//   - vmm records no allocation history: "frames" are empty and "device_traces" holds one
//     empty list per device index up to the largest one given.
//
// TorchStateOf, TorchRequestedSize and TorchSegmentSummary are those rules, for the other form
// of the same snapshot (the C interface's vmm_snapshot_get).
//
// SnapshotToJson(snapshot): vmm's own snapshot: its "pool" (pool_id), the reserved range,
// granularity, backend and device UUID, and each segment with its chunks (address, size,
// exported, dedicated) and blocks (address, size, requested, state as BlockStateName() spells
// it, stream). A cached block that
// every stream may take has "stream": null.
//
// Addresses, sizes and streams are JSON integers. None of these functions fails: they only
// read the structs given.
#ifndef VMM_ALLOCATOR_STATS_JSON_H_
#define VMM_ALLOCATOR_STATS_JSON_H_

#include <string>
#include <vector>

#include "allocator/stats.h"
#include "nlohmann/json.hpp"

namespace vmm {

nlohmann::json StatsToJson(const PoolStats& stats);

nlohmann::json TorchMemoryStats(const PoolStats& stats);

nlohmann::json TorchSnapshot(const std::vector<Snapshot>& snapshots);

// A block's state in PyTorch's snapshot.
enum class TorchBlockState { kInactive, kActiveAllocated, kActivePendingFree };
TorchBlockState TorchStateOf(BlockState state);
// A block's "requested_size": the caller's size while active, else 0.
uint64_t TorchRequestedSize(const BlockInfo& block);
// A segment's sums and stream in PyTorch's snapshot.
struct TorchSegmentTotals {
  uint64_t allocated = 0;  // bytes of its active_allocated blocks
  uint64_t active = 0;     // ... and of its active_pending_free ones
  uint64_t requested = 0;  // bytes asked for its active_allocated blocks
  Stream stream = 0;       // the stream its active blocks share, else 0
};
TorchSegmentTotals TorchSegmentSummary(const SegmentInfo& segment);

nlohmann::json SnapshotToJson(const Snapshot& snapshot);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_STATS_JSON_H_
