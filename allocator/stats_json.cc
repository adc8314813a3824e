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
// names (its DeviceStats): stats.h's lists.
#define VMM_TORCH_NAME(name) #name,
constexpr absl::string_view kTorchStats[] = {VMM_TORCH_STATS(VMM_TORCH_NAME)};
constexpr absl::string_view kTorchCounters[] = {VMM_TORCH_COUNTERS(VMM_TORCH_NAME)};
#undef VMM_TORCH_NAME

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

const char* TorchStateName(TorchBlockState state) {
  switch (state) {
    case TorchBlockState::kActiveAllocated:
      return "active_allocated";
    case TorchBlockState::kActivePendingFree:
      return "active_pending_free";
    case TorchBlockState::kInactive:
      break;
  }
  return "inactive";
}

Json TorchBlock(const BlockInfo& block) {
  Json out{{"address", static_cast<uint64_t>(block.addr)},
           {"size", static_cast<uint64_t>(block.size)},
           {"requested_size", TorchRequestedSize(block)},
           {"state", TorchStateName(TorchStateOf(block.state))},
           {"frames", Json::array()}};
  if (block.state == BlockState::kRetired) out["vmm_state"] = BlockStateName(block.state);
  return out;
}

Json TorchSegment(const Snapshot& snap, const SegmentInfo& segment) {
  const TorchSegmentTotals totals = TorchSegmentSummary(segment);
  Json blocks = Json::array();
  for (const BlockInfo& b : segment.blocks) blocks.push_back(TorchBlock(b));
  return Json{{"device", snap.device},
              {"address", static_cast<uint64_t>(segment.addr)},
              {"total_size", static_cast<uint64_t>(segment.size)},
              {"allocated_size", totals.allocated},
              {"active_size", totals.active},
              {"requested_size", totals.requested},
              {"stream", static_cast<uint64_t>(totals.stream)},
              {"segment_type", segment.large ? "large" : "small"},
              {"segment_pool_id", Json::array({snap.mempool_id[0], snap.mempool_id[1]})},
              {"vmm_pool", snap.pool_id},
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

TorchBlockState TorchStateOf(BlockState state) {
  switch (state) {
    case BlockState::kAllocated:
      return TorchBlockState::kActiveAllocated;
    case BlockState::kPendingFree:
      return TorchBlockState::kActivePendingFree;
    case BlockState::kUnmapped:
    case BlockState::kFree:
    case BlockState::kRetired:
      break;
  }
  return TorchBlockState::kInactive;
}

uint64_t TorchRequestedSize(const BlockInfo& block) {
  return TorchStateOf(block.state) != TorchBlockState::kInactive
             ? static_cast<uint64_t>(block.requested)
             : 0;
}

TorchSegmentTotals TorchSegmentSummary(const SegmentInfo& segment) {
  TorchSegmentTotals out;
  bool found = false;
  bool one_stream = true;
  for (const BlockInfo& b : segment.blocks) {
    const TorchBlockState state = TorchStateOf(b.state);
    if (state == TorchBlockState::kInactive) continue;
    if (state == TorchBlockState::kActiveAllocated) {
      out.allocated += b.size;
      out.requested += b.requested;
    }
    out.active += b.size;
    if (found && b.stream != out.stream) one_stream = false;
    found = true;
    out.stream = b.stream;
  }
  if (!one_stream) out.stream = 0;
  return out;
}

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
  for (int a = 0; a < kNumArenas; ++a) {
    Json& arena = out["arenas"][ArenaName(a)];
#define VMM_ARENA_STAT_TO_JSON(name) arena[#name] = StatJson(stats.arena[a].name);
    VMM_TORCH_STATS(VMM_ARENA_STAT_TO_JSON)
#undef VMM_ARENA_STAT_TO_JSON
  }
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
  for (int a = 0; a < kNumArenas; ++a) {
#define VMM_ARENA_STAT_TO_TORCH(name) \
  AddFlatStat(out, absl::StrCat(#name, ".", ArenaName(a), "_pool"), stats.arena[a].name);
    VMM_TORCH_STATS(VMM_ARENA_STAT_TO_TORCH)
#undef VMM_ARENA_STAT_TO_TORCH
  }
  return out;
}

Json TorchSnapshot(const std::vector<Snapshot>& snapshots) {
  Json segments = Json::array();
  int devices = 0;
  for (const Snapshot& snap : snapshots) {
    devices = std::max(devices, snap.device + 1);
    for (const SegmentInfo& seg : snap.segments) segments.push_back(TorchSegment(snap, seg));
  }
  Json traces = Json::array();
  for (int d = 0; d < devices; ++d) traces.push_back(Json::array());
  return Json{{"segments", std::move(segments)}, {"device_traces", std::move(traces)}};
}

Json SnapshotToJson(const Snapshot& snapshot) {
  Json segments = Json::array();
  for (const SegmentInfo& seg : snapshot.segments) segments.push_back(SegmentJson(seg));
  return Json{{"device", snapshot.device},
              {"pool", snapshot.pool_id},
              {"backend", snapshot.backend},
              {"device_uuid", snapshot.device_uuid},
              {"reserved",
               {{"address", static_cast<uint64_t>(snapshot.reserved_base)},
                {"size", static_cast<uint64_t>(snapshot.reserved_size)}}},
              {"granularity", static_cast<uint64_t>(snapshot.granularity)},
              {"segments", std::move(segments)}};
}

}  // namespace vmm
