#include "allocator/stats_json.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "allocator/block.h"

namespace vmm {
namespace {

using Json = nlohmann::json;

// The statistics and counters of torch.cuda.memory_stats() that vmm also keeps, by PyTorch's
// names (CUDACachingAllocator's DeviceStats); stats.h gives each vmm field its PyTorch name.
constexpr absl::string_view kTorchStats[] = {
    "allocation",      "segment",        "active",       "inactive_split",
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
    "requested_bytes",
};
constexpr absl::string_view kTorchCounters[] = {
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
};

bool Contains(absl::Span<const absl::string_view> names, absl::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

Json StatJson(const Stat& stat) {
  return Json{{"current", stat.current},
              {"peak", stat.peak},
              {"allocated", stat.allocated},
              {"freed", stat.freed}};
}

// Adds "PREFIX.current", "PREFIX.peak", "PREFIX.allocated" and "PREFIX.freed".
void AddFlatStat(Json& out, const std::string& prefix, const Stat& stat) {
  out[prefix + ".current"] = stat.current;
  out[prefix + ".peak"] = stat.peak;
  out[prefix + ".allocated"] = stat.allocated;
  out[prefix + ".freed"] = stat.freed;
}

void AddTorchStat(Json& out, absl::string_view key, const Stat& stat) {
  AddFlatStat(out,
              Contains(kTorchStats, key) ? absl::StrCat(key, ".all") : absl::StrCat("vmm.", key),
              stat);
}

void AddTorchCounter(Json& out, absl::string_view key, int64_t value) {
  out[Contains(kTorchCounters, key) ? std::string(key) : absl::StrCat("vmm.", key)] = value;
}

const char* TorchState(BlockState state) {
  switch (state) {
    case BlockState::kAllocated:
      return "active_allocated";
    case BlockState::kPendingFree:
      return "active_pending_free";
    case BlockState::kUnmapped:
    case BlockState::kFree:
    case BlockState::kRetired:
      break;
  }
  return "inactive";
}

bool IsActive(BlockState state) {
  return state == BlockState::kAllocated || state == BlockState::kPendingFree;
}

// The stream all active blocks of `segment` share, else 0.
Stream SegmentStream(const SegmentInfo& segment) {
  bool found = false;
  Stream stream = 0;
  for (const BlockInfo& b : segment.blocks) {
    if (!IsActive(b.state)) continue;
    if (found && b.stream != stream) return 0;
    found = true;
    stream = b.stream;
  }
  return stream;
}

Json TorchBlock(const BlockInfo& block) {
  const bool active = IsActive(block.state);
  Json out{{"address", static_cast<uint64_t>(block.addr)},
           {"size", static_cast<uint64_t>(block.size)},
           {"requested_size", active ? static_cast<uint64_t>(block.requested) : 0},
           {"state", TorchState(block.state)},
           {"frames", Json::array()}};
  if (block.state == BlockState::kRetired) out["vmm_state"] = BlockStateName(block.state);
  return out;
}

Json TorchSegment(int device, const SegmentInfo& segment) {
  uint64_t allocated = 0, active = 0, requested = 0;
  Json blocks = Json::array();
  for (const BlockInfo& b : segment.blocks) {
    if (b.state == BlockState::kAllocated) {
      allocated += b.size;
      requested += b.requested;
    }
    if (IsActive(b.state)) active += b.size;
    blocks.push_back(TorchBlock(b));
  }
  return Json{{"device", device},
              {"address", static_cast<uint64_t>(segment.addr)},
              {"total_size", static_cast<uint64_t>(segment.size)},
              {"allocated_size", allocated},
              {"active_size", active},
              {"requested_size", requested},
              {"stream", static_cast<uint64_t>(SegmentStream(segment))},
              {"segment_type", "large"},
              {"segment_pool_id", Json::array({0, 0})},
              {"is_expandable", true},
              {"frames", Json::array()},
              {"blocks", std::move(blocks)}};
}

Json StreamJson(Stream stream) {
  if (stream == kAnyStream) return nullptr;
  return static_cast<uint64_t>(stream);
}

Json ChunkJson(const ChunkInfo& chunk) {
  return Json{{"address", static_cast<uint64_t>(chunk.addr)},
              {"size", static_cast<uint64_t>(chunk.size)},
              {"exported", chunk.exported},
              {"dedicated", chunk.dedicated}};
}

Json BlockJson(const BlockInfo& block) {
  return Json{{"address", static_cast<uint64_t>(block.addr)},
              {"size", static_cast<uint64_t>(block.size)},
              {"requested", static_cast<uint64_t>(block.requested)},
              {"state", BlockStateName(block.state)},
              {"stream", StreamJson(block.stream)}};
}

Json SegmentJson(const SegmentInfo& segment) {
  Json chunks = Json::array();
  for (const ChunkInfo& c : segment.chunks) chunks.push_back(ChunkJson(c));
  Json blocks = Json::array();
  for (const BlockInfo& b : segment.blocks) blocks.push_back(BlockJson(b));
  return Json{{"address", static_cast<uint64_t>(segment.addr)},
              {"size", static_cast<uint64_t>(segment.size)},
              {"chunks", std::move(chunks)},
              {"blocks", std::move(blocks)}};
}

}  // namespace

Json StatsToJson(const PoolStats& stats) {
  Json out = Json::object();
#define VMM_STAT_TO_JSON(name, key, what) out[#name] = StatJson(stats.name);
  VMM_BYTE_STATS(VMM_STAT_TO_JSON)
  VMM_COUNT_STATS(VMM_STAT_TO_JSON)
#undef VMM_STAT_TO_JSON
#define VMM_COUNTER_TO_JSON(name, key, what) out[#name] = stats.name;
  VMM_COUNTERS(VMM_COUNTER_TO_JSON)
#undef VMM_COUNTER_TO_JSON
  out["largest_free_block"] = stats.largest_free_block;
  out["fragmentation"] = stats.fragmentation;
  return out;
}

Json TorchMemoryStats(const PoolStats& stats) {
  Json out = Json::object();
#define VMM_STAT_TO_TORCH(name, key, what) AddTorchStat(out, key, stats.name);
  VMM_BYTE_STATS(VMM_STAT_TO_TORCH)
  VMM_COUNT_STATS(VMM_STAT_TO_TORCH)
#undef VMM_STAT_TO_TORCH
#define VMM_COUNTER_TO_TORCH(name, key, what) AddTorchCounter(out, key, stats.name);
  VMM_COUNTERS(VMM_COUNTER_TO_TORCH)
#undef VMM_COUNTER_TO_TORCH
  out["vmm.largest_free_block"] = stats.largest_free_block;
  out["vmm.fragmentation"] = stats.fragmentation;
  return out;
}

Json TorchSnapshot(const std::vector<Snapshot>& snapshots) {
  Json segments = Json::array();
  int devices = 0;
  for (const Snapshot& snap : snapshots) {
    devices = std::max(devices, snap.device + 1);
    for (const SegmentInfo& seg : snap.segments) segments.push_back(TorchSegment(snap.device, seg));
  }
  Json traces = Json::array();
  for (int d = 0; d < devices; ++d) traces.push_back(Json::array());
  return Json{{"segments", std::move(segments)}, {"device_traces", std::move(traces)}};
}

Json SnapshotToJson(const Snapshot& snapshot) {
  Json segments = Json::array();
  for (const SegmentInfo& seg : snapshot.segments) segments.push_back(SegmentJson(seg));
  return Json{{"device", snapshot.device},
              {"backend", snapshot.backend},
              {"device_uuid", snapshot.device_uuid},
              {"reserved",
               {{"address", static_cast<uint64_t>(snapshot.reserved_base)},
                {"size", static_cast<uint64_t>(snapshot.reserved_size)}}},
              {"granularity", static_cast<uint64_t>(snapshot.granularity)},
              {"segments", std::move(segments)}};
}

}  // namespace vmm
