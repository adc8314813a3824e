// Tests of the C interface (torch_plugin/vmm_c.h) through its own functions, on the host
// backend: statistics and snapshots as structs against their JSON forms, and private pools
// (CUDA graph pools, MemPools): use counts, kept memory, live blocks, allocating at an
// address, sharing, and their destruction. The interface holds the process's one state, so
// every test leaves it as it found it (no live block, no private pool).
#include "torch_plugin/vmm_c.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/capture_window.h"
#include "allocator/host_driver.h"
#include "allocator/sharing.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/told_ranges.h"

namespace {

using Json = nlohmann::json;

constexpr size_t kMiB = size_t{1} << 20;

// Before any call: the device pools and DefaultDriver() use the host backend.
const bool kHostBackend = [] {
  setenv("VMM_BACKEND", "host", 1);
  return true;
}();

// A JSON document the library returned (and released here).
Json TakeJson(char* text) {
  EXPECT_NE(text, nullptr) << vmm_last_error();
  if (text == nullptr) return Json();
  Json out = Json::parse(text);
  vmm_release_buffer(text);
  return out;
}

// Bytes of physical memory the host backend has not handed out.
size_t HostFree() { return vmm::GetHostDriver()->GetMemInfo(0)->free; }

// PyTorch's DeviceStats fields by the names of torch.cuda.memory_stats(), written out here
// rather than taken from the library's list, so that a statistic missing there shows.
struct NamedStat {
  const char* name;
  vmm_stat (vmm_torch_stats::*field)[3];
};
constexpr NamedStat kStats[] = {
    {"allocation", &vmm_torch_stats::allocation},
    {"segment", &vmm_torch_stats::segment},
    {"active", &vmm_torch_stats::active},
    {"inactive_split", &vmm_torch_stats::inactive_split},
    {"allocated_bytes", &vmm_torch_stats::allocated_bytes},
    {"reserved_bytes", &vmm_torch_stats::reserved_bytes},
    {"active_bytes", &vmm_torch_stats::active_bytes},
    {"inactive_split_bytes", &vmm_torch_stats::inactive_split_bytes},
    {"requested_bytes", &vmm_torch_stats::requested_bytes},
};
struct NamedCounter {
  const char* name;
  int64_t vmm_torch_stats::*field;
};
constexpr NamedCounter kCounters[] = {
    {"num_alloc_retries", &vmm_torch_stats::num_alloc_retries},
    {"num_ooms", &vmm_torch_stats::num_ooms},
    {"num_sync_all_streams", &vmm_torch_stats::num_sync_all_streams},
    {"num_device_alloc", &vmm_torch_stats::num_device_alloc},
    {"num_device_free", &vmm_torch_stats::num_device_free},
};

// Expects `stats` to say what the "torch" half of a stats document says.
void ExpectSameAsJson(const vmm_torch_stats& stats, const Json& doc) {
  const Json& torch = doc.at("torch");
  constexpr std::pair<vmm_stat_type, const char*> kKinds[] = {
      {VMM_STAT_ALL, ".all."}, {VMM_STAT_SMALL, ".small_pool."}, {VMM_STAT_LARGE, ".large_pool."}};
  for (const NamedStat& s : kStats) {
    const vmm_stat(&kinds)[3] = stats.*(s.field);
    for (const auto& [kind, infix] : kKinds) {
      const vmm_stat& v = kinds[kind];
      const std::string key = s.name + std::string(infix);
      EXPECT_EQ(v.current, torch.at(key + "current").get<int64_t>()) << key;
      EXPECT_EQ(v.peak, torch.at(key + "peak").get<int64_t>()) << key;
      EXPECT_EQ(v.allocated, torch.at(key + "allocated").get<int64_t>()) << key;
      EXPECT_EQ(v.freed, torch.at(key + "freed").get<int64_t>()) << key;
    }
    // The pool's figures are its arenas' together.
    EXPECT_EQ(kinds[VMM_STAT_ALL].current,
              kinds[VMM_STAT_SMALL].current + kinds[VMM_STAT_LARGE].current)
        << s.name;
    EXPECT_EQ(kinds[VMM_STAT_ALL].allocated,
              kinds[VMM_STAT_SMALL].allocated + kinds[VMM_STAT_LARGE].allocated)
        << s.name;
  }
  for (const NamedCounter& c : kCounters) {
    EXPECT_EQ(stats.*(c.field), torch.at(c.name).get<int64_t>()) << c.name;
  }
  EXPECT_EQ(stats.max_split_size, -1);
  EXPECT_EQ(stats.oversize_allocations.current | stats.oversize_allocations.allocated, 0);
  EXPECT_EQ(stats.oversize_segments.current | stats.oversize_segments.allocated, 0);
}

vmm_torch_stats DeviceStats(int device) {
  vmm_torch_stats out;
  std::memset(&out, 0xab, sizeof(out));
  EXPECT_EQ(vmm_device_torch_stats(device, &out), 0) << vmm_last_error();
  return out;
}

vmm_torch_stats PoolStats(int64_t pool) {
  vmm_torch_stats out;
  std::memset(&out, 0xab, sizeof(out));
  EXPECT_EQ(vmm_pool_torch_stats(pool, &out), 0) << vmm_last_error();
  return out;
}

// The live blocks of `pool`, through vmm_pool_live_blocks.
std::vector<vmm_block_entry> LiveBlocks(int64_t pool) {
  const int64_t n = vmm_pool_live_blocks(pool, nullptr, 0);
  EXPECT_GE(n, 0) << vmm_last_error();
  std::vector<vmm_block_entry> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  EXPECT_EQ(vmm_pool_live_blocks(pool, out.data(), out.size()), n);
  return out;
}

// The reserved range of pool `pool` (0: device 0's pool) from vmm_snapshot_json's "vmm_pools".
std::pair<uint64_t, uint64_t> ReservedRange(int64_t pool) {
  const Json doc = TakeJson(vmm_snapshot_json());
  for (const Json& p : doc.at("vmm_pools")) {
    if (p.at("pool").get<int64_t>() == pool && (pool != 0 || p.at("device").get<int>() == 0)) {
      return {p.at("reserved").at("address").get<uint64_t>(),
              p.at("reserved").at("size").get<uint64_t>()};
    }
  }
  ADD_FAILURE() << "no pool " << pool << " in the snapshot";
  return {0, 0};
}

class CApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_TRUE(kHostBackend);
    // A small reserved range for the device pools and the private pools made with their
    // options (fails harmlessly once a device pool exists).
    vmm_configure("reserve_size=1G");
  }
  void TearDown() override {
    for (auto [id0, id1] : {std::pair<uint64_t, uint64_t>{1, 0}, {2, 0}, {0, 7}}) {
      EXPECT_EQ(vmm_private_pool_use_count(0, id0, id1), 0) << "a test left a private pool";
    }
  }

  // One more use of private pool (id0, id1) on device 0 of the host backend.
  int64_t UsePrivate(uint64_t id0, uint64_t id1, const char* options = nullptr) {
    const int64_t id = vmm_private_pool_use(VMM_BACKEND_HOST, 0, id0, id1, options);
    EXPECT_GT(id, 0) << vmm_last_error();
    return id;
  }
  void* PoolAlloc(int64_t pool, size_t size, int shareable = 0) {
    void* p = vmm_pool_alloc(pool, size, nullptr, shareable);
    EXPECT_NE(p, nullptr) << vmm_last_error();
    return p;
  }
};

TEST_F(CApiTest, TheStatsStructSaysWhatTheJsonSays) {
  std::vector<void*> blocks;
  for (size_t size : {size_t{700}, 3 * kMiB, 5 * kMiB + 100, 64 * size_t{1024}, 9 * kMiB}) {
    blocks.push_back(vmm_alloc(size, 0, nullptr));
    ASSERT_NE(blocks.back(), nullptr) << vmm_last_error();
  }
  ASSERT_EQ(vmm_free(blocks[1], 0), 0);
  ASSERT_EQ(vmm_free(blocks[3], -1), 0);
  const vmm_torch_stats stats = DeviceStats(0);
  ExpectSameAsJson(stats, TakeJson(vmm_stats_json(0)));
  int64_t live_allocated = -1, live_reserved = -1;
  ASSERT_EQ(vmm_device_usage(0, &live_allocated, &live_reserved), 0) << vmm_last_error();
  EXPECT_EQ(live_allocated, stats.allocated_bytes[VMM_STAT_ALL].current);
  EXPECT_EQ(live_reserved, stats.reserved_bytes[VMM_STAT_ALL].current);
  EXPECT_GE(stats.allocation[VMM_STAT_ALL].current, 3);
  EXPECT_GT(stats.reserved_bytes[VMM_STAT_ALL].current, 0);
  // PyTorch's pool types: 700 bytes live in the small arena, 5 and 9 MiB in the large one.
  EXPECT_EQ(stats.allocation[VMM_STAT_SMALL].current, 1);
  EXPECT_EQ(stats.allocation[VMM_STAT_LARGE].current, 2);
  EXPECT_GE(stats.allocated_bytes[VMM_STAT_LARGE].current, static_cast<int64_t>(14 * kMiB));
  EXPECT_GE(stats.segment[VMM_STAT_SMALL].current, 1);
  EXPECT_GE(stats.segment[VMM_STAT_LARGE].current, 1);
  // An unused device: zeros, as in its JSON.
  const vmm_torch_stats unused = DeviceStats(5);
  ExpectSameAsJson(unused, TakeJson(vmm_stats_json(5)));
  EXPECT_EQ(unused.reserved_bytes[VMM_STAT_ALL].peak, 0);
  for (void* p : {blocks[0], blocks[2], blocks[4]}) ASSERT_EQ(vmm_free(p, 0), 0);
  ExpectSameAsJson(DeviceStats(0), TakeJson(vmm_stats_json(0)));
  EXPECT_EQ(vmm_device_torch_stats(0, nullptr), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_last_driver_error(), 0) << "a refusal of vmm's own is no CUDA error";
  // vmm_device_usage: the struct's current allocated and reserved bytes, all blocks freed.
  int64_t allocated = -1, reserved = -1;
  ASSERT_EQ(vmm_device_usage(0, &allocated, &reserved), 0) << vmm_last_error();
  const vmm_torch_stats now = DeviceStats(0);
  EXPECT_EQ(allocated, now.allocated_bytes[VMM_STAT_ALL].current);
  EXPECT_EQ(reserved, now.reserved_bytes[VMM_STAT_ALL].current);
  ASSERT_EQ(vmm_device_usage(5, &allocated, &reserved), 0) << vmm_last_error();
  EXPECT_EQ(allocated | reserved, 0) << "an unused device";
  EXPECT_EQ(vmm_device_usage(0, nullptr, &reserved), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_device_usage(0, &allocated, nullptr), -1);
}

