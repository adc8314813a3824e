// The process-wide statistics of a GPU (ProcessState::DeviceStats, DeviceUsage,
// ResetDeviceAccumulated, ResetDevicePeaks, DeviceCap's joint figures) held to PyTorch's
// memory_stats() semantics while private pools come and go, resets race allocations, frees
// and pools going, bad device numbers are passed and the process forks: totals and peaks
// never fall but at a reset, a reset keeps what came after it, current figures are
// consistent. Host backend. (First written as attacks by a tester; the defects they found
// are fixed.)
#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <atomic>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "allocator/device_cap.h"
#include "allocator/mutex.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/sanitizers.h"
#include "tests/subprocess.h"
#include "torch_plugin/process_state.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr char kSmall[] = "reserve_size=64M";

struct HostEnv {
  HostEnv() { setenv("VMM_BACKEND", "host", 1); }
  ~HostEnv() { unsetenv("VMM_BACKEND"); }
};

// A process state of its own on the host backend, its device pools' ranges 256 MiB.
class ProcessStateStatsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(state_.Configure("reserve_size=256M").ok()); }

  HostEnv env_;
  ProcessState state_;
};

// Every current figure is consistent: allocated <= reserved, counts >= 0, peak >= current.
std::string Inconsistent(const PoolStats& s) {
  std::string why;
  auto stat = [&](const std::string& name, const Stat& st) {
    if (st.current < 0) absl::StrAppend(&why, name, ".current<0 (", st.current, "); ");
    if (st.peak < st.current) {
      absl::StrAppend(&why, name, ".peak ", st.peak, " < current ", st.current, "; ");
    }
  };
#define VMM_CHK(name, key, what) stat(key, s.name);
  VMM_BYTE_STATS(VMM_CHK)
  VMM_COUNT_STATS(VMM_CHK)
#undef VMM_CHK
  if (s.allocated_bytes.current > s.reserved_bytes.current) {
    absl::StrAppend(&why, "allocated ", s.allocated_bytes.current, " > reserved ",
                    s.reserved_bytes.current, "; ");
  }
  return why;
}

// A private pool that goes leaves the GPU's peaks where they were (before, every peak but
// the byte peaks DeviceCap keeps fell with it).
TEST_F(ProcessStateStatsTest, PeaksOfAGonePrivatePoolStayInTheGpusStatistics) {
  void* d = *state_.DeviceAllocate(0, 2 * kMiB, 0);
  absl::StatusOr<int64_t> id = state_.UsePrivatePool(Backend::kHost, 0, 1, 1, kSmall);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<void*> blocks;
  for (int i = 0; i < 10; ++i) blocks.push_back(*state_.PoolAllocate(*id, 2 * kMiB, 0, false));
  for (void* b : blocks) ASSERT_TRUE(state_.FreeBlock(b).ok());
  const PoolStats before = state_.DeviceStats(0);
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 1, 1).ok());
  const PoolStats after = state_.DeviceStats(0);
  std::string fell;
  auto check = [&](const std::string& name, const Stat& b, const Stat& a) {
    if (a.peak < b.peak) absl::StrAppend(&fell, name, ".peak ", b.peak, " -> ", a.peak, "; ");
  };
#define VMM_CHK(name, key, what) check(key, before.name, after.name);
  VMM_BYTE_STATS(VMM_CHK)
  VMM_COUNT_STATS(VMM_CHK)
#undef VMM_CHK
  for (int a = 0; a < kNumArenas; ++a) {
#define VMM_CHK_A(name) check(absl::StrCat(ArenaName(a), ".", #name), before.arena[a].name, \
                              after.arena[a].name);
    VMM_TORCH_STATS(VMM_CHK_A)
#undef VMM_CHK_A
  }
  EXPECT_EQ(fell, "") << "peaks fell with no reset of peaks";
  EXPECT_GE(after.allocation.peak, 11) << "11 blocks were live at once on the GPU";
  ASSERT_TRUE(state_.FreeBlock(d).ok());
}

