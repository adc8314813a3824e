// Process-wide calls racing with pools being created, used and destroyed, through
// ProcessState (what the C interface and so vmm_torch call): statistics, snapshots and
// empty_cache over every pool, while other threads create explicit pools, allocate, export,
// import, free and close them (the last free destroys a closed pool). On the host backend;
// run under ThreadSanitizer in CI. The finding this guards against: empty_cache or a snapshot
// in one thread while another closed a pool and freed its last block used the pool after it
// was destroyed.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "allocator/descriptor.h"
#include "allocator/mutex.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "torch_plugin/process_state.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(ProcessStateStressTest, ProcessWideCallsRaceWithPoolsComingAndGoing) {
  ProcessState state;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::atomic<int64_t> cycles{0}, sweeps{0};

  // Sweeps over every pool, as vmm_empty_cache(-1), vmm_snapshot_json and dump_stats do.
  auto sweeper = [&](int kind) {
    while (!stop.load()) {
      for (const ProcessState::PoolRef& p : state.AllPools()) {
        if (kind == 0) {
          if (!p.pool->EmptyCache().ok()) failures.fetch_add(1);
        } else if (kind == 1) {
          (void)p.pool->GetSnapshot();
        } else {
          (void)p.pool->GetStats();
          if (!p.pool->CheckInvariants().ok()) failures.fetch_add(1);
        }
      }
      sweeps.fetch_add(1);
    }
  };

  // Creates a pool, allocates, exports and imports some blocks, closes the pool, then frees
  // the blocks (the last free destroys it), dropping the imports in between.
  auto churner = [&](unsigned seed) {
    std::mt19937 rng(seed);
    while (!stop.load()) {
      absl::StatusOr<int64_t> id =
          state.CreatePool(Backend::kHost, 0, "reserve_size=64M,handle_type=posix_fd");
      if (!id.ok()) {
        failures.fetch_add(1);
        continue;
      }
      std::vector<void*> blocks;
      std::vector<int64_t> imports;
      const int n = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < n; ++i) {
        absl::StatusOr<void*> p = state.PoolAllocate(*id, (1 + rng() % 3) * kMiB, 0, rng() % 2);
        if (!p.ok()) {
          failures.fetch_add(1);
          continue;
        }
        std::memset(*p, i, kMiB);
        blocks.push_back(*p);
        if (rng() % 2 == 0) {
          absl::StatusOr<BufferDescriptor> d = state.Export(*p);
          if (!d.ok()) {
            failures.fetch_add(1);
            continue;
          }
          absl::StatusOr<int64_t> import = state.Import(d->Encode(), -1, std::nullopt, false);
          if (import.ok()) {
            imports.push_back(*import);
          } else {
            failures.fetch_add(1);
          }
        }
      }
      if (!state.ClosePool(*id).ok()) failures.fetch_add(1);
      for (int64_t import : imports) {
        if (!state.AddImportRef(import, -1).ok()) failures.fetch_add(1);
      }
      for (void* p : blocks) {
        if (!state.FreeBlock(p).ok()) failures.fetch_add(1);
      }
      cycles.fetch_add(1);
    }
  };

  std::vector<std::thread> threads;
  for (int kind = 0; kind < 3; ++kind) threads.emplace_back(sweeper, kind);
  for (unsigned seed = 1; seed <= 3; ++seed) threads.emplace_back(churner, seed);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop.store(true);
  for (std::thread& t : threads) t.join();

  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(cycles.load(), 3) << "pools were created and destroyed";
  EXPECT_GT(sweeps.load(), 3);
  EXPECT_TRUE(state.AllPools().empty()) << "every closed pool went with its last block";
  EXPECT_EQ(state.import_count(), 0u);
}