// More than any device holds is refused and counted as an out-of-memory, as PyTorch counts it,
// whether the pool would refuse it by its GPU's size or by the address space's.
TEST_F(CApiTest, RequestsNoDeviceHoldsCountInNumOoms) {
  void* warm = vmm_alloc(4096, 0, nullptr);  // the device pool exists
  ASSERT_NE(warm, nullptr) << vmm_last_error();
  const int64_t before = DeviceStats(0).num_ooms;
  int64_t explicit_before = 0;
  const int64_t pool = vmm_pool_create(VMM_BACKEND_HOST, 0, "reserve_size=256M");
  ASSERT_GT(pool, 0) << vmm_last_error();
  explicit_before = PoolStats(pool).num_ooms;
  for (size_t size : {size_t{1} << 46, size_t{1} << 48}) {
    EXPECT_EQ(vmm_alloc(size, 0, nullptr), nullptr);
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT) << size;
    EXPECT_EQ(vmm_pool_alloc(pool, size, nullptr, 0), nullptr);
  }
  EXPECT_EQ(DeviceStats(0).num_ooms, before + 2);
  EXPECT_EQ(PoolStats(pool).num_ooms, explicit_before + 2);
  ASSERT_EQ(vmm_pool_destroy(pool), 0);
  ASSERT_EQ(vmm_free(warm, 0), 0);
}

TEST_F(CApiTest, APoolsStatsStructSaysWhatItsJsonSays) {
  const int64_t explicit_pool = vmm_pool_create(VMM_BACKEND_HOST, 0, "reserve_size=256M");
  ASSERT_GT(explicit_pool, 0) << vmm_last_error();
  const int64_t private_pool = UsePrivate(1, 0);
  for (int64_t pool : {explicit_pool, private_pool}) {
    void* a = PoolAlloc(pool, 3 * kMiB);
    void* b = PoolAlloc(pool, 100);
    ASSERT_EQ(vmm_free(a, 0), 0);
    ExpectSameAsJson(PoolStats(pool), TakeJson(vmm_pool_stats_json(pool)));
    vmm_block_free(b);
  }
  ASSERT_EQ(vmm_pool_destroy(explicit_pool), 0);
  EXPECT_EQ(vmm_pool_torch_stats(explicit_pool, nullptr), -1);
  vmm_torch_stats stats;
  EXPECT_EQ(vmm_pool_torch_stats(explicit_pool, &stats), -1) << "destroyed";
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
}

TEST_F(CApiTest, ThreadGrowthsCountTheAllocationsThatMappedMemoryOnThisThreadAlone) {
  const int64_t pool = vmm_pool_create(VMM_BACKEND_HOST, 0, "reserve_size=256M");
  ASSERT_GT(pool, 0) << vmm_last_error();
  const uint64_t before = vmm_thread_growths();
  void* a = PoolAlloc(pool, 3 * kMiB);  // the pool's first memory
  EXPECT_EQ(vmm_thread_growths(), before + 1);
  ASSERT_EQ(vmm_free(a, 0), 0);
  void* cached = PoolAlloc(pool, 3 * kMiB);  // the block just freed
  EXPECT_EQ(vmm_thread_growths(), before + 1) << "a cached allocation mapped nothing";
  uint64_t other = 0;
  std::thread([&] {
    other = vmm_thread_growths();
    void* b = PoolAlloc(pool, 40 * kMiB);
    other = vmm_thread_growths() - other;
    vmm_block_free(b);
  }).join();
  EXPECT_EQ(other, 1u);
  EXPECT_EQ(vmm_thread_growths(), before + 1) << "another thread's growth counted here";
  vmm_block_free(cached);
  ASSERT_EQ(vmm_pool_destroy(pool), 0);
}

// The ranges told to vmm_set_mapping_callback, by pool: the device pool of device 0
// (mempool_id {0, 0}) and private pools by MempoolId.
struct ToldByPool {
  std::mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<vmm::ToldRanges>> pools;
  int64_t other_devices = 0;

  vmm::ToldRanges& Of(uint64_t id0, uint64_t id1) {
    std::lock_guard<std::mutex> lock(mu);
    auto& told = pools[{id0, id1}];
    if (told == nullptr) told = std::make_unique<vmm::ToldRanges>(vmm::MappingSource{0, {id0, id1}});
    return *told;
  }
  static void Hear(const vmm_mapping_event* e, void* ctx) {
    auto* self = static_cast<ToldByPool*>(ctx);
    if (e->device != 0) {
      std::lock_guard<std::mutex> lock(self->mu);
      ++self->other_devices;
      return;
    }
    self->Of(e->mempool_id[0], e->mempool_id[1])
        .RangeMapped(vmm::MappingSource{e->device, {e->mempool_id[0], e->mempool_id[1]}},
                     e->address, e->size, e->mapped != 0);
  }
};

// The segments of vmm_snapshot_get for device 0, merged as ToldRanges merges, by pool: the
// device pool and private pools by MempoolId, explicit pools under {~0, pool id}.
std::map<std::pair<uint64_t, uint64_t>, std::map<uintptr_t, uintptr_t>> SegmentsByPool() {
  vmm_snapshot_entries* snap = nullptr;
  EXPECT_EQ(vmm_snapshot_get(&snap), 0) << vmm_last_error();
  std::map<std::pair<uint64_t, uint64_t>, std::map<uintptr_t, size_t>> chunks;
  for (size_t i = 0; snap != nullptr && i < snap->num_segments; ++i) {
    const vmm_segment_entry& s = snap->segments[i];
    if (s.device != 0) continue;
    const bool is_private = s.mempool_id[0] != 0 || s.mempool_id[1] != 0;
    const std::pair<uint64_t, uint64_t> key =
        s.pool == 0 || is_private ? std::pair{s.mempool_id[0], s.mempool_id[1]}
                                  : std::pair{~uint64_t{0}, static_cast<uint64_t>(s.pool)};
    chunks[key][s.address] = s.total_size;
  }
  if (snap != nullptr) vmm_snapshot_entries_release(snap);
  std::map<std::pair<uint64_t, uint64_t>, std::map<uintptr_t, uintptr_t>> out;
  for (const auto& [key, c] : chunks) out[key] = vmm::ToldRanges::Merge(c);
  return out;
}

TEST_F(CApiTest, TheMappingCallbackIsToldWhatTheDeviceAndPrivatePoolsMapAndUnmap) {
  static ToldByPool told;  // the callback may be called for the rest of the process
  const std::pair<uint64_t, uint64_t> device{0, 0}, mine{0, 7};
  // What the device pool holds already (made by earlier tests) was never told.
  const auto held = SegmentsByPool();
  if (auto it = held.find(device); it != held.end()) {
    for (const auto& [lo, hi] : it->second) told.Of(0, 0).Seed(lo, hi - lo);
  }
  ASSERT_EQ(vmm_set_mapping_callback(&ToldByPool::Hear, &told), 0);
  const int64_t explicit_pool = vmm_pool_create(VMM_BACKEND_HOST, 0, "reserve_size=256M");
  ASSERT_GT(explicit_pool, 0) << vmm_last_error();
  const int64_t private_pool = UsePrivate(mine.first, mine.second);
  auto check = [&](const char* when) {
    auto segments = SegmentsByPool();
    for (const auto& key : {device, mine}) {
      const vmm::ToldRanges& t = told.Of(key.first, key.second);
      for (const std::string& e : t.errors()) ADD_FAILURE() << when << ": told " << e;
      EXPECT_EQ(t.ranges(), segments[key]) << when << ": pool " << key.first << "/" << key.second;
    }
    const std::pair<uint64_t, uint64_t> expl{~uint64_t{0}, static_cast<uint64_t>(explicit_pool)};
    for (const auto& [lo, hi] : segments[expl]) {
      for (const auto& key : {device, mine}) {
        for (const auto& [tlo, thi] : told.Of(key.first, key.second).ranges()) {
          EXPECT_TRUE(thi <= lo || hi <= tlo) << when << ": an explicit pool's range was told";
        }
      }
    }
  };
  std::vector<void*> blocks;
  for (size_t size : {size_t{3} * kMiB, 40 * kMiB, size_t{1000}, 9 * kMiB}) {
    blocks.push_back(vmm_alloc(size, 0, nullptr));
    ASSERT_NE(blocks.back(), nullptr) << vmm_last_error();
  }
  void* in_private = PoolAlloc(private_pool, 5 * kMiB);
  void* in_explicit = PoolAlloc(explicit_pool, 8 * kMiB);
  check("grown");
  EXPECT_GT(told.Of(0, 0).calls(), 0) << "the device pool grew, untold";
  EXPECT_GT(told.Of(mine.first, mine.second).calls(), 0) << "the private pool grew, untold";
  for (void* p : blocks) ASSERT_EQ(vmm_free(p, 0), 0) << vmm_last_error();
  const int64_t device_calls = told.Of(0, 0).calls();
  ASSERT_EQ(vmm_empty_cache(-1), 0) << vmm_last_error();
  check("emptied");
  EXPECT_GT(told.Of(0, 0).calls(), device_calls) << "the cache went back, untold";
  // Released with a block live: it stays (and is told) until that block goes.
  ASSERT_EQ(vmm_private_pool_release(0, mine.first, mine.second), 0) << vmm_last_error();
  check("private pool released, a block live");
  EXPECT_FALSE(told.Of(mine.first, mine.second).ranges().empty());
  vmm_block_free(in_private);
  check("private pool's last block freed");
  EXPECT_TRUE(told.Of(mine.first, mine.second).ranges().empty());
  // Released with nothing live: it goes at once.
  const int64_t again = UsePrivate(mine.first, mine.second);
  vmm_block_free(PoolAlloc(again, 7 * kMiB));
  EXPECT_FALSE(told.Of(mine.first, mine.second).ranges().empty()) << "its memory is cached";
  ASSERT_EQ(vmm_private_pool_release(0, mine.first, mine.second), 0) << vmm_last_error();
  check("private pool released, nothing live");
  EXPECT_TRUE(told.Of(mine.first, mine.second).ranges().empty());
  vmm_block_free(in_explicit);
  ASSERT_EQ(vmm_pool_destroy(explicit_pool), 0) << vmm_last_error();
  // No callback: nothing more is told.
  ASSERT_EQ(vmm_set_mapping_callback(nullptr, nullptr), 0);
  const int64_t calls = told.Of(0, 0).calls();
  void* untold = vmm_alloc(64 * kMiB, 0, nullptr);
  ASSERT_NE(untold, nullptr) << vmm_last_error();
  EXPECT_EQ(told.Of(0, 0).calls(), calls);
  ASSERT_EQ(vmm_free(untold, 0), 0);
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  EXPECT_EQ(told.Of(0, 0).calls(), calls);
  EXPECT_EQ(told.other_devices, 0);
}

