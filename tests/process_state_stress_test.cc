// Process-wide calls racing with pools being created, used and destroyed, through
// ProcessState (what the C interface and so vmm_torch call): statistics, snapshots and
// empty_cache over every pool, while other threads create explicit pools, allocate, export,
// import, free and close them (the last free destroys a closed pool). On the host backend;
// run under ThreadSanitizer in CI. The finding this guards against: empty_cache or a snapshot
// in one thread while another closed a pool and freed its last block used the pool after it
// was destroyed.
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "allocator/descriptor.h"
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

}  // namespace
}  // namespace vmm