// After ResetDevicePeaks every peak equals its current value (quiescent), with a device
// pool, an open private pool, a released private pool with a live block, and a gone one.
TEST_F(ProcessStateStatsTest, ResetPeaksMakesEveryPeakCurrent) {
  void* d = *state_.DeviceAllocate(0, 3 * kMiB + 7, 0);
  void* ds = *state_.DeviceAllocate(0, 4096, 0);
  void* big = *state_.DeviceAllocate(0, 16 * kMiB, 0);
  ASSERT_TRUE(state_.FreeBlock(big).ok());
  int64_t a = *state_.UsePrivatePool(Backend::kHost, 0, 2, 1, kSmall);
  int64_t b = *state_.UsePrivatePool(Backend::kHost, 0, 2, 2, kSmall);
  int64_t c = *state_.UsePrivatePool(Backend::kHost, 0, 2, 3, kSmall);
  void* pa = *state_.PoolAllocate(a, 5 * kMiB, 0, false);
  void* pb = *state_.PoolAllocate(b, 6 * kMiB, 0, true);
  void* pb2 = *state_.PoolAllocate(b, 1000, 0, false);
  void* pc = *state_.PoolAllocate(c, 7 * kMiB, 0, false);
  ASSERT_TRUE(state_.FreeBlock(pc).ok());
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 2, 3).ok());  // gone
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 2, 2).ok());  // closed, live blocks
  ASSERT_TRUE(state_.FreeBlock(pb2).ok());
  state_.ResetDevicePeaks(0);
  const PoolStats s = state_.DeviceStats(0);
  std::string bad;
  auto check = [&](const std::string& name, const Stat& st) {
    if (st.peak != st.current) absl::StrAppend(&bad, name, " peak ", st.peak, " current ",
                                               st.current, "; ");
  };
#define VMM_CHK(name, key, what) check(key, s.name);
  VMM_BYTE_STATS(VMM_CHK)
  VMM_COUNT_STATS(VMM_CHK)
#undef VMM_CHK
  for (int ar = 0; ar < kNumArenas; ++ar) {
#define VMM_CHK_A(name) check(absl::StrCat(ArenaName(ar), ".", #name), s.arena[ar].name);
    VMM_TORCH_STATS(VMM_CHK_A)
#undef VMM_CHK_A
  }
  EXPECT_EQ(bad, "");
  EXPECT_EQ(Inconsistent(s), "");
  ProcessState::Usage u = state_.DeviceUsage(0);
  EXPECT_EQ(u.allocated, s.allocated_bytes.current);
  EXPECT_EQ(u.reserved, s.reserved_bytes.current);
  ASSERT_TRUE(state_.FreeBlock(pb).ok());
  ASSERT_TRUE(state_.FreeBlock(pa).ok());
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 2, 1).ok());
  ASSERT_TRUE(state_.FreeBlock(d).ok());
  ASSERT_TRUE(state_.FreeBlock(ds).ok());
  EXPECT_EQ(Inconsistent(state_.DeviceStats(0)), "");
}

// Resets between an allocation and its free, and between a release and the last free:
// afterwards allocated counts only what came after the reset; nothing negative.
TEST_F(ProcessStateStatsTest, ResetsBetweenAllocAndFreeCountOnlyWhatCameAfter) {
  void* d = *state_.DeviceAllocate(0, 2 * kMiB, 0);
  int64_t a = *state_.UsePrivatePool(Backend::kHost, 0, 3, 1, kSmall);
  void* p1 = *state_.PoolAllocate(a, 2 * kMiB, 0, false);
  void* p2 = *state_.PoolAllocate(a, 2 * kMiB, 0, false);
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 3, 1).ok());
  state_.ResetDeviceAccumulated(0);
  PoolStats s = state_.DeviceStats(0);
  EXPECT_EQ(s.allocation.allocated, 0);
  EXPECT_EQ(s.allocation.freed, 0);
  EXPECT_EQ(s.allocation.current, 3);
  EXPECT_EQ(s.num_device_alloc, 0);
  ASSERT_TRUE(state_.FreeBlock(p1).ok());
  state_.ResetDeviceAccumulated(0);
  ASSERT_TRUE(state_.FreeBlock(p2).ok());  // pool goes
  ASSERT_TRUE(state_.FreeBlock(d).ok());
  s = state_.DeviceStats(0);
  EXPECT_EQ(s.allocation.allocated, 0);
  EXPECT_EQ(s.allocation.freed, 2) << "p2 and d were freed after the last reset";
  EXPECT_EQ(s.allocated_bytes.allocated, 0);
  EXPECT_EQ(s.allocated_bytes.freed, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(s.allocation.current, 0);
  EXPECT_EQ(Inconsistent(s), "");
  // A fresh allocation after the resets counts once.
  int64_t b = *state_.UsePrivatePool(Backend::kHost, 0, 3, 2, kSmall);
  void* q = *state_.PoolAllocate(b, kMiB, 0, false);
  ASSERT_TRUE(state_.FreeBlock(q).ok());
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 3, 2).ok());
  s = state_.DeviceStats(0);
  EXPECT_EQ(s.allocation.allocated, 1);
  EXPECT_EQ(s.allocation.freed, 3);
}