TEST_F(CApiTest, ThePrivatePoolsOfADeviceAreInItsStats) {
  void* d = vmm_alloc(2 * kMiB, 0, nullptr);  // the device pool exists
  ASSERT_NE(d, nullptr) << vmm_last_error();
  const vmm_torch_stats before = DeviceStats(0);
  const int64_t a = UsePrivate(1, 0);
  const int64_t b = vmm_private_pool_use(VMM_BACKEND_DEFAULT, 0, 2, 0, "");  // the same backend
  ASSERT_GT(b, 0) << vmm_last_error();
  void* pa = PoolAlloc(a, 3 * kMiB);
  void* pb = PoolAlloc(b, 6 * kMiB);
  const vmm_torch_stats after = DeviceStats(0);
  ExpectSameAsJson(after, TakeJson(vmm_stats_json(0)));
  auto current = [](const vmm_torch_stats& s, vmm_stat (vmm_torch_stats::*f)[3]) {
    return (s.*f)[VMM_STAT_ALL].current;
  };
  const vmm_torch_stats sa = PoolStats(a);
  const vmm_torch_stats sb = PoolStats(b);
  for (const NamedStat& s : kStats) {
    EXPECT_EQ(current(after, s.field),
              current(before, s.field) + current(sa, s.field) + current(sb, s.field))
        << s.name;
  }
  EXPECT_EQ(current(after, &vmm_torch_stats::allocated_bytes),
            current(before, &vmm_torch_stats::allocated_bytes) + 9 * static_cast<int64_t>(kMiB));
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc + 2);
  // Private pools of device 0 are not device 1's.
  EXPECT_EQ(DeviceStats(1).allocated_bytes[VMM_STAT_ALL].current, 0);
  // The reset of the GPU's statistics reaches them too.
  vmm_block_free(pa);
  vmm_block_free(pb);
  ASSERT_EQ(vmm_reset_peak_stats(0), 0);
  EXPECT_EQ(PoolStats(a).allocated_bytes[VMM_STAT_ALL].peak, 0);
  ASSERT_EQ(vmm_reset_accumulated_stats(0), 0);
  EXPECT_EQ(PoolStats(b).allocated_bytes[VMM_STAT_ALL].allocated, 0);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  EXPECT_EQ(vmm_private_pool_release(0, 2, 0), 0);
  ASSERT_EQ(vmm_free(d, 0), 0);
}

// A private pool that goes leaves the GPU's peaks where they were: what
// torch.cuda.memory_stats() reports as allocation.all.peak does not fall with it.
TEST_F(CApiTest, AGonePrivatePoolsPeaksStayInItsGpusStats) {
  const int64_t id = UsePrivate(77, 1);
  void* blocks[4];
  for (void*& p : blocks) p = PoolAlloc(id, kMiB);
  for (void* p : blocks) vmm_block_free(p);
  const vmm_torch_stats before = DeviceStats(0);
  ASSERT_EQ(vmm_private_pool_release(0, 77, 1), 0) << vmm_last_error();
  const vmm_torch_stats after = DeviceStats(0);
  EXPECT_GE(before.allocation[VMM_STAT_ALL].peak, 4);
  for (const NamedStat& s : kStats) {
    EXPECT_GE((after.*s.field)[VMM_STAT_ALL].peak, (before.*s.field)[VMM_STAT_ALL].peak)
        << s.name;
  }
  ASSERT_EQ(vmm_reset_peak_stats(0), 0);
  EXPECT_EQ(DeviceStats(0).allocation[VMM_STAT_ALL].peak,
            DeviceStats(0).allocation[VMM_STAT_ALL].current);
}

// A device number past those the library holds reads as an unused GPU's and resets nothing:
// as a GPU without vmm's memory, not an error (the PyTorch plugin checks the index against the
// process's GPUs before asking, as PyTorch's allocator does). What acts on such a device
// (allocating, a fraction, a hold, emptying its cache) is refused.
TEST_F(CApiTest, StatisticsOfADeviceOutOfRangeAreAnUnusedGpus) {
  for (int dev : {-1, -7, INT_MIN, 64, 65, INT_MAX}) {
    SCOPED_TRACE(dev);
    const Json json = TakeJson(vmm_stats_json(dev));
    EXPECT_TRUE(json.contains("torch"));
    EXPECT_EQ(vmm_reset_peak_stats(dev), 0);
    EXPECT_EQ(vmm_reset_accumulated_stats(dev), 0);
    EXPECT_EQ(DeviceStats(dev).allocated_bytes[VMM_STAT_ALL].current, 0);
    int64_t allocated = -1, reserved = -1;
    EXPECT_EQ(vmm_device_usage(dev, &allocated, &reserved), 0);
    EXPECT_EQ(allocated, 0);
    EXPECT_EQ(reserved, 0);
    uint64_t largest = 1;
    EXPECT_EQ(vmm_device_largest_free_block(dev, &largest), 0);
    EXPECT_EQ(largest, 0u);
    EXPECT_EQ(vmm_private_pool_use(VMM_BACKEND_HOST, dev, 1, 1, ""), -1);
    EXPECT_EQ(vmm_private_pool_release(dev, 1, 1), -1);
    EXPECT_EQ(vmm_private_pool_use_count(dev, 1, 1), 0);
    EXPECT_EQ(vmm_private_pool_find(dev, 1, 1), -1);
    EXPECT_EQ(vmm_alloc(kMiB, dev, nullptr), nullptr);
    EXPECT_EQ(vmm_set_memory_fraction(0.5, dev), -1);
    EXPECT_EQ(vmm_device_hold(dev, 10), -1);
    // Emptying the cache is an action, refused as an allocation is (a negative device: all).
    EXPECT_EQ(vmm_empty_cache(dev), dev < 0 ? 0 : -1);
  }
}

