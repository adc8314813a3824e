// Tests of the JSON forms of the pool's statistics and snapshots (stats_json.h), on a host
// backend pool holding blocks in every state: allocated, pending free, cached free and
// retired.
#include "allocator/stats_json.h"

#include <algorithm>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "allocator/driver.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace vmm {
namespace {

using Json = nlohmann::json;

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// Holds a stream until Open(): a host function on it waits for the gate.
class StreamGate {
 public:
  StreamGate(Driver* driver, Stream stream)
      : driver_(driver), stream_(stream), opened_(promise_.get_future().share()) {
    EXPECT_TRUE(driver_->LaunchHostFunc(stream_, &StreamGate::Wait, &opened_).ok());
  }
  ~StreamGate() {
    Open();
    EXPECT_TRUE(driver_->SynchronizeStream(stream_).ok());  // the waiter is done with us
  }
  void Open() {
    if (!open_) promise_.set_value();
    open_ = true;
  }

 private:
  static void Wait(void* arg) { static_cast<std::shared_future<void>*>(arg)->wait(); }

  Driver* const driver_;
  const Stream stream_;
  std::promise<void> promise_;
  std::shared_future<void> opened_;
  bool open_ = false;
};

class StatsJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    driver_ = NewHostDriver(HostDriverOptions{2 * kMiB, 512 * kMiB});
    s_ = *driver_->CreateStream(0);
    t_ = *driver_->CreateStream(0);
    PoolOptions options;
    options.reserve_size = 1024 * kMiB;
    options.large_page = 8 * kMiB;  // PopulateEveryState's blocks share 8 MiB pages
    auto pool = Pool::Create(driver_.get(), options);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  void TearDown() override {
    gate_.reset();
    for (void* p : live_) EXPECT_TRUE(pool_->Free(p).ok());
    pool_.reset();
    EXPECT_TRUE(driver_->DestroyStream(s_).ok());
    EXPECT_TRUE(driver_->DestroyStream(t_).ok());
  }