// Bad device numbers at every public entry point: errors, no crash, no state touched.
TEST_F(ProcessStateStatsTest, OutOfRangeDevicesAtEveryEntryPoint) {
  void* d = *state_.DeviceAllocate(0, kMiB, 0);
  const PoolStats ref = state_.DeviceStats(0);
  for (int dev : {-1, -2, -1000, INT_MIN, ProcessState::kMaxDevices,
                  ProcessState::kMaxDevices + 1, 1000, INT_MAX}) {
    SCOPED_TRACE(dev);
    EXPECT_FALSE(state_.DevicePool(dev).ok());
    EXPECT_EQ(state_.DevicePoolIfAny(dev), nullptr);
    EXPECT_FALSE(state_.DeviceAllocate(dev, kMiB, 0).ok());
    EXPECT_FALSE(state_.SetMemoryFraction(0.5, dev).ok());
    EXPECT_FALSE(state_.HoldExternal(dev, 100).ok());
    EXPECT_FALSE(state_.HoldExternal(dev, -100).ok());
    EXPECT_FALSE(state_.CountExternalAllocated(dev, 100).ok());
    EXPECT_FALSE(state_.CountExternalAllocated(dev, -100).ok());
    EXPECT_FALSE(state_.CreatePool(Backend::kHost, dev, kSmall).ok());
    EXPECT_FALSE(state_.UsePrivatePool(Backend::kHost, dev, 1, 1, kSmall).ok());
    EXPECT_FALSE(state_.UsePrivatePool(std::nullopt, dev, 1, 1, kSmall).ok());
    EXPECT_FALSE(state_.ReleasePrivatePool(dev, 1, 1).ok());
    EXPECT_EQ(state_.PrivatePoolUses(dev, 1, 1), 0);
    EXPECT_FALSE(state_.FindPrivatePool(dev, 1, 1).ok());
    EXPECT_TRUE(state_.DevicePools(dev).empty());
    PoolStats retired;
    EXPECT_TRUE(state_.DevicePools(dev, &retired).empty());
    const PoolStats s = state_.DeviceStats(dev);
    EXPECT_EQ(s.allocated_bytes.current, 0);
    EXPECT_EQ(s.reserved_bytes.current, 0);
    EXPECT_EQ(s.num_device_alloc, 0);
    const ProcessState::Usage u = state_.DeviceUsage(dev);
    EXPECT_EQ(u.allocated, 0);
    EXPECT_EQ(u.reserved, 0);
    state_.ResetDeviceAccumulated(dev);
    state_.ResetDevicePeaks(dev);
  }
  const PoolStats s = state_.DeviceStats(0);
  EXPECT_EQ(s.num_device_alloc, ref.num_device_alloc) << "bad devices reset device 0";
  EXPECT_EQ(s.allocation.allocated, ref.allocation.allocated);
  EXPECT_EQ(s.allocated_bytes.peak, ref.allocated_bytes.peak);
  // Valid-but-absent host devices (the host backend has one).
  for (int dev : {1, 5, ProcessState::kMaxDevices - 1}) {
    SCOPED_TRACE(dev);
    absl::StatusOr<int64_t> id = state_.UsePrivatePool(Backend::kHost, dev, 9, 9, kSmall);
    if (id.ok()) {
      ASSERT_TRUE(state_.ReleasePrivatePool(dev, 9, 9).ok());
    }
    (void)state_.DeviceStats(dev);
    (void)state_.DeviceUsage(dev);
    state_.ResetDeviceAccumulated(dev);
    state_.ResetDevicePeaks(dev);
    EXPECT_EQ(Inconsistent(state_.DeviceStats(dev)), "");
  }
  ASSERT_TRUE(state_.FreeBlock(d).ok());
}