// cacheInfo's figure (cuDNN's workspace): the largest block the GPU's pools have cached,
// private pools included.
TEST_F(CApiTest, TheLargestFreeBlockOfADeviceCoversItsPrivatePools) {
  uint64_t largest = 1;
  ASSERT_EQ(vmm_device_largest_free_block(3, &largest), 0) << vmm_last_error();
  EXPECT_EQ(largest, 0u);  // a device vmm never used
  void* d = vmm_alloc(4 * kMiB, 0, nullptr);
  ASSERT_NE(d, nullptr) << vmm_last_error();
  ASSERT_EQ(vmm_free(d, 0), 0);
  ASSERT_EQ(vmm_device_largest_free_block(0, &largest), 0);
  EXPECT_GE(largest, 4 * kMiB);
  const uint64_t device_pool_largest = largest;
  const int64_t a = UsePrivate(1, 0);
  void* pa = PoolAlloc(a, device_pool_largest + 64 * kMiB);
  vmm_block_free(pa);
  ASSERT_EQ(vmm_device_largest_free_block(0, &largest), 0);
  EXPECT_GE(largest, device_pool_largest + 64 * kMiB);
  EXPECT_EQ(vmm_device_largest_free_block(0, nullptr), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
}

TEST_F(CApiTest, SnapshotEntriesAreTheJsonSnapshotsSegmentsTaggedByPool) {
  void* d = vmm_alloc(3 * kMiB, 0, nullptr);
  void* d_small = vmm_alloc(1000, 0, nullptr);
  const int64_t explicit_pool = vmm_pool_create(VMM_BACKEND_HOST, 0, "reserve_size=256M");
  ASSERT_GT(explicit_pool, 0) << vmm_last_error();
  void* e = PoolAlloc(explicit_pool, 2 * kMiB);
  const int64_t private_pool = UsePrivate(0, 7);
  void* p1 = PoolAlloc(private_pool, 4 * kMiB);
  void* p2 = PoolAlloc(private_pool, 4 * kMiB);
  void* p_small = PoolAlloc(private_pool, 4096);
  ASSERT_EQ(vmm_free(p1, -1), 0);  // a free block in the private pool's segment

  const Json doc = TakeJson(vmm_snapshot_json());
  vmm_snapshot_entries* snap = nullptr;
  ASSERT_EQ(vmm_snapshot_get(&snap), 0) << vmm_last_error();
  ASSERT_NE(snap, nullptr);
  const Json& segments = doc.at("segments");
  ASSERT_EQ(snap->num_segments, segments.size());
  std::set<int64_t> pools_seen;
  for (size_t i = 0; i < snap->num_segments; ++i) {
    const vmm_segment_entry& s = snap->segments[i];
    const Json& j = segments[i];
    EXPECT_EQ(s.device, j.at("device").get<int>());
    EXPECT_EQ(s.pool, j.at("vmm_pool").get<int64_t>());
    EXPECT_EQ(s.address, j.at("address").get<uint64_t>());
    EXPECT_EQ(s.total_size, j.at("total_size").get<uint64_t>());
    EXPECT_EQ(s.allocated_size, j.at("allocated_size").get<uint64_t>());
    EXPECT_EQ(s.active_size, j.at("active_size").get<uint64_t>());
    EXPECT_EQ(s.requested_size, j.at("requested_size").get<uint64_t>());
    EXPECT_EQ(s.stream, j.at("stream").get<uint64_t>());
    EXPECT_EQ(s.is_large != 0, j.at("segment_type") == "large");
    if (s.pool == private_pool) {
      EXPECT_EQ(j.at("segment_pool_id"), Json::array({0, 7}));
    } else {
      EXPECT_EQ(j.at("segment_pool_id"), Json::array({0, 0}));
    }
    pools_seen.insert(s.pool);
    const Json& blocks = j.at("blocks");
    ASSERT_EQ(s.num_blocks, blocks.size());
    uint64_t at = s.address;
    for (size_t k = 0; k < s.num_blocks; ++k) {
      const vmm_block_entry& b = s.blocks[k];
      const Json& jb = blocks[k];
      EXPECT_EQ(b.address, at) << "blocks tile the segment in address order";
      at += b.size;
      EXPECT_EQ(b.address, jb.at("address").get<uint64_t>());
      EXPECT_EQ(b.size, jb.at("size").get<uint64_t>());
      EXPECT_EQ(b.requested_size, jb.at("requested_size").get<uint64_t>());
      const char* state = b.state == VMM_BLOCK_ACTIVE_ALLOCATED      ? "active_allocated"
                          : b.state == VMM_BLOCK_ACTIVE_PENDING_FREE ? "active_pending_free"
                          : b.state == VMM_BLOCK_INACTIVE            ? "inactive"
                                                                     : "?";
      EXPECT_EQ(jb.at("state"), state);
    }
    EXPECT_EQ(at, s.address + s.total_size);
  }
  EXPECT_EQ(pools_seen, (std::set<int64_t>{0, explicit_pool, private_pool}));
  // The private pool's blocks, where its entries say.
  int private_live = 0, private_free = 0;
  for (size_t i = 0; i < snap->num_segments; ++i) {
    const vmm_segment_entry& s = snap->segments[i];
    if (s.pool != private_pool) {
      EXPECT_EQ(s.mempool_id[0] | s.mempool_id[1], 0u) << "not a private pool";
      continue;
    }
    EXPECT_EQ(s.mempool_id[1], 7u) << "the private pool's MempoolId";
    for (size_t k = 0; k < s.num_blocks; ++k) {
      const vmm_block_entry& b = s.blocks[k];
      if (b.state == VMM_BLOCK_ACTIVE_ALLOCATED) {
        ++private_live;
        EXPECT_TRUE(b.address == reinterpret_cast<uint64_t>(p2) ||
                    b.address == reinterpret_cast<uint64_t>(p_small));
        EXPECT_EQ(s.is_large != 0, b.address == reinterpret_cast<uint64_t>(p2));
      } else if (b.address == reinterpret_cast<uint64_t>(p1)) {
        ++private_free;
        EXPECT_EQ(b.requested_size, 0u);
      }
    }
  }
  EXPECT_EQ(private_live, 2);
  EXPECT_EQ(private_free, 1);
  vmm_snapshot_entries_release(snap);
  vmm_snapshot_entries_release(nullptr);
  EXPECT_EQ(vmm_snapshot_get(nullptr), -1);

  for (void* p : {d, d_small, e, p2, p_small}) vmm_block_free(p);
  ASSERT_EQ(vmm_pool_destroy(explicit_pool), 0);
  EXPECT_EQ(vmm_private_pool_release(0, 0, 7), 0);
}

TEST_F(CApiTest, PrivatePoolUsesAreCounted) {
  EXPECT_EQ(vmm_private_pool_use_count(0, 1, 0), 0);
  EXPECT_EQ(vmm_private_pool_find(0, 1, 0), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_NOT_FOUND);
  const int64_t id = UsePrivate(1, 0, "release_threshold=0");
  EXPECT_EQ(UsePrivate(1, 0, "this=is ignored"), id) << "options of a later use are ignored";
  EXPECT_EQ(vmm_private_pool_use_count(0, 1, 0), 2);
  EXPECT_EQ(vmm_private_pool_find(0, 1, 0), id);
  // Another MempoolId, or another device, is another pool.
  const int64_t other = UsePrivate(2, 0);
  EXPECT_NE(other, id);
  EXPECT_EQ(vmm_private_pool_use_count(1, 1, 0), 0);
  EXPECT_EQ(vmm_private_pool_find(1, 1, 0), -1);
  // A private pool is closed by its uses only.
  EXPECT_EQ(vmm_pool_destroy(id), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_FAILED_PRECONDITION);
  EXPECT_EQ(vmm_pool_device(id), -1) << "the host backend's pools say -1";
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 1);
  EXPECT_EQ(vmm_private_pool_find(0, 1, 0), id);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  EXPECT_EQ(vmm_private_pool_use_count(0, 1, 0), 0);
  EXPECT_EQ(vmm_private_pool_find(0, 1, 0), -1);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_NOT_FOUND);
  EXPECT_EQ(vmm_pool_alloc(id, kMiB, nullptr, 0), nullptr) << "closed";
  // A use after closing makes a fresh pool.
  const int64_t fresh = UsePrivate(1, 0);
  EXPECT_NE(fresh, id);
  EXPECT_EQ(vmm_private_pool_use_count(0, 1, 0), 1);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  EXPECT_EQ(vmm_private_pool_release(0, 2, 0), 0);
  // Bad arguments.
  EXPECT_EQ(vmm_private_pool_use(VMM_BACKEND_HOST, -1, 1, 0, nullptr), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_private_pool_use(VMM_BACKEND_HOST, 0, 1, 0, "no_such_option=1"), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_private_pool_use(17, 0, 1, 0, nullptr), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_private_pool_use_count(0, 1, 0), 0) << "a failed use adds none";
}

TEST_F(CApiTest, APrivatePoolInUseKeepsItsMemoryThroughEmptyCache) {
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  const size_t free_at_start = HostFree();
  const int64_t id = UsePrivate(1, 0, "release_threshold=0");
  void* a = PoolAlloc(id, 8 * kMiB);
  void* b = PoolAlloc(id, 1000);
  vmm_block_free(a);
  ASSERT_EQ(vmm_free(b, 0), 0);
  const int64_t reserved = PoolStats(id).reserved_bytes[VMM_STAT_ALL].current;
  EXPECT_EQ(reserved, static_cast<int64_t>(10 * kMiB)) << "8 MiB, and a small chunk";
  ASSERT_EQ(vmm_empty_cache(0), 0);
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  ASSERT_EQ(vmm_pool_empty_cache(id), 0);
  vmm_torch_stats s = PoolStats(id);
  EXPECT_EQ(s.reserved_bytes[VMM_STAT_ALL].current, reserved);
  EXPECT_EQ(s.num_device_free, 0);
  EXPECT_EQ(HostFree(), free_at_start - static_cast<size_t>(reserved));
  // A second use, released, changes nothing.
  EXPECT_EQ(UsePrivate(1, 0), id);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 1);
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  EXPECT_EQ(HostFree(), free_at_start - static_cast<size_t>(reserved));
  // The last release gives everything back at once (no block is live).
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  EXPECT_EQ(HostFree(), free_at_start);
}

TEST_F(CApiTest, APrivatePoolsBlocksNeverComeFromOrGoToTheDevicePool) {
  void* warm = vmm_alloc(8 * kMiB, 0, nullptr);  // the device pool has cached memory...
  ASSERT_NE(warm, nullptr) << vmm_last_error();
  ASSERT_EQ(vmm_free(warm, 0), 0);
  const int64_t id = UsePrivate(1, 0);
  const auto [base, size] = ReservedRange(id);
  const auto [device_base, device_size] = ReservedRange(0);
  ASSERT_GT(size, 0u);
  auto in_private = [&, base = base, size = size](const void* p) {
    const auto a = reinterpret_cast<uint64_t>(p);
    return a >= base && a < base + size;
  };
  // Device 0's allocations outside the private pool.
  auto device_allocations = [&] {
    return DeviceStats(0).allocation[VMM_STAT_ALL].current -
           PoolStats(id).allocation[VMM_STAT_ALL].current;
  };
  const int64_t device_allocations_before = device_allocations();
  std::vector<void*> blocks;
  for (size_t n : {size_t{512}, 4 * kMiB, 8 * kMiB, 3 * kMiB}) {  // ...which fits each of them
    blocks.push_back(PoolAlloc(id, n));
    EXPECT_TRUE(in_private(blocks.back()));
    EXPECT_EQ(vmm_owns(blocks.back()), 1);
  }
  EXPECT_EQ(device_allocations(), device_allocations_before)
      << "the device pool handed out nothing";
  EXPECT_EQ(LiveBlocks(id).size(), blocks.size());
  // Freed by either free function, back into the private pool: the device pool gets none of
  // it, and the private pool reuses it.
  ASSERT_EQ(vmm_free(blocks[1], 0), 0);
  vmm_block_free(blocks[2]);
  void* from_device = vmm_alloc(8 * kMiB, 0, nullptr);
  ASSERT_NE(from_device, nullptr);
  EXPECT_FALSE(in_private(from_device));
  EXPECT_GE(reinterpret_cast<uint64_t>(from_device), device_base);
  EXPECT_LT(reinterpret_cast<uint64_t>(from_device), device_base + device_size);
  const int64_t growths = PoolStats(id).num_device_alloc;
  void* again = PoolAlloc(id, 8 * kMiB);
  EXPECT_TRUE(in_private(again));
  EXPECT_EQ(again, blocks[1]) << "the two freed blocks coalesced";
  EXPECT_EQ(PoolStats(id).num_device_alloc, growths);
  for (void* p : {blocks[0], blocks[3], again}) vmm_block_free(p);
  ASSERT_EQ(vmm_free(from_device, 0), 0);
  EXPECT_TRUE(LiveBlocks(id).empty());
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
}