  void* Alloc(size_t size, Stream stream) {
    auto p = pool_->Allocate(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    live_.push_back(*p);
    return *p;
  }

  void Free(void* p) {
    live_.erase(std::find(live_.begin(), live_.end(), p));
    EXPECT_TRUE(pool_->Free(p).ok());
  }

  // Leaves the pool with allocated blocks on two streams, cached free blocks (some usable by
  // every stream), retired space in an exported chunk, and a block whose free waits for t_.
  void PopulateEveryState() {
    Free(Alloc(8 * kMiB, s_));
    void* a = Alloc(2 * kMiB, s_);  // a and b share the 8 MiB chunk just cached
    Alloc(2 * kMiB, s_);
    Alloc(3 * kMiB, 0);
    Alloc(64 * kKiB, s_);
    if (pool_->handle_type() != HandleType::kNone) {
      ASSERT_TRUE(pool_->Export(a).ok());  // retires the chunk's free 4 MiB
    }
    ASSERT_TRUE(pool_->EmptyCache().ok());  // cached blocks become usable by every stream
    gate_ = std::make_unique<StreamGate>(driver_.get(), t_);
    void* e = Alloc(256 * kKiB, s_);
    ASSERT_TRUE(pool_->RecordStream(e, t_).ok());
    Free(e);  // pending until t_ passes the gate
  }

  bool exportable() const { return pool_->handle_type() != HandleType::kNone; }

  std::unique_ptr<Driver> driver_;
  Stream s_ = 0;
  Stream t_ = 0;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<StreamGate> gate_;
  std::vector<void*> live_;
};

// --- StatsToJson ------------------------------------------------------------------------------

TEST_F(StatsJsonTest, StatsToJsonHasEveryFieldOfTheLists) {
  PopulateEveryState();
  if (HasFatalFailure()) return;
  const PoolStats stats = pool_->GetStats();
  const std::string text = StatsToJson(stats).dump();
  ASSERT_TRUE(Json::accept(text)) << text;
  const Json j = Json::parse(text);
  size_t fields = 0;
#define VMM_EXPECT_STAT(name, key, what)                                          \
  ++fields;                                                                       \
  ASSERT_TRUE(j.contains(#name)) << #name;                                        \
  EXPECT_EQ(j[#name].size(), 4u) << #name;                                        \
  EXPECT_EQ(j[#name]["current"].get<int64_t>(), stats.name.current) << #name;     \
  EXPECT_EQ(j[#name]["peak"].get<int64_t>(), stats.name.peak) << #name;           \
  EXPECT_EQ(j[#name]["allocated"].get<int64_t>(), stats.name.allocated) << #name; \
  EXPECT_EQ(j[#name]["freed"].get<int64_t>(), stats.name.freed) << #name;
  VMM_BYTE_STATS(VMM_EXPECT_STAT)
  VMM_COUNT_STATS(VMM_EXPECT_STAT)
#undef VMM_EXPECT_STAT
#define VMM_EXPECT_COUNTER(name, key, what) \
  ++fields;                                 \
  ASSERT_TRUE(j.contains(#name)) << #name;  \
  EXPECT_EQ(j[#name].get<int64_t>(), stats.name) << #name;
  VMM_COUNTERS(VMM_EXPECT_COUNTER)
#undef VMM_EXPECT_COUNTER
  EXPECT_EQ(j["largest_free_block"].get<int64_t>(), stats.largest_free_block);
  EXPECT_DOUBLE_EQ(j["fragmentation"].get<double>(), stats.fragmentation);
  // Each arena's PyTorch statistics.
  ASSERT_TRUE(j.contains("arenas"));
  EXPECT_EQ(j["arenas"].size(), 2u);
  for (const auto& [name, kind] : {std::pair{"small", kSmallArena}, {"large", kLargeArena}}) {
    const Json& arena = j["arenas"][name];
    size_t arena_fields = 0;
#define VMM_EXPECT_ARENA_STAT(stat)                                                     \
  ++arena_fields;                                                                        \
  EXPECT_EQ(arena.at(#stat).at("current").get<int64_t>(), stats.arena[kind].stat.current) \
      << name << " " << #stat;                                                           \
  EXPECT_EQ(arena.at(#stat).at("peak").get<int64_t>(), stats.arena[kind].stat.peak)       \
      << name << " " << #stat;
    VMM_TORCH_STATS(VMM_EXPECT_ARENA_STAT)
#undef VMM_EXPECT_ARENA_STAT
    EXPECT_EQ(arena.size(), arena_fields) << name;
  }
  EXPECT_EQ(j.size(), fields + 3)
      << "no field beyond the lists, the arenas and the two derived ones";
  EXPECT_GT(stats.allocation.current, 0);
}

// --- TorchMemoryStats ------------------------------------------------------------------------

TEST_F(StatsJsonTest, TorchMemoryStatsUsesPyTorchKeys) {
  PopulateEveryState();
  if (HasFatalFailure()) return;
  const PoolStats s = pool_->GetStats();
  const Json j = TorchMemoryStats(s);
  ASSERT_TRUE(j.is_object());
  // PyTorch's own names, spelled out.
  const std::pair<const char*, const Stat*> torch_stats[] = {
      {"allocation", &s.allocation},
      {"segment", &s.segment},
      {"active", &s.active},
      {"inactive_split", &s.inactive_split},
      {"allocated_bytes", &s.allocated_bytes},
      {"reserved_bytes", &s.reserved_bytes},
      {"active_bytes", &s.active_bytes},
      {"inactive_split_bytes", &s.inactive_split_bytes},
      {"requested_bytes", &s.requested_bytes},
  };
  for (const auto& [key, stat] : torch_stats) {
    const std::string all = absl::StrCat(key, ".all.");
    EXPECT_EQ(j.at(all + "current").get<int64_t>(), stat->current) << key;
    EXPECT_EQ(j.at(all + "peak").get<int64_t>(), stat->peak) << key;
    EXPECT_EQ(j.at(all + "allocated").get<int64_t>(), stat->allocated) << key;
    EXPECT_EQ(j.at(all + "freed").get<int64_t>(), stat->freed) << key;
  }
  EXPECT_EQ(j.at("allocated_bytes.all.current").get<int64_t>(), s.allocated_bytes.current);
  EXPECT_EQ(j.at("num_alloc_retries").get<int64_t>(), s.num_alloc_retries);
  EXPECT_EQ(j.at("num_ooms").get<int64_t>(), s.num_ooms);
  EXPECT_EQ(j.at("num_sync_all_streams").get<int64_t>(), s.num_sync_all_streams);
  EXPECT_EQ(j.at("num_device_alloc").get<int64_t>(), s.num_device_alloc);
  EXPECT_EQ(j.at("num_device_free").get<int64_t>(), s.num_device_free);
  // vmm's own, prefixed.
  EXPECT_EQ(j.at("vmm.exported_bytes.current").get<int64_t>(), s.exported_bytes.current);
  EXPECT_EQ(j.at("vmm.exported_chunks.peak").get<int64_t>(), s.exported_chunks.peak);
  EXPECT_EQ(j.at("vmm.driver_calls.create").get<int64_t>(), s.driver_create);
  EXPECT_EQ(j.at("vmm.num_exports").get<int64_t>(), s.num_exports);
  EXPECT_EQ(j.at("vmm.largest_free_block").get<int64_t>(), s.largest_free_block);
  EXPECT_TRUE(j.at("vmm.fragmentation").is_number_float());
  // Every field of the lists is there, under PyTorch's name or vmm's.
  auto stat_key = [&](const char* key) {
    return j.contains(absl::StrCat(key, ".all.current")) ? absl::StrCat(key, ".all.")
                                                         : absl::StrCat("vmm.", key, ".");
  };
  size_t keys = 0;
#define VMM_EXPECT_TORCH_STAT(name, key, what)                                      \
  keys += 4;                                                                        \
  EXPECT_EQ(j.at(stat_key(key) + "current").get<int64_t>(), s.name.current) << key; \
  EXPECT_EQ(j.at(stat_key(key) + "freed").get<int64_t>(), s.name.freed) << key;
  VMM_BYTE_STATS(VMM_EXPECT_TORCH_STAT)
  VMM_COUNT_STATS(VMM_EXPECT_TORCH_STAT)
#undef VMM_EXPECT_TORCH_STAT
#define VMM_EXPECT_TORCH_COUNTER(name, key, what)                                           \
  ++keys;                                                                                   \
  EXPECT_EQ((j.contains(key) ? j.at(key) : j.at(absl::StrCat("vmm.", key))).get<int64_t>(), \
            s.name)                                                                         \
      << key;
  VMM_COUNTERS(VMM_EXPECT_TORCH_COUNTER)
#undef VMM_EXPECT_TORCH_COUNTER
  // PyTorch's pool types: the small arena's and the large arena's figures.
  for (const auto& [pool, kind] :
       {std::pair{".small_pool.", kSmallArena}, {".large_pool.", kLargeArena}}) {
#define VMM_EXPECT_POOL_STAT(name)                                                  \
  keys += 4;                                                                        \
  EXPECT_EQ(j.at(#name + std::string(pool) + "current").get<int64_t>(),             \
            s.arena[kind].name.current)                                             \
      << #name << pool;                                                             \
  EXPECT_EQ(j.at(#name + std::string(pool) + "allocated").get<int64_t>(),           \
            s.arena[kind].name.allocated)                                           \
      << #name << pool;                                                             \
  EXPECT_EQ(j.at(#name + std::string(pool) + "peak").get<int64_t>(),                \
            s.arena[kind].name.peak)                                                \
      << #name << pool;                                                             \
  EXPECT_EQ(j.at(#name + std::string(pool) + "freed").get<int64_t>(),               \
            s.arena[kind].name.freed)                                               \
      << #name << pool;
    VMM_TORCH_STATS(VMM_EXPECT_POOL_STAT)
#undef VMM_EXPECT_POOL_STAT
  }
  EXPECT_EQ(j.size(), keys + 2);
  for (const auto& [key, value] : j.items()) EXPECT_TRUE(value.is_number()) << key;
}

// --- TorchSnapshot ---------------------------------------------------------------------------

const char* ExpectedTorchState(BlockState state) {
  switch (state) {
    case BlockState::kAllocated:
      return "active_allocated";
    case BlockState::kPendingFree:
      return "active_pending_free";
    default:
      return "inactive";
  }
}

TEST_F(StatsJsonTest, TorchSnapshotHasPyTorchsStructure) {
  PopulateEveryState();
  if (HasFatalFailure()) return;
  const Snapshot snap = pool_->GetSnapshot();
  const Json j = TorchSnapshot({snap});
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j.at("device_traces"), Json::array({Json::array()}));
  const Json& segments = j.at("segments");
  ASSERT_EQ(segments.size(), snap.segments.size());
  ASSERT_GE(segments.size(), 2u);  // the small arena's and the large arena's
  int states_seen[5] = {};
  for (size_t i = 0; i < segments.size(); ++i) {
    const Json& seg = segments[i];
    const SegmentInfo& info = snap.segments[i];
    EXPECT_EQ(seg.at("device").get<int>(), 0);
    EXPECT_EQ(seg.at("address").get<uint64_t>(), info.addr);
    EXPECT_EQ(seg.at("segment_type"), info.large ? "large" : "small");
    EXPECT_EQ(info.large, pool_->InSmallArena(reinterpret_cast<void*>(info.addr)) == false);
    EXPECT_EQ(seg.at("segment_pool_id"), Json::array({0, 0}));
    EXPECT_EQ(seg.at("vmm_pool").get<int64_t>(), 0);
    EXPECT_TRUE(seg.at("is_expandable").get<bool>());
    EXPECT_EQ(seg.at("frames"), Json::array());
    const Json& blocks = seg.at("blocks");
    ASSERT_EQ(blocks.size(), info.blocks.size());
    uint64_t address = seg.at("address").get<uint64_t>();
    uint64_t allocated = 0, active = 0, requested = 0, sizes = 0;
    Stream stream = 0;
    bool one_stream = true, any_active = false;
    for (size_t k = 0; k < blocks.size(); ++k) {
      const Json& b = blocks[k];
      const BlockInfo& bi = info.blocks[k];
      ++states_seen[static_cast<int>(bi.state)];
      // The memory visualizer places blocks by adding up sizes from the segment's address.
      EXPECT_EQ(b.at("address").get<uint64_t>(), address);
      address += b.at("size").get<uint64_t>();
      sizes += b.at("size").get<uint64_t>();
      EXPECT_EQ(b.at("size").get<uint64_t>(), bi.size);
      EXPECT_EQ(b.at("state"), ExpectedTorchState(bi.state));
      EXPECT_EQ(b.at("frames"), Json::array());
      EXPECT_EQ(b.contains("vmm_state"), bi.state == BlockState::kRetired);
      if (bi.state == BlockState::kRetired) {
        EXPECT_EQ(b.at("vmm_state"), "retired");
      }
      const bool is_active =
          bi.state == BlockState::kAllocated || bi.state == BlockState::kPendingFree;
      EXPECT_EQ(b.at("requested_size").get<uint64_t>(), is_active ? bi.requested : 0);
      EXPECT_LE(b.at("requested_size").get<uint64_t>(), bi.size);
      if (bi.state == BlockState::kAllocated) {
        allocated += bi.size;
        requested += bi.requested;
      }
      if (is_active) {
        active += bi.size;
        one_stream &= !any_active || bi.stream == stream;
        stream = bi.stream;
        any_active = true;
      }
    }
    EXPECT_EQ(sizes, seg.at("total_size").get<uint64_t>()) << "blocks tile the segment";
    EXPECT_EQ(seg.at("total_size").get<uint64_t>(), info.size);
    EXPECT_EQ(seg.at("allocated_size").get<uint64_t>(), allocated);
    EXPECT_EQ(seg.at("active_size").get<uint64_t>(), active);
    EXPECT_EQ(seg.at("requested_size").get<uint64_t>(), requested);
    EXPECT_EQ(seg.at("stream").get<uint64_t>(), one_stream ? stream : 0);
  }
  EXPECT_GT(states_seen[static_cast<int>(BlockState::kAllocated)], 0);
  EXPECT_GT(states_seen[static_cast<int>(BlockState::kPendingFree)], 0);
  EXPECT_GT(states_seen[static_cast<int>(BlockState::kFree)], 0);
  if (exportable()) {
    EXPECT_GT(states_seen[static_cast<int>(BlockState::kRetired)], 0);
  }
  EXPECT_EQ(states_seen[static_cast<int>(BlockState::kUnmapped)], 0);
}

TEST(TorchSnapshotTest, ListsOneTracePerDeviceAndEveryDevicesSegments) {
  Snapshot a;
  a.device = 0;
  a.segments.push_back(SegmentInfo{0x200000, 0x200000, {}, {{0x200000, 0x200000, 0}}});
  Snapshot b;
  b.device = 2;
  b.segments.push_back(SegmentInfo{0x800000, 0x200000, {}, {{0x800000, 0x200000, 0}}});
  const Json j = TorchSnapshot({a, b});
  EXPECT_EQ(j.at("device_traces"), Json::array({Json::array(), Json::array(), Json::array()}));
  ASSERT_EQ(j.at("segments").size(), 2u);
  EXPECT_EQ(j.at("segments")[0].at("device").get<int>(), 0);
  EXPECT_EQ(j.at("segments")[1].at("device").get<int>(), 2);
  EXPECT_EQ(j.at("segments")[1].at("blocks")[0].at("state"), "inactive");
  EXPECT_EQ(TorchSnapshot({}),
            Json({{"segments", Json::array()}, {"device_traces", Json::array()}}));
}

TEST(TorchSnapshotTest, TagsSegmentsWithTheirPoolAndArena) {
  Snapshot a;
  a.pool_id = 7;
  a.mempool_id[0] = 3;
  a.mempool_id[1] = 0;
  a.segments.push_back(SegmentInfo{0x200000, 0x200000, {}, {{0x200000, 0x200000, 0}}});
  a.segments.push_back(SegmentInfo{0x800000, 0x200000, {}, {{0x800000, 0x200000, 0}}, true});
  const Json j = TorchSnapshot({a});
  ASSERT_EQ(j.at("segments").size(), 2u);
  for (const Json& seg : j.at("segments")) {
    EXPECT_EQ(seg.at("segment_pool_id"), Json::array({3, 0}));
    EXPECT_EQ(seg.at("vmm_pool").get<int64_t>(), 7);
  }
  EXPECT_EQ(j.at("segments")[0].at("segment_type"), "small");
  EXPECT_EQ(j.at("segments")[1].at("segment_type"), "large");
  EXPECT_EQ(SnapshotToJson(a).at("pool").get<int64_t>(), 7);
}

// --- SnapshotToJson --------------------------------------------------------------------------

TEST_F(StatsJsonTest, SnapshotToJsonDescribesSegmentsChunksAndBlocks) {
  PopulateEveryState();
  if (HasFatalFailure()) return;
  const Snapshot snap = pool_->GetSnapshot();
  const Json j = SnapshotToJson(snap);
  EXPECT_EQ(j.at("device").get<int>(), 0);
  EXPECT_EQ(j.at("backend"), "host");
  EXPECT_EQ(j.at("device_uuid"), pool_->device_uuid());
  EXPECT_EQ(j.at("reserved").at("address").get<uint64_t>(), snap.reserved_base);
  EXPECT_EQ(j.at("reserved").at("size").get<uint64_t>(), snap.reserved_size);
  EXPECT_EQ(j.at("granularity").get<uint64_t>(), 2 * kMiB);
  const Json& segments = j.at("segments");
  ASSERT_EQ(segments.size(), snap.segments.size());
  bool any_exported = false, any_stream_null = false;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Json& seg = segments[i];
    const SegmentInfo& info = snap.segments[i];
    EXPECT_EQ(seg.at("address").get<uint64_t>(), info.addr);
    EXPECT_EQ(seg.at("size").get<uint64_t>(), info.size);
    ASSERT_EQ(seg.at("chunks").size(), info.chunks.size());
    uint64_t chunk_bytes = 0;
    for (size_t k = 0; k < info.chunks.size(); ++k) {
      const Json& c = seg.at("chunks")[k];
      EXPECT_EQ(c.at("address").get<uint64_t>(), info.chunks[k].addr);
      EXPECT_EQ(c.at("size").get<uint64_t>(), info.chunks[k].size);
      EXPECT_EQ(c.at("exported").get<bool>(), info.chunks[k].exported);
      EXPECT_EQ(c.at("dedicated").get<bool>(), info.chunks[k].dedicated);
      chunk_bytes += info.chunks[k].size;
      any_exported |= info.chunks[k].exported;
    }
    EXPECT_EQ(chunk_bytes, info.size);
    ASSERT_EQ(seg.at("blocks").size(), info.blocks.size());
    for (size_t k = 0; k < info.blocks.size(); ++k) {
      const Json& b = seg.at("blocks")[k];
      const BlockInfo& bi = info.blocks[k];
      EXPECT_EQ(b.at("address").get<uint64_t>(), bi.addr);
      EXPECT_EQ(b.at("size").get<uint64_t>(), bi.size);
      EXPECT_EQ(b.at("requested").get<uint64_t>(), bi.requested);
      EXPECT_EQ(b.at("state"), BlockStateName(bi.state));
      if (bi.stream == kAnyStream) {
        EXPECT_TRUE(b.at("stream").is_null());
        any_stream_null = true;
      } else {
        EXPECT_EQ(b.at("stream").get<uint64_t>(), bi.stream);
      }
    }
  }
  EXPECT_EQ(any_exported, exportable());
  EXPECT_TRUE(any_stream_null) << "EmptyCache made cached blocks usable by every stream";
}

// --- Parsing back ----------------------------------------------------------------------------

TEST_F(StatsJsonTest, EveryFormSurvivesATripThroughText) {
  PopulateEveryState();
  if (HasFatalFailure()) return;
  const PoolStats stats = pool_->GetStats();
  const Snapshot snap = pool_->GetSnapshot();
  const std::string text = StatsToJson(stats).dump();
  EXPECT_EQ(Json::parse(text).dump(), text);
  for (const Json& j : {TorchMemoryStats(stats), TorchSnapshot({snap}), SnapshotToJson(snap)}) {
    const std::string dumped = j.dump(2);
    ASSERT_TRUE(Json::accept(dumped));
    EXPECT_EQ(Json::parse(dumped), j);
  }
}

}  // namespace
}  // namespace vmm