// A forked child's statistics start clean, whatever the parent did (device pool, private
// pools open, closed with live blocks, gone; resets; external holdings; fractions).
TEST_F(ProcessStateStatsTest, AForkedChildsStatisticsStartClean) {
  if (VMM_UNDER_TSAN) GTEST_SKIP() << "fork with threads";
  void* d = *state_.DeviceAllocate(0, 8 * kMiB, 0);
  int64_t open = *state_.UsePrivatePool(Backend::kHost, 0, 5, 1, kSmall);
  void* po = *state_.PoolAllocate(open, 2 * kMiB, 0, false);
  int64_t closing = *state_.UsePrivatePool(Backend::kHost, 0, 5, 2, kSmall);
  void* pc = *state_.PoolAllocate(closing, 2 * kMiB, 0, false);
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 5, 2).ok());
  int64_t gone = *state_.UsePrivatePool(Backend::kHost, 0, 5, 3, kSmall);
  ASSERT_TRUE(state_.FreeBlock(*state_.PoolAllocate(gone, 3 * kMiB, 0, false)).ok());
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 5, 3).ok());
  ASSERT_TRUE(state_.HoldExternal(0, 1 << 20).ok());
  ASSERT_TRUE(state_.CountExternalAllocated(0, 1 << 19).ok());
  ASSERT_TRUE(state_.SetMemoryFraction(0.5, 0).ok());
  state_.ResetDeviceAccumulated(0);
  const PoolStats parent = state_.DeviceStats(0);
  const int rc = InForkedChild([&]() -> int {
    for (int round = 0; round < 3; ++round) {
      const PoolStats s = state_.DeviceStats(0);
      const ProcessState::Usage u = state_.DeviceUsage(0);
      if (s.allocated_bytes.current != 0 || s.reserved_bytes.current != 0) return 10 + round;
      if (s.allocated_bytes.peak != 0 || s.reserved_bytes.peak != 0) return 20 + round;
      if (s.allocation.current != 0 || s.allocation.freed != 0) return 30 + round;
      if (s.num_device_alloc != 0 || s.num_device_free != 0) return 40 + round;
      if (s.segment.freed != 0 || s.segment.allocated != 0) return 50 + round;
      if (u.allocated != 0 || u.reserved != 0) return 60 + round;
      if (round == 0) state_.ResetDevicePeaks(0);
      if (round == 1) state_.ResetDeviceAccumulated(0);
    }
    // The parent's gone pool, and a parent's block freed in the child, count nowhere here.
    if (!state_.FreeBlock(pc).ok()) return 70;  // the parent's closed pool goes (in the child)
    PoolStats s = state_.DeviceStats(0);
    if (s.allocation.freed != 0 || s.segment.freed != 0 || s.num_device_free != 0) return 71;
    // The child's own pool.
    absl::StatusOr<int64_t> mine = state_.UsePrivatePool(Backend::kHost, 0, 5, 1, kSmall);
    if (!mine.ok()) return 80;
    absl::StatusOr<void*> p = state_.PoolAllocate(*mine, kMiB, 0, false);
    if (!p.ok()) return 81;
    s = state_.DeviceStats(0);
    if (s.allocated_bytes.current != static_cast<int64_t>(kMiB)) return 82;
    if (s.allocated_bytes.peak != static_cast<int64_t>(kMiB)) return 83;
    if (s.allocation.allocated != 1 || s.allocation.current != 1) return 84;
    const ProcessState::Usage u = state_.DeviceUsage(0);
    if (u.allocated != static_cast<int64_t>(kMiB)) return 85;
    if (!state_.FreeBlock(*p).ok()) return 86;
    if (!state_.ReleasePrivatePool(0, 5, 1).ok()) return 87;
    s = state_.DeviceStats(0);
    if (s.allocation.allocated != 1 || s.allocation.freed != 1) return 88;
    if (s.allocated_bytes.current != 0 || s.reserved_bytes.current != 0) return 89;
    if (!Inconsistent(s).empty()) return 90;
    // The child may hold external memory anew (the parent's holding is not its own).
    if (state_.HoldExternal(0, -(1 << 20)).ok()) return 91;
    if (state_.CountExternalAllocated(0, -(1 << 19)).ok()) return 92;
    return 0;
  });
  EXPECT_EQ(rc, 0);
  const PoolStats after = state_.DeviceStats(0);
  EXPECT_EQ(after.allocated_bytes.current, parent.allocated_bytes.current);
  EXPECT_EQ(after.allocation.allocated, parent.allocation.allocated);
  ASSERT_TRUE(state_.FreeBlock(pc).ok());
  ASSERT_TRUE(state_.FreeBlock(po).ok());
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 5, 1).ok());
  ASSERT_TRUE(state_.FreeBlock(d).ok());
  ASSERT_TRUE(state_.HoldExternal(0, -(1 << 20)).ok());
  ASSERT_TRUE(state_.CountExternalAllocated(0, -(1 << 19)).ok());
}