TEST_F(CApiTest, LiveBlocksListExactlyTheLiveBlocks) {
  const int64_t id = UsePrivate(1, 0);
  void* a = PoolAlloc(id, 3 * kMiB);
  void* b = PoolAlloc(id, 2 * kMiB + 100);
  void* c = PoolAlloc(id, 700);
  void* d = PoolAlloc(id, 5 * kMiB);
  vmm_block_free(b);
  std::vector<vmm_block_entry> live = LiveBlocks(id);
  ASSERT_EQ(live.size(), 3u);
  // Address order: the small arena lies below the large one.
  EXPECT_EQ(live[0].address, reinterpret_cast<uint64_t>(c));
  EXPECT_EQ(live[0].size, 1024u);
  EXPECT_EQ(live[0].requested_size, 700u);
  EXPECT_EQ(live[1].address, reinterpret_cast<uint64_t>(a));
  EXPECT_EQ(live[1].size, 3 * kMiB);
  EXPECT_EQ(live[2].address, reinterpret_cast<uint64_t>(d));
  EXPECT_EQ(live[2].requested_size, 5 * kMiB);
  for (const vmm_block_entry& e : live) {
    EXPECT_EQ(e.state, VMM_BLOCK_ACTIVE_ALLOCATED);
    EXPECT_EQ(e.stream, 0u);
  }
  // A buffer too small is filled as far as it goes; the count is the whole.
  vmm_block_entry one[1] = {};
  EXPECT_EQ(vmm_pool_live_blocks(id, one, 1), 3);
  EXPECT_EQ(one[0].address, reinterpret_cast<uint64_t>(c));
  EXPECT_EQ(vmm_pool_live_blocks(id, nullptr, 1), -1);
  EXPECT_EQ(vmm_pool_live_blocks(123456789, nullptr, 0), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  for (void* p : {a, c, d}) vmm_block_free(p);
  EXPECT_TRUE(LiveBlocks(id).empty());
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
}

TEST_F(CApiTest, AllocAtRestoresAFreedBlockAndRefusesAnythingElse) {
  const int64_t id = UsePrivate(1, 0);
  void* a = PoolAlloc(id, 4 * kMiB);
  void* b = PoolAlloc(id, 4 * kMiB);
  const auto at = reinterpret_cast<uint64_t>(a);
  ASSERT_EQ(reinterpret_cast<uint64_t>(b), at + 4 * kMiB) << "exact growth, one after another";
  vmm_block_free(a);
  EXPECT_EQ(LiveBlocks(id).size(), 1u);
  void* restored = vmm_pool_alloc_at(id, at, 4 * kMiB, nullptr);
  ASSERT_EQ(restored, a) << vmm_last_error();
  std::vector<vmm_block_entry> live = LiveBlocks(id);
  ASSERT_EQ(live.size(), 2u);
  EXPECT_EQ(live[0].address, at);
  EXPECT_EQ(live[0].size, 4 * kMiB);
  EXPECT_EQ(live[0].requested_size, 4 * kMiB);
  // An allocated range, one partly allocated, and one the pool has not mapped.
  for (auto [addr, size] : {std::pair{at + 4 * kMiB, 4 * kMiB}, std::pair{at + 2 * kMiB, 4 * kMiB},
                            std::pair{at + 64 * kMiB, 4 * kMiB}}) {
    EXPECT_EQ(vmm_pool_alloc_at(id, addr, size, nullptr), nullptr);
    EXPECT_EQ(vmm_last_error_code(), VMM_FAILED_PRECONDITION) << vmm_last_error();
  }
  // Misaligned, empty, or outside the pool.
  vmm_block_free(restored);
  for (auto [addr, size] : {std::pair{at + 1, 4 * kMiB}, std::pair{at, 4 * kMiB + 3},
                            std::pair{at, size_t{0}}, std::pair{uint64_t{4096}, 4 * kMiB}}) {
    EXPECT_EQ(vmm_pool_alloc_at(id, addr, size, nullptr), nullptr);
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT) << vmm_last_error();
  }
  EXPECT_EQ(vmm_pool_alloc_at(987654321, at, 4 * kMiB, nullptr), nullptr);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(LiveBlocks(id).size(), 1u) << "failed calls allocate nothing";
  // Part of the freed block, freed as any block.
  void* part = vmm_pool_alloc_at(id, at + kMiB, 2 * kMiB, nullptr);
  ASSERT_EQ(reinterpret_cast<uint64_t>(part), at + kMiB) << vmm_last_error();
  ASSERT_EQ(vmm_free(part, 0), 0);
  vmm_block_free(b);
  EXPECT_TRUE(LiveBlocks(id).empty());
  EXPECT_EQ(PoolStats(id).allocation[VMM_STAT_ALL].current, 0);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
}

TEST_F(CApiTest, AClosedPrivatePoolIsDestroyedWithItsLastBlock) {
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  const size_t free_at_start = HostFree();
  const int64_t id = UsePrivate(1, 0);
  void* a = PoolAlloc(id, 4 * kMiB);
  void* b = PoolAlloc(id, 4 * kMiB);  // a chunk of its own (exact growth)
  vmm_block_free(b);
  EXPECT_EQ(HostFree(), free_at_start - 8 * kMiB);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  EXPECT_EQ(HostFree(), free_at_start - 4 * kMiB) << "the cached chunk goes at once";
  EXPECT_EQ(vmm_private_pool_find(0, 1, 0), -1);
  EXPECT_EQ(vmm_owns(a), 1) << "a still lives in the closed pool";
  bool in_snapshot = false;
  const Json before = TakeJson(vmm_snapshot_json());
  for (const Json& p : before.at("vmm_pools")) in_snapshot |= p.at("pool").get<int64_t>() == id;
  EXPECT_TRUE(in_snapshot);
  ASSERT_EQ(vmm_free(a, -1), 0);
  EXPECT_EQ(vmm_owns(a), 0) << "destroyed with its last block";
  EXPECT_EQ(HostFree(), free_at_start) << "physical memory leaked";
  const Json after = TakeJson(vmm_snapshot_json());
  for (const Json& p : after.at("vmm_pools")) EXPECT_NE(p.at("pool").get<int64_t>(), id);
}

TEST_F(CApiTest, APrivatePoolsBlocksAreExportedAndSentAsAnExplicitPools) {
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  const size_t free_at_start = HostFree();
  const int64_t id = UsePrivate(1, 0, "handle_type=posix_fd");
  ASSERT_EQ(vmm_pool_handle_type(id), VMM_HANDLE_POSIX_FD);
  auto* block = static_cast<uint8_t*>(PoolAlloc(id, 4 * kMiB, /*shareable=*/1));
  std::memset(block, 0x3c, 4 * kMiB);
  EXPECT_EQ(vmm_send_kind(block), VMM_SEND_IN_PLACE);
  uint8_t* descriptor = nullptr;
  size_t len = 0;
  ASSERT_EQ(vmm_export(block, &descriptor, &len), 0) << vmm_last_error();
  const int64_t import = vmm_import(descriptor, len, -1, VMM_BACKEND_DEFAULT, 0);
  vmm_release_buffer(descriptor);
  ASSERT_GT(import, 0) << vmm_last_error();
  uint64_t ptr = 0;
  size_t size = 0;
  int device = 0;
  ASSERT_EQ(vmm_import_info(import, &ptr, &size, &device), 0);
  EXPECT_EQ(size, 4 * kMiB);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(ptr)[4 * kMiB - 1], 0x3c);
  vmm_import_release(reinterpret_cast<void*>(import));
  // A block sharing its chunk is sent in place (pool option isolate_sends moves it instead);
  // a block allocated beside it lands in the same private pool.
  void* small = PoolAlloc(id, 4096);
  EXPECT_EQ(vmm_send_kind(small), VMM_SEND_IN_PLACE);
  void* beside = vmm_alloc_beside(small, 4096, nullptr);
  ASSERT_NE(beside, nullptr) << vmm_last_error();
  const auto [base, range] = ReservedRange(id);
  EXPECT_GE(reinterpret_cast<uint64_t>(beside), base);
  EXPECT_LT(reinterpret_cast<uint64_t>(beside), base + range);
  EXPECT_EQ(LiveBlocks(id).size(), 3u);
  for (void* p : {static_cast<void*>(block), small, beside}) vmm_block_free(p);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  vmm_send_ack_flush(10);  // the import's mapping is closed on another thread
  EXPECT_EQ(HostFree(), free_at_start) << "physical memory leaked";
}