// A GPU's cumulative statistics never fall (PyTorch's do not), while private pools are used,
// grown, released (some with live blocks, freed then by another thread, racing the release's
// EmptyCache) and destroyed in three threads, the device pool churns in a fourth and a fifth
// reads the statistics. A pool destroyed between the reader's
// list of pools and its read of the totals of pools that are gone was counted in neither or
// in both (an exhaustive reader saw 214 to 228 falls in 8 s).
TEST(ProcessStateStressTest, CumulativeStatisticsNeverFallWhilePrivatePoolsComeAndGo) {
  setenv("VMM_BACKEND", "host", 1);  // the device pool on the private pools' backend
  ProcessState state;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::atomic<int64_t> cycles{0}, reads{0}, falls{0};
  Mutex handed_mu;
  std::vector<void*> handed;  // blocks of released pools, for the freeing thread
  std::atomic<bool> pools_done{false};
  auto freer = [&] {
    for (bool last = false; !last;) {
      last = pools_done.load();
      std::vector<void*> blocks;
      {
        MutexLock lock(&handed_mu);
        blocks.swap(handed);
      }
      for (void* b : blocks) {
        if (!state.FreeBlock(b).ok()) failures.fetch_add(1);  // the pool goes with the last
      }
      if (blocks.empty()) std::this_thread::yield();
    }
  };
  auto private_pools = [&](unsigned seed) {
    std::mt19937 rng(seed);
    for (uint64_t n = 0; !stop.load(); ++n) {
      const uint64_t key = 1000 * (seed + 1) + n % 7;
      absl::StatusOr<int64_t> id = state.UsePrivatePool(Backend::kHost, 0, key, 9, "");
      if (!id.ok()) {
        failures.fetch_add(1);
        continue;
      }
      std::vector<void*> blocks;
      for (int i = 0; i < 3; ++i) {
        const size_t size = rng() % 2 ? 4096 : (1 + rng() % 4) * kMiB;
        absl::StatusOr<void*> p = state.PoolAllocate(*id, size, 0, /*shareable=*/false);
        if (p.ok()) {
          blocks.push_back(*p);
        } else {
          failures.fetch_add(1);
        }
      }
      const bool free_first = rng() % 2;
      for (void* b : free_first ? blocks : std::vector<void*>{}) {
        if (!state.FreeBlock(b).ok()) failures.fetch_add(1);
      }
      if (!state.ReleasePrivatePool(0, key, 9).ok()) failures.fetch_add(1);
      if (!free_first) {
        MutexLock lock(&handed_mu);
        handed.insert(handed.end(), blocks.begin(), blocks.end());
      }
      cycles.fetch_add(1);
    }
  };
  auto device_pool = [&] {
    std::mt19937 rng(77);
    while (!stop.load()) {
      absl::StatusOr<void*> p = state.DeviceAllocate(0, (1 + rng() % 8) * kMiB, 0);
      if (!p.ok() || !state.FreeBlock(*p).ok()) failures.fetch_add(1);
    }
  };
  std::string first_fall;
  auto reader = [&] {
    PoolStats last = state.DeviceStats(0);
    while (!stop.load()) {
      const PoolStats now = state.DeviceStats(0);
      reads.fetch_add(1);
      std::string why;
      auto check = [&](const std::string& name, int64_t before, int64_t after) {
        if (after < before) absl::StrAppend(&why, name, " ", before, " -> ", after, "; ");
      };
      // Every statistic's cumulative figures (no reset runs here) and every counter.
      auto check_stat = [&](const std::string& name, const Stat& before, const Stat& after) {
        check(name + ".allocated", before.allocated, after.allocated);
        check(name + ".freed", before.freed, after.freed);
      };
#define VMM_CHECK_STAT(name, key, what) check_stat(key, last.name, now.name);
      VMM_BYTE_STATS(VMM_CHECK_STAT)
      VMM_COUNT_STATS(VMM_CHECK_STAT)
#undef VMM_CHECK_STAT
      for (int a = 0; a < kNumArenas; ++a) {
#define VMM_CHECK_ARENA_STAT(name) \
  check_stat(absl::StrCat("arena ", a, " " #name), last.arena[a].name, now.arena[a].name);
        VMM_TORCH_STATS(VMM_CHECK_ARENA_STAT)
#undef VMM_CHECK_ARENA_STAT
      }
#define VMM_CHECK_COUNTER(name, key, what) check(key, last.name, now.name);
      VMM_COUNTERS(VMM_CHECK_COUNTER)
#undef VMM_CHECK_COUNTER
      if (!why.empty() && falls.fetch_add(1) == 0) first_fall = why;
      last = now;
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 3; ++t) threads.emplace_back(private_pools, t);
  threads.emplace_back(device_pool);
  threads.emplace_back(reader);
  std::thread freeing(freer);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  stop.store(true);
  for (std::thread& t : threads) t.join();
  pools_done.store(true);  // the freeing thread frees what they handed it last, then ends
  freeing.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(cycles.load(), 10);
  EXPECT_GT(reads.load(), 100);
  EXPECT_EQ(falls.load(), 0) << "first: " << first_fall;
  // Every pool gone and the device pool's blocks freed: only its cache is left.
  const PoolStats end = state.DeviceStats(0);
  const ProcessState::Usage usage = state.DeviceUsage(0);  // what the GPU's cap added up
  unsetenv("VMM_BACKEND");
  EXPECT_EQ(usage.allocated, end.allocated_bytes.current);
  EXPECT_EQ(usage.reserved, end.reserved_bytes.current);
  EXPECT_EQ(end.allocated_bytes.current, 0);
  EXPECT_EQ(end.segment.current, state.DevicePoolIfAny(0)->GetStats().segment.current);
}

}  // namespace
}  // namespace vmm