// Another allocator's segments and blocks (a MemPool over NCCL's allocator: HoldExternal,
// CountExternalAllocated) peak with the pools', not beside them: PyTorch keeps one set of
// figures per GPU over every pool, so 16 MiB freed in the device pool and then 16 MiB taken
// in such a MemPool peak at 16 MiB allocated, not 32 (the sum of the two pools' peaks, which
// the plugin reported before). DeviceUsage counts them too, as the profiler's figures;
// DeviceStats's currents do not (the plugin adds the pools' own figures).
TEST_F(ProcessStateStatsTest, OtherAllocatorsBlocksAndSegmentsPeakWithThePoolsNotBesideThem) {
  constexpr int64_t kBlock = 16 * kMiB;
  constexpr int64_t kSegment = 20 * kMiB;
  Pool* pool = *state_.DevicePool(0);
  ASSERT_TRUE(state_.FreeBlock(*state_.DeviceAllocate(0, kBlock, 0)).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  state_.ResetDevicePeaks(0);
  void* d = *state_.DeviceAllocate(0, kBlock, 0);
  const int64_t pool_reserved = state_.DeviceStats(0).reserved_bytes.current;
  ASSERT_GE(pool_reserved, kBlock);
  ASSERT_TRUE(state_.FreeBlock(d).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());

  ASSERT_TRUE(state_.HoldExternal(0, kSegment).ok());
  ASSERT_TRUE(state_.CountExternalAllocated(0, kBlock).ok());
  PoolStats s = state_.DeviceStats(0);
  EXPECT_EQ(s.allocated_bytes.current, 0) << "the other allocator's blocks are the plugin's to add";
  EXPECT_EQ(s.allocated_bytes.peak, kBlock) << "one 16 MiB block live at any time";
  EXPECT_EQ(s.reserved_bytes.peak, std::max(pool_reserved, kSegment));
  ProcessState::Usage u = state_.DeviceUsage(0);
  EXPECT_EQ(u.allocated, kBlock);
  EXPECT_EQ(u.reserved, kSegment + s.reserved_bytes.current);

  // Both at once: the peak is their sum.
  d = *state_.DeviceAllocate(0, kBlock, 0);
  s = state_.DeviceStats(0);
  EXPECT_EQ(s.allocated_bytes.peak, 2 * kBlock);
  EXPECT_EQ(s.reserved_bytes.peak, s.reserved_bytes.current + kSegment);
  ASSERT_TRUE(state_.FreeBlock(d).ok());

  // A reset makes the peak what both hold now.
  state_.ResetDevicePeaks(0);
  EXPECT_EQ(state_.DeviceStats(0).allocated_bytes.peak, kBlock);

  // Giving back more than was counted changes nothing.
  absl::Status more = state_.CountExternalAllocated(0, -kBlock - 1);
  EXPECT_EQ(more.code(), absl::StatusCode::kInvalidArgument) << more;
  EXPECT_EQ(state_.DeviceUsage(0).allocated, kBlock);
  EXPECT_EQ(state_.CountExternalAllocated(0, int64_t{1} << 57).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(state_.CountExternalAllocated(0, -kBlock).ok());
  ASSERT_TRUE(state_.HoldExternal(0, -kSegment).ok());
  u = state_.DeviceUsage(0);
  EXPECT_EQ(u.allocated, 0);
  EXPECT_EQ(u.reserved, state_.DeviceStats(0).reserved_bytes.current);
}

// Many private pools with threads allocating/freeing/releasing while one thread reads the
// statistics and resets (accumulated, peaks) and another resets too. The reading thread
// checks consistency on every read, monotonicity of every cumulative figure between reads
// with no reset anywhere, and after its own reset of accumulated that allocation.allocated
// counts no more than allocations that began after the reset began.
TEST_F(ProcessStateStatsTest, ThreadsChurnPrivatePoolsWhileOthersResetAndRead) {
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::atomic<int64_t> allocs_begun{0}, allocs_done{0};
  std::atomic<int64_t> resets_begun{0}, resets_done{0};  // of the second resetter
  Mutex handed_mu;
  std::vector<void*> handed;
  std::string first_failure;
  Mutex fail_mu;
  auto fail = [&](const std::string& why) {
    if (failures.fetch_add(1) == 0) {
      MutexLock l(&fail_mu);
      first_failure = why;
    }
  };
  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    for (uint64_t n = 0; !stop.load(); ++n) {
      const uint64_t key = 100 * (seed + 1) + n % 13;
      absl::StatusOr<int64_t> id = state_.UsePrivatePool(Backend::kHost, 0, key, 7, kSmall);
      if (!id.ok()) {
        fail(std::string(id.status().message()));
        continue;
      }
      std::vector<void*> blocks;
      const int k = 1 + rng() % 4;
      for (int i = 0; i < k; ++i) {
        allocs_begun.fetch_add(1);
        const size_t size = rng() % 2 ? 512 + rng() % 8192 : (1 + rng() % 4) * kMiB;
        absl::StatusOr<void*> p = state_.PoolAllocate(*id, size, 0, rng() % 2);
        allocs_done.fetch_add(1);
        if (p.ok()) blocks.push_back(*p);
      }
      if (rng() % 3 == 0) {
        allocs_begun.fetch_add(1);
        absl::StatusOr<void*> p = state_.DeviceAllocate(0, (1 + rng() % 3) * kMiB, 0);
        allocs_done.fetch_add(1);
        if (p.ok()) blocks.push_back(*p);
      }
      const int mode = rng() % 3;
      if (mode == 0) {
        for (void* b : blocks) if (!state_.FreeBlock(b).ok()) fail("free");
        if (!state_.ReleasePrivatePool(0, key, 7).ok()) fail("release");
      } else if (mode == 1) {
        if (!state_.ReleasePrivatePool(0, key, 7).ok()) fail("release");
        MutexLock l(&handed_mu);
        handed.insert(handed.end(), blocks.begin(), blocks.end());
      } else {
        // keep the pool used once more for a while (another use), then release both
        absl::StatusOr<int64_t> again = state_.UsePrivatePool(Backend::kHost, 0, key, 7, "");
        if (!again.ok() || *again != *id) fail("second use");
        if (!state_.ReleasePrivatePool(0, key, 7).ok()) fail("release 1");
        for (void* b : blocks) if (!state_.FreeBlock(b).ok()) fail("free");
        if (!state_.ReleasePrivatePool(0, key, 7).ok()) fail("release 2");
      }
      if (rng() % 5 == 0) {
        for (const ProcessState::PoolRef& p : state_.DevicePools(0)) (void)p.pool->EmptyCache();
      }
    }
  };
  std::atomic<bool> done_churn{false};
  auto freer = [&] {
    for (bool last = false; !last;) {
      last = done_churn.load();
      std::vector<void*> blocks;
      {
        MutexLock l(&handed_mu);
        blocks.swap(handed);
      }
      for (void* b : blocks) if (!state_.FreeBlock(b).ok()) fail("handed free");
      if (blocks.empty()) std::this_thread::yield();
    }
  };
  auto other_resetter = [&] {
    std::mt19937 rng(4242);
    while (!stop.load()) {
      resets_begun.fetch_add(1);
      if (rng() % 2) {
        state_.ResetDevicePeaks(0);
      } else {
        state_.ResetDeviceAccumulated(0);
      }
      resets_done.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 2000));
    }
  };
  int64_t reads = 0, checked_after_reset = 0;
  auto reader = [&] {
    std::mt19937 rng(99);
    PoolStats last;
    bool have_last = false;
    int64_t last_resets = -1;
    while (!stop.load()) {
      const int64_t r0 = resets_begun.load();
      const bool quiet0 = r0 == resets_done.load();
      const int op = rng() % 20;
      if (op == 0) {
        const int64_t done_before = allocs_done.load();  // completed before the reset
        state_.ResetDeviceAccumulated(0);
        const PoolStats s = state_.DeviceStats(0);
        // At most what had not completed when the reset began.
        const int64_t later = allocs_begun.load() - done_before;
        // Another resetter may only lower it further.
        if (s.allocation.allocated > later) {
          fail(absl::StrCat("after reset: allocation.allocated ", s.allocation.allocated,
                            " > allocations begun since ", later));
        }
        ++checked_after_reset;
        have_last = false;
        continue;
      }
      if (op == 1) {
        state_.ResetDevicePeaks(0);
        have_last = false;
        continue;
      }
      const PoolStats s = state_.DeviceStats(0);
      ++reads;
      const std::string why = Inconsistent(s);
      if (!why.empty()) fail("inconsistent: " + why);
      const int64_t r1 = resets_begun.load();
      const bool quiet1 = r1 == resets_done.load();
      if (have_last && quiet0 && quiet1 && r0 == r1 && r0 == last_resets) {
        std::string fell;
        auto chk = [&](const std::string& n, int64_t b, int64_t a) {
          if (a < b) absl::StrAppend(&fell, n, " ", b, "->", a, "; ");
        };
#define VMM_CHK(name, key, what) \
  chk(key ".allocated", last.name.allocated, s.name.allocated); \
  chk(key ".freed", last.name.freed, s.name.freed);
        VMM_BYTE_STATS(VMM_CHK)
        VMM_COUNT_STATS(VMM_CHK)
#undef VMM_CHK
#define VMM_CHKC(name, key, what) chk(key, last.name, s.name);
        VMM_COUNTERS(VMM_CHKC)
#undef VMM_CHKC
        if (!fell.empty()) fail("fell: " + fell);
      }
      last = s;
      have_last = quiet0 && quiet1 && r0 == r1;
      last_resets = r1;
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  threads.emplace_back(other_resetter);
  threads.emplace_back(reader);
  std::thread freeing(freer);
  std::this_thread::sleep_for(std::chrono::seconds(VMM_UNDER_TSAN ? 4 : 3));
  stop.store(true);
  for (std::thread& t : threads) t.join();
  done_churn.store(true);
  freeing.join();
  EXPECT_EQ(failures.load(), 0) << "first: " << first_failure;
  EXPECT_GT(reads, 50);
  EXPECT_GT(checked_after_reset, 3);
  // Quiescent end: everything freed; figures consistent; usage agrees.
  state_.ResetDevicePeaks(0);
  const PoolStats end = state_.DeviceStats(0);
  EXPECT_EQ(Inconsistent(end), "");
  EXPECT_EQ(end.allocated_bytes.current, 0);
  EXPECT_EQ(end.allocation.current, 0);
  EXPECT_EQ(end.allocated_bytes.peak, 0);
  const ProcessState::Usage u = state_.DeviceUsage(0);
  EXPECT_EQ(u.allocated, end.allocated_bytes.current);
  EXPECT_EQ(u.reserved, end.reserved_bytes.current);
}

// DeviceUsage (vmm_device_usage) read while blocks are freed and their memory released:
// allocated must never exceed reserved.
TEST_F(ProcessStateStatsTest, DeviceUsageNeverShowsMoreAllocatedThanReserved) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> bad{0}, reads{0};
  std::atomic<int64_t> worst_alloc{0}, worst_res{0};
  auto churn = [&](int t) {
    while (!stop.load()) {
      absl::StatusOr<void*> p = state_.DeviceAllocate(0, 2 * kMiB, 0);
      if (!p.ok()) continue;
      (void)state_.FreeBlock(*p);
      (void)(*state_.DevicePool(0))->EmptyCache();
    }
  };
  auto reader = [&] {
    while (!stop.load()) {
      const ProcessState::Usage u = state_.DeviceUsage(0);
      reads.fetch_add(1, std::memory_order_relaxed);
      if (u.allocated > u.reserved || u.allocated < 0 || u.reserved < 0) {
        if (bad.fetch_add(1) == 0) {
          worst_alloc.store(u.allocated);
          worst_res.store(u.reserved);
        }
      }
    }
  };
  std::vector<std::thread> threads;
  threads.emplace_back(churn, 0);
  const unsigned readers = std::max(4u, 2 * std::thread::hardware_concurrency());
  for (unsigned i = 0; i < readers; ++i) threads.emplace_back(reader);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  stop.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0) << "of " << reads.load() << " reads; first: allocated "
                           << worst_alloc.load() << " reserved " << worst_res.load();
}