// What the plugin's setNoSplit does to a MemPool's private pool (vmm_pool_set_no_split): each
// block begins a snapshot segment of its own that it fills (allocated whole), freed blocks
// serve the same sizes again without a driver call, also while a MemPool context holds a
// capture window open, and the pool's last release gives everything back. Refused once the
// pool holds memory, and for a pool that is not open.
TEST_F(CApiTest, ANoSplitPrivatePoolGivesEachBlockASegmentOfItsOwn) {
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  const size_t free_at_start = HostFree();
  const int64_t id = UsePrivate(1, 0);
  ASSERT_EQ(vmm_pool_set_no_split(id), 0) << vmm_last_error();
  const size_t sizes[] = {512, 1000, 4096, 100000, kMiB, kMiB + 4, 3 * kMiB, 24 * kMiB};
  std::vector<void*> blocks;
  std::vector<size_t> block_sizes;
  for (int round = 0; round < 2; ++round) {
    for (size_t size : sizes) {
      blocks.push_back(PoolAlloc(id, size));
      block_sizes.push_back(size);
    }
  }
  auto check_segments = [&](const char* when) {
    vmm_snapshot_entries* snap = nullptr;
    ASSERT_EQ(vmm_snapshot_get(&snap), 0) << vmm_last_error();
    std::map<uint64_t, const vmm_segment_entry*> segments;  // of the pool, by address
    for (size_t i = 0; i < snap->num_segments; ++i) {
      if (snap->segments[i].pool == id) segments[snap->segments[i].address] = &snap->segments[i];
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto s = segments.find(reinterpret_cast<uint64_t>(blocks[i]));
      ASSERT_NE(s, segments.end()) << when << ": block " << i << " begins no segment";
      const vmm_segment_entry& seg = *s->second;
      EXPECT_EQ(seg.num_blocks, 1u) << when;
      EXPECT_EQ(seg.allocated_size, seg.total_size) << when << ": handed out whole";
      EXPECT_EQ(seg.requested_size, block_sizes[i]) << when;
      EXPECT_EQ(seg.total_size % (2 * kMiB), 0u) << when;
    }
    vmm_snapshot_entries_release(snap);
  };
  check_segments("made");
  const int64_t creates = PoolStats(id).num_device_alloc;
  EXPECT_EQ(creates, static_cast<int64_t>(blocks.size())) << "a chunk each";
  for (size_t i = 0; i < blocks.size(); i += 2) vmm_block_free(blocks[i]);
  ASSERT_EQ(vmm_imports_hold_closing(), 0);  // what a MemPool context does
  for (int again = 0; again < 3; ++again) {
    for (size_t i = 0; i < blocks.size(); i += 2) blocks[i] = PoolAlloc(id, block_sizes[i]);
    check_segments("made again");
    if (again < 2) {
      for (size_t i = 0; i < blocks.size(); i += 2) vmm_block_free(blocks[i]);
    }
  }
  ASSERT_EQ(vmm_imports_release_closing(), 0);
  EXPECT_EQ(PoolStats(id).num_device_alloc, creates) << "freed blocks served the same sizes";
  EXPECT_EQ(vmm_pool_set_no_split(id), -1) << "the pool holds memory";
  EXPECT_EQ(vmm_last_error_code(), VMM_FAILED_PRECONDITION);
  for (void* p : blocks) vmm_block_free(p);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  EXPECT_EQ(vmm_pool_set_no_split(id), -1) << "a pool that is gone";
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  EXPECT_EQ(HostFree(), free_at_start) << "physical memory leaked";
}

// What the plugin calls around a graph capture opens a capture window (capture_window.h) and
// pauses the closing thread; holds nest.
TEST_F(CApiTest, HoldingClosesOpensACaptureWindow) {
  EXPECT_FALSE(vmm::CaptureWindowOpen());
  ASSERT_EQ(vmm_imports_hold_closing(), 0);
  ASSERT_EQ(vmm_imports_hold_closing(), 0);
  EXPECT_TRUE(vmm::CaptureWindowOpen());
  ASSERT_EQ(vmm_imports_release_closing(), 0);
  EXPECT_TRUE(vmm::CaptureWindowOpen()) << "one hold is left";
  ASSERT_EQ(vmm_imports_release_closing(), 0);
  EXPECT_FALSE(vmm::CaptureWindowOpen());
}

// A graph deleted during another graph's capture, its pool's last block freed then: nothing
// of the pool is synchronised, unmapped or released until the capture is over (its cached
// chunk stays through the release's empty_cache too), and then all of it goes.
TEST_F(CApiTest, APrivatePoolWhoseLastUseEndsDuringACaptureGoesAfterIt) {
  ASSERT_EQ(vmm_empty_cache(-1), 0);
  const size_t free_at_start = HostFree();
  const int64_t id = UsePrivate(1, 0);
  void* a = PoolAlloc(id, 4 * kMiB);
  void* b = PoolAlloc(id, 4 * kMiB);
  vmm_block_free(b);  // cached in the pool
  ASSERT_EQ(vmm_imports_hold_closing(), 0);  // the other capture begins
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
  ASSERT_EQ(vmm_free(a, -1), 0);  // the pool's last block
  EXPECT_EQ(vmm_owns(a), 0) << "the pool is closed";
  EXPECT_EQ(vmm_private_pool_find(0, 1, 0), -1);
  EXPECT_EQ(HostFree(), free_at_start - 8 * kMiB) << "memory released during the capture";
  ASSERT_EQ(vmm_imports_release_closing(), 0);  // destroyed here
  EXPECT_EQ(HostFree(), free_at_start) << "physical memory leaked";
}

// A large import (closed on the caller's thread otherwise) released during a capture is
// closed once the capture is over: closing synchronises the devices and unmaps.
TEST_F(CApiTest, ALargeImportReleasedDuringACaptureClosesAfterIt) {
  const int64_t pool = vmm_pool_create(VMM_BACKEND_HOST, 0, "reserve_size=256M");
  ASSERT_GT(pool, 0) << vmm_last_error();
  void* p = PoolAlloc(pool, 32 * kMiB);
  uint8_t* descriptor = nullptr;
  size_t len = 0;
  ASSERT_EQ(vmm_export(p, &descriptor, &len), 0) << vmm_last_error();
  const int64_t import = vmm_import(descriptor, len, -1, VMM_BACKEND_HOST, 0);
  vmm_release_buffer(descriptor);
  ASSERT_GT(import, 0) << vmm_last_error();
  const size_t open = vmm::OpenImportMappings();
  ASSERT_EQ(vmm_imports_hold_closing(), 0);
  vmm_import_release(reinterpret_cast<void*>(import));
  EXPECT_EQ(vmm::OpenImportMappings(), open) << "closed during the capture";
  ASSERT_EQ(vmm_imports_release_closing(), 0);
  vmm_send_ack_flush(10);  // closed on the closing thread
  EXPECT_EQ(vmm::OpenImportMappings(), open - 1);
  vmm_block_free(p);
  ASSERT_EQ(vmm_pool_destroy(pool), 0) << vmm_last_error();
}

// The fraction caps the device pool; it leaves the pool's own memory_limit option alone.
TEST_F(CApiTest, AMemoryFractionCapsTheDevicePool) {
  const size_t total = vmm::GetHostDriver()->GetMemInfo(0)->total;
  ASSERT_EQ(vmm_set_memory_fraction(static_cast<double>(32 * kMiB) / total, 0), 0)
      << vmm_last_error();
  void* p = vmm_alloc(64 * kMiB, 0, nullptr);
  const int code = vmm_last_error_code();
  if (p != nullptr) vmm_free(p, 0);
  ASSERT_EQ(vmm_set_memory_fraction(1.0, 0), 0);
  EXPECT_EQ(p, nullptr) << "64 MiB in the device pool under a 32 MiB fraction";
  EXPECT_EQ(code, VMM_RESOURCE_EXHAUSTED);
  void* q = vmm_alloc(64 * kMiB, 0, nullptr);
  EXPECT_NE(q, nullptr) << vmm_last_error();
  if (q != nullptr) vmm_free(q, 0);
}

// A fraction of 0, which PyTorch accepts: nothing more is mapped on the GPU, while what the
// device pool has cached still serves; out of range (below 0, past 1, NaN) is refused.
TEST_F(CApiTest, AMemoryFractionOfZeroLetsOnlyCachedMemoryServe) {
  ASSERT_EQ(vmm_empty_cache(0), 0) << "nothing cached but what this test frees";
  void* cached = vmm_alloc(8 * kMiB, 0, nullptr);
  ASSERT_NE(cached, nullptr) << vmm_last_error();
  vmm_free(cached, 0);
  ASSERT_EQ(vmm_set_memory_fraction(0.0, 0), 0) << vmm_last_error();
  void* again = vmm_alloc(8 * kMiB, 0, nullptr);
  EXPECT_NE(again, nullptr) << "a cached block under a fraction of 0: " << vmm_last_error();
  void* more = vmm_alloc(64 * kMiB, 0, nullptr);
  const int code = vmm_last_error_code();
  if (more != nullptr) vmm_free(more, 0);
  if (again != nullptr) vmm_free(again, 0);
  for (double bad : {-0.01, 1.01, std::nan("")}) {
    EXPECT_EQ(vmm_set_memory_fraction(bad, 0), -1) << bad;
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT) << bad;
  }
  ASSERT_EQ(vmm_set_memory_fraction(1.0, 0), 0);
  EXPECT_EQ(more, nullptr) << "64 MiB mapped under a fraction of 0";
  EXPECT_EQ(code, VMM_RESOURCE_EXHAUSTED);
}

// PyTorch's set_per_process_memory_fraction caps everything its allocator holds on the device,
// CUDA graph pools and MemPools included: the device pool and the private pools share one cap.
TEST_F(CApiTest, AMemoryFractionAlsoCapsTheDevicesPrivatePools) {
  const size_t total = vmm::GetHostDriver()->GetMemInfo(0)->total;
  ASSERT_EQ(vmm_set_memory_fraction(static_cast<double>(32 * kMiB) / total, 0), 0)
      << vmm_last_error();
  const int64_t id = UsePrivate(1, 0);
  void* p = vmm_pool_alloc(id, 64 * kMiB, nullptr, 0);
  const int code = vmm_last_error_code();
  if (p != nullptr) vmm_block_free(p);
  ASSERT_EQ(vmm_set_memory_fraction(1.0, 0), 0);
  EXPECT_EQ(p, nullptr) << "64 MiB in a private pool under a 32 MiB fraction";
  EXPECT_EQ(code, VMM_RESOURCE_EXHAUSTED);
  void* q = vmm_pool_alloc(id, 64 * kMiB, nullptr, 0);  // the whole device again
  EXPECT_NE(q, nullptr) << vmm_last_error();
  if (q != nullptr) vmm_block_free(q);
  EXPECT_EQ(vmm_private_pool_release(0, 1, 0), 0);
}

// Another allocator's segments (a MemPool over a CUDAPluggableAllocator) count against the
// fraction with vmm's pools, both ways: what they hold caps vmm's growth, and what vmm's pools
// hold caps them.
TEST_F(CApiTest, AnotherAllocatorsSegmentsShareTheMemoryFraction) {
  const size_t total = vmm::GetHostDriver()->GetMemInfo(0)->total;
  ASSERT_EQ(vmm_empty_cache(0), 0) << "the device pool holds nothing cached";
  EXPECT_EQ(vmm_device_hold(-1, 1), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  ASSERT_EQ(vmm_device_hold(0, 48 * kMiB), 0) << "no fraction set: nothing is refused";
  ASSERT_EQ(vmm_set_memory_fraction(static_cast<double>(64 * kMiB) / total, 0), 0)
      << vmm_last_error();
  EXPECT_EQ(vmm_device_hold(0, 32 * kMiB), -1) << "48 + 32 MiB over 64";
  EXPECT_EQ(vmm_last_error_code(), VMM_RESOURCE_EXHAUSTED);
  EXPECT_NE(std::string(vmm_last_error()).find("memory fraction"), std::string::npos)
      << vmm_last_error();
  void* p = vmm_alloc(32 * kMiB, 0, nullptr);
  EXPECT_EQ(p, nullptr) << "the device pool grows past the fraction with the 48 MiB held";
  if (p != nullptr) vmm_free(p, 0);
  ASSERT_EQ(vmm_device_hold(0, -48 * static_cast<int64_t>(kMiB)), 0);
  void* q = vmm_alloc(32 * kMiB, 0, nullptr);
  ASSERT_NE(q, nullptr) << vmm_last_error();
  EXPECT_EQ(vmm_device_hold(0, 48 * kMiB), -1)
      << "32 MiB in the device pool + 48 MiB held over 64";
  EXPECT_EQ(vmm_last_error_code(), VMM_RESOURCE_EXHAUSTED);
  EXPECT_EQ(vmm_device_hold(0, 16 * kMiB), 0) << "what still fits is counted";
  vmm_free(q, 0);
  EXPECT_EQ(vmm_device_hold(0, -32 * static_cast<int64_t>(kMiB)), -1)
      << "more than the 16 MiB held given back";
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_device_hold(0, INT64_MIN), -1);
  EXPECT_EQ(vmm_device_hold(0, -16 * static_cast<int64_t>(kMiB)), 0);
  ASSERT_EQ(vmm_set_memory_fraction(1.0, 0), 0);
}

// Another allocator's holds are counted in 64 bits beside the pools' bytes: a hold that no GPU
// could have (the counts would wrap) is refused, and the count stays as it was.
TEST_F(CApiTest, AHoldNoGpuCouldHaveIsRefused) {
  EXPECT_EQ(vmm_device_hold(0, INT64_MAX), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("more than any GPU has"), std::string::npos)
      << vmm_last_error();
  EXPECT_EQ(vmm_device_hold(0, -1), -1) << "nothing was counted";
  ASSERT_EQ(vmm_device_hold(0, kMiB), 0) << vmm_last_error();
  EXPECT_EQ(vmm_device_hold(0, INT64_MAX - 1), -1) << "the sum would wrap";
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_device_hold(0, -static_cast<int64_t>(kMiB)), 0) << vmm_last_error();
}

// What sets a GPU's figures or limit for later (another allocator's segments and blocks, a
// memory fraction) is refused for a device number the driver lacks, below the library's own
// bound of 64 too: such a count or fraction applied to no GPU, and a fraction there capped
// nothing (a hold of 1 GiB past a fraction of 0 was taken).
TEST_F(CApiTest, FiguresAndFractionsOfADeviceTheDriverLacksAreRefused) {
  const int count = vmm::GetHostDriver()->DeviceCount();
  for (int dev : {count, count + 1, 63}) {
    SCOPED_TRACE(dev);
    EXPECT_EQ(vmm_set_memory_fraction(0.0, dev), -1);
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
    EXPECT_EQ(vmm_device_hold(dev, int64_t{1} << 30), -1);
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
    EXPECT_EQ(vmm_device_hold_allocated(dev, 10), -1);
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
    int64_t allocated = -1, reserved = -1;
    ASSERT_EQ(vmm_device_usage(dev, &allocated, &reserved), 0);
    EXPECT_EQ(allocated, 0) << "nothing was counted";
    EXPECT_EQ(reserved, 0);
  }
  // Refused again (a refusal is not remembered as a check passed).
  EXPECT_EQ(vmm_device_hold(count, 10), -1);
  EXPECT_EQ(vmm_device_hold_allocated(count, 10), -1);
  // The last device the driver has takes them, again and again.
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(vmm_device_hold(count - 1, 10), 0) << vmm_last_error();
    ASSERT_EQ(vmm_device_hold(count - 1, -10), 0) << vmm_last_error();
  }
  // Emptying the cache of a device there is not is refused too.
  EXPECT_EQ(vmm_empty_cache(count), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_empty_cache(1000), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_empty_cache(count - 1), 0) << vmm_last_error();
}