// DeviceCap's joint peak under a reset racing an Add: after both, peak >= current (and so
// the GPU's peak covers an allocation that completed alongside a reset).
TEST(DeviceCapTest, AResetOfTheJointPeakRacingAnAddLosesNothing) {
  const int kIters = VMM_UNDER_TSAN ? 20000 : 300000;
  DeviceCap cap;
  constexpr int64_t kX = 1 << 20;
  std::atomic<int> phase{0};
  int64_t violations = 0, first_peak = -1, first_current = -1;
  std::thread resetter([&] {
    for (int i = 0; i < kIters; ++i) {
      while (phase.load(std::memory_order_acquire) != 2 * i + 1) {}
      cap.ResetPeaks();
      phase.store(2 * i + 2, std::memory_order_release);
    }
  });
  for (int i = 0; i < kIters; ++i) {
    cap.allocated().Add(kX);   // peak >= base + X before the race
    cap.allocated().Add(-kX);
    phase.store(2 * i + 1, std::memory_order_release);
    cap.allocated().Add(kX);   // races the reset
    while (phase.load(std::memory_order_acquire) != 2 * i + 2) {}
    if (cap.allocated().peak() < cap.allocated().current()) {
      if (violations++ == 0) {
        first_peak = cap.allocated().peak();
        first_current = cap.allocated().current();
      }
    }
    cap.allocated().Add(-kX);
  }
  resetter.join();
  EXPECT_EQ(violations, 0) << "of " << kIters << "; first: peak " << first_peak
                           << " < current " << first_current;
}

// DeviceCap's limit near the largest size: what would pass it is refused, not let through by
// the sum of what is held and what is asked wrapping around.
TEST(DeviceCapTest, ALimitNearTheLargestSizeIsNotPassedByWrapping) {
  DeviceCap cap;
  cap.SetLimit(SIZE_MAX - 1);
  cap.AddExternal(10);
  EXPECT_FALSE(cap.Allows(SIZE_MAX - 5));
  EXPECT_FALSE(cap.Allows(SIZE_MAX - 10));
  EXPECT_TRUE(cap.Allows(SIZE_MAX - 11)) << "exactly up to the limit";
  cap.SetLimit(5);
  EXPECT_FALSE(cap.Allows(0)) << "already past the limit";
}

// DeviceCap's resets racing another allocator's block taken back and its segment released:
// after a reset the allocated peak is at most the reserved one, as the currents are (the
// reserved peak reset after the allocated one could fall below it: 64 MiB allocated at peak
// over a reserved peak of 0, until the next growth).
TEST(DeviceCapTest, AResetRacingAGiveBackKeepsTheAllocatedPeakWithinTheReserved) {
  const int kIters = VMM_UNDER_TSAN ? 20000 : 200000;
  DeviceCap cap;
  constexpr int64_t kX = 64 << 20;
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      cap.AddExternal(kX);  // a segment, then a block in it; the block back, then the segment
      cap.AddExternalAllocated(kX);
      cap.AddExternalAllocated(-kX);
      cap.AddExternal(-kX);
    }
  });
  int64_t violations = 0, first_allocated = -1, first_reserved = -1;
  for (int i = 0; i < kIters; ++i) {
    cap.ResetPeaks();
    // The allocated peak first: the reserved one only rises until this thread resets it.
    const int64_t allocated = cap.allocated().peak();
    const int64_t reserved = cap.reserved().peak();
    if (allocated > reserved && violations++ == 0) {
      first_allocated = allocated;
      first_reserved = reserved;
    }
  }
  stop.store(true);
  churn.join();
  EXPECT_EQ(violations, 0) << "of " << kIters << "; first: allocated peak " << first_allocated
                           << " > reserved peak " << first_reserved;
}

}  // namespace
}  // namespace vmm