// Another allocator's blocks counted in the GPU's allocated bytes: their peak is the GPU's
// (the JSON statistics' allocated peak rises, its current does not: the caller adds that);
// a bad device, more given back than was counted and a count no GPU could have are refused
// and change nothing.
TEST_F(CApiTest, AnotherAllocatorsBlocksCountInTheGpusAllocatedPeak) {
  EXPECT_EQ(vmm_device_hold_allocated(-1, 1), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_device_hold_allocated(0, -1), -1) << "nothing was counted";
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(vmm_device_hold_allocated(0, INT64_MAX), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  vmm_reset_peak_stats(0);
  vmm_torch_stats before{};
  ASSERT_EQ(vmm_device_torch_stats(0, &before), 0) << vmm_last_error();
  ASSERT_EQ(vmm_device_hold(0, 8 * kMiB), 0) << vmm_last_error();  // the block's segment
  ASSERT_EQ(vmm_device_hold_allocated(0, 8 * kMiB), 0) << vmm_last_error();
  vmm_torch_stats during{};
  ASSERT_EQ(vmm_device_torch_stats(0, &during), 0) << vmm_last_error();
  EXPECT_EQ(during.allocated_bytes[VMM_STAT_ALL].current,
            before.allocated_bytes[VMM_STAT_ALL].current);
  EXPECT_EQ(during.allocated_bytes[VMM_STAT_ALL].peak,
            before.allocated_bytes[VMM_STAT_ALL].current + static_cast<int64_t>(8 * kMiB));
  int64_t allocated = 0, reserved = 0;
  ASSERT_EQ(vmm_device_usage(0, &allocated, &reserved), 0);
  EXPECT_GE(allocated, static_cast<int64_t>(8 * kMiB)) << "the running figures count them";
  EXPECT_GE(reserved, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(vmm_device_hold_allocated(0, -9 * static_cast<int64_t>(kMiB)), -1);
  EXPECT_EQ(vmm_device_hold_allocated(0, -8 * static_cast<int64_t>(kMiB)), 0)
      << vmm_last_error();
  EXPECT_EQ(vmm_device_hold(0, -8 * static_cast<int64_t>(kMiB)), 0) << vmm_last_error();
}

// A block to send that moves beside one of a closed pool (destroyed, a released MemPool)
// comes from that pool, which then goes with the last of the two.
TEST_F(CApiTest, ABlockBesideOneOfAClosedPoolKeepsThePoolUntilItIsFreed) {
  const int64_t p = vmm_pool_create(VMM_BACKEND_HOST, 0, "handle_type=posix_fd,reserve_size=1G");
  ASSERT_GT(p, 0) << vmm_last_error();
  void* c = PoolAlloc(p, 4096);
  ASSERT_EQ(vmm_pool_destroy(p), 0);  // closed: destroyed with its last block
  const int64_t priv = UsePrivate(2, 0, "handle_type=posix_fd");
  void* q = PoolAlloc(priv, 4096);
  ASSERT_EQ(vmm_private_pool_release(0, 2, 0), 0);  // closed: its last block remains
  for (void* old : {c, q}) {
    void* beside = vmm_alloc_beside(old, 4096, nullptr);
    ASSERT_NE(beside, nullptr) << vmm_last_error();
    vmm_block_free(old);
    EXPECT_EQ(vmm_owns(beside), 1) << "the pool stays for the new block";
    std::memset(beside, 0x5a, 4096);
    vmm_block_free(beside);
    EXPECT_EQ(vmm_owns(beside), 0) << "the pool went with its last block";
    EXPECT_EQ(vmm_alloc_beside(old, 4096, nullptr), nullptr) << "no pool there now";
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  }
}

// The same while the closed pool's last block is freed on another thread: the new block is
// never one of a pool destroyed under it, and a request that comes after the free is refused
// (the address is no pool's). A race of a few instructions: ProcessStateTest's
// ABlockBesideOneOfAPoolThatWentMeanwhileIsRefused forces it.
TEST_F(CApiTest, ABlockBesideIsNeverOneOfAPoolDestroyedMeanwhile) {
  for (int i = 0; i < 2000; ++i) {
    const int64_t p =
        vmm_pool_create(VMM_BACKEND_HOST, 0, "handle_type=posix_fd,reserve_size=64M");
    ASSERT_GT(p, 0) << vmm_last_error();
    void* c = PoolAlloc(p, 4096);
    ASSERT_EQ(vmm_pool_destroy(p), 0);
    void* beside = nullptr;
    std::string error;
    std::thread mover([&] {
      beside = vmm_alloc_beside(c, 4096, nullptr);
      if (beside == nullptr) error = vmm_last_error();
    });
    for (volatile int k = 0; k < (i % 64) * 4; k = k + 1) {
    }
    vmm_block_free(c);
    mover.join();
    if (beside == nullptr) {  // after the free: no pool has that address any more
      EXPECT_NE(error.find("which no vmm pool allocated"), std::string::npos) << error;
      continue;
    }
    ASSERT_EQ(vmm_owns(beside), 1) << "iteration " << i << ": a block of no pool";
    std::memset(beside, 0x5a, 4096);
    vmm_block_free(beside);
  }
}

// Only the start of a live block is vmm's to send, in a pool without handles too.
TEST_F(CApiTest, AnAddressInsideABlockOfAPoolWithoutHandlesIsNotVmms) {
  const int64_t p = vmm_pool_create(VMM_BACKEND_HOST, 0, "handle_type=none,reserve_size=1G");
  ASSERT_GT(p, 0) << vmm_last_error();
  auto* a = static_cast<char*>(PoolAlloc(p, 4096));
  EXPECT_EQ(vmm_send_kind(a), VMM_SEND_NOT_EXPORTABLE);
  EXPECT_EQ(vmm_send_prepare(a), VMM_SEND_NOT_EXPORTABLE);
  EXPECT_EQ(vmm_send_kind(a + 512), VMM_SEND_NOT_VMM) << "inside the block";
  EXPECT_EQ(vmm_send_prepare(a + 512), VMM_SEND_NOT_VMM) << "inside the block";
  EXPECT_EQ(vmm_send_kind(a + 1000000), VMM_SEND_NOT_VMM) << "no block there";
  vmm_block_free(a);
  ASSERT_EQ(vmm_pool_destroy(p), 0);
}

// A block a send holds is freed once, at its acknowledgement: a free before it is deferred,
// and a second free is a double free, refused as one of a block no send holds.
TEST_F(CApiTest, ASecondFreeOfABlockASendHoldsIsADoubleFree) {
  const int64_t p = vmm_pool_create(VMM_BACKEND_HOST, 0, "handle_type=posix_fd,reserve_size=1G");
  ASSERT_GT(p, 0) << vmm_last_error();
  void* b = PoolAlloc(p, 4 * kMiB, /*shareable=*/1);
  uint8_t* out = nullptr;
  size_t len = 0;
  uint8_t ticket[VMM_TICKET_BYTES];
  ASSERT_EQ(vmm_export_send(b, &out, &len, ticket), 0) << vmm_last_error();
  vmm_release_buffer(out);
  ASSERT_EQ(vmm_free(b, -1), 0) << vmm_last_error();
  EXPECT_EQ(vmm_free(b, -1), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("double free"), std::string::npos) << vmm_last_error();
  ASSERT_EQ(vmm_send_ack(ticket, sizeof(ticket)), 0) << vmm_last_error();
  EXPECT_EQ(vmm_free(b, -1), -1) << "freed at the acknowledgement";
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  ASSERT_EQ(vmm_pool_destroy(p), 0) << vmm_last_error();
}

// In a forked child, a block of a pool the parent made reads as in the parent, and its
// export is refused as a precondition (the plugin then sends a copy, as PyTorch sends a CPU
// tensor).
TEST_F(CApiTest, AForkedChildsExportOfItsParentsBlockIsRefused) {
  const int64_t p = vmm_pool_create(VMM_BACKEND_HOST, 0, "handle_type=posix_fd,reserve_size=1G");
  ASSERT_GT(p, 0) << vmm_last_error();
  void* b = PoolAlloc(p, 4 * kMiB, /*shareable=*/1);
  ASSERT_EQ(vmm_send_kind(b), VMM_SEND_IN_PLACE);
  const pid_t child = fork();
  if (child == 0) {
    const int kind = vmm_send_kind(b);
    uint8_t* out = nullptr;
    size_t len = 0;
    uint8_t ticket[VMM_TICKET_BYTES];
    const int sent = vmm_export_send(b, &out, &len, ticket);
    _exit(kind == VMM_SEND_IN_PLACE && sent == -1 &&
                  vmm_last_error_code() == VMM_FAILED_PRECONDITION
              ? 0
              : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  vmm_block_free(b);
  ASSERT_EQ(vmm_pool_destroy(p), 0);
}

// In a forked child, a private pool the parent made reads as in the parent (its uses), so
// that PyTorch's MemPool destructor there (which asserts a use and releases it) works; it
// takes no block there, and a use in the child makes the child's own pool.
TEST_F(CApiTest, AForkedChildSeesItsParentsPrivatePoolButTakesNoBlockThere) {
  const int64_t parents = UsePrivate(0, 7);
  const pid_t child = fork();
  if (child == 0) {
    const bool seen =
        vmm_private_pool_use_count(0, 0, 7) == 1 && vmm_private_pool_find(0, 0, 7) == parents;
    const bool refused = vmm_pool_alloc(parents, 4096, nullptr, 0) == nullptr &&
                         vmm_last_error_code() == VMM_FAILED_PRECONDITION;
    const bool released = vmm_private_pool_release(0, 0, 7) == 0;
    const int64_t own = vmm_private_pool_use(VMM_BACKEND_HOST, 0, 0, 7, nullptr);
    void* block = own > 0 ? vmm_pool_alloc(own, 4096, nullptr, 0) : nullptr;
    _exit(seen && refused && released && own > 0 && own != parents && block != nullptr ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(vmm_private_pool_find(0, 0, 7), parents) << "the parent's, untouched";
  EXPECT_EQ(vmm_private_pool_release(0, 0, 7), 0) << vmm_last_error();
}

// An error names the value it was given: a fraction just past 1, a change of -2^63 bytes.
TEST_F(CApiTest, ErrorsNameTheValueGiven) {
  EXPECT_EQ(vmm_set_memory_fraction(1.0000000000000002, 0), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("1.0000000000000002"), std::string::npos)
      << vmm_last_error();
  EXPECT_EQ(vmm_device_hold(0, INT64_MIN), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("a change of -8192.00 PiB"), std::string::npos)
      << vmm_last_error();
}

// vmm_block_free is a deleter: NULL is nothing to free, as for free().
TEST_F(CApiTest, BlockFreeOfNullIsNothing) {
  ::testing::internal::CaptureStderr();
  vmm_block_free(nullptr);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

// Parts received from another process are hostile: a null handle among them, or more handles
// than a descriptor can count, is an error, never an exception through the C interface.
TEST_F(CApiTest, DescriptorFromHandlesRefusesNullHandlesAndImpossibleCounts) {
  const uint8_t handle[64] = {};
  const uint8_t* handles[2] = {handle, nullptr};
  const size_t lens[2] = {64, 64};
  const int64_t sizes[2] = {2 * kMiB, 2 * kMiB};
  uint8_t* out = nullptr;
  size_t len = 0;
  EXPECT_EQ(vmm_descriptor_from_handles(VMM_HANDLE_FABRIC, handles, lens, sizes, 2, -1, nullptr,
                                        0, &out, &len),
            -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("handle 1 is a null pointer"), std::string::npos)
      << vmm_last_error();
  EXPECT_EQ(vmm_descriptor_from_handles(VMM_HANDLE_FABRIC, handles, lens, sizes, SIZE_MAX, -1,
                                        nullptr, 0, &out, &len),
            -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  // A length past the 64 bytes of a handle would be read past it: refused before the copy.
  const size_t long_lens[1] = {size_t{1} << 40};
  EXPECT_EQ(vmm_descriptor_from_handles(VMM_HANDLE_FABRIC, handles, long_lens, sizes, 1, -1,
                                        nullptr, 0, &out, &len),
            -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("bytes, expected 64"), std::string::npos)
      << vmm_last_error();
  ASSERT_EQ(vmm_descriptor_from_handles(VMM_HANDLE_FABRIC, handles, lens, sizes, 1, -1, nullptr,
                                        0, &out, &len),
            0)
      << vmm_last_error();
  EXPECT_GT(len, 64u);
  vmm_release_buffer(out);
}

// A lease the ledger cannot hold (it rounds to no time at all) is refused, not kept out with
// only a log line while the call reports success.
TEST_F(CApiTest, ASendLeaseThatRoundsToNothingIsRefused) {
  for (double seconds : {1e-12, 0.0, -1.0, 2e9}) {
    EXPECT_EQ(vmm_send_set_lease(seconds), -1) << seconds;
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT) << seconds;
  }
  EXPECT_EQ(vmm_send_set_lease(1e-9), 0) << vmm_last_error();
  EXPECT_EQ(vmm_send_set_lease(600), 0) << vmm_last_error();
}

TEST_F(CApiTest, PoolOptionsAreCheckedWithoutMakingAPool) {
  EXPECT_EQ(vmm_check_pool_options(nullptr), 0) << vmm_last_error();
  EXPECT_EQ(vmm_check_pool_options(""), 0) << vmm_last_error();
  EXPECT_EQ(vmm_check_pool_options("memory_limit=40G,handle_type=posix_fd"), 0)
      << vmm_last_error();
  EXPECT_EQ(vmm_check_pool_options("colour=1"), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vmm_last_error()).find("unknown option 'colour'"), std::string::npos)
      << vmm_last_error();
  EXPECT_EQ(vmm_check_pool_options("memory_limit=lots"), -1);
  EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT);
  // What Pool::Create refuses before it asks the driver anything.
  for (const char* bad : {"max_chunk=0", "large_page=4M,max_chunk=2M", "small_size=0",
                          "pressure_page=8M,max_chunk=4M", "growth_fraction=2"}) {
    EXPECT_EQ(vmm_check_pool_options(bad), -1) << bad;
    EXPECT_EQ(vmm_last_error_code(), VMM_INVALID_ARGUMENT) << bad;
  }
}

// A failure after the thread's thread_local objects are gone (the main thread's are destroyed
// by exit() before its atexit handlers and static destructors, which may still call in: a
// storage a library frees at exit) keeps its code and a fixed message: the record's string,
// written after its destruction, freed its buffer twice.
TEST(CApiExitTest, AFailureAfterTheThreadsRecordsAreDestroyedKeepsItsCode) {
  EXPECT_EXIT(
      {
        // A message longer than the string's inline buffer: the record holds heap memory.
        if (vmm_send_set_lease(-1.0) != -1 || std::strlen(vmm_last_error()) < 32) std::_Exit(4);
        std::atexit([] {
          // The code of the failure before the record went is kept.
          if (vmm_last_error_code() != VMM_INVALID_ARGUMENT) std::_Exit(6);
          const int rc = vmm_send_set_lease(-1.0);
          const bool kept = rc == -1 && vmm_last_error_code() == VMM_INVALID_ARGUMENT &&
                            std::strstr(vmm_last_error(), "destroyed") != nullptr;
          std::_Exit(kept ? 0 : 3);
        });
        std::exit(5);  // the handler exits first
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace

