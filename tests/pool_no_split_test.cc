// A pool set not to split (Pool::SetNoSplit, what torch.cuda.MemPool(no_split=True) asks of a
// vmm private pool): every block in a chunk of its own between unmapped granules, a snapshot
// segment alone, handed out and reused whole, cached per stream like any block (also while a
// capture window is open, where exported chunks would wait), released by EmptyCache; the
// pool's invariants hold through a random run. Runs on the backend of tests/test_backend.h.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "allocator/capture_window.h"
#include "allocator/driver.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/slack_range_driver.h"
#include "tests/status_matchers.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class PoolNoSplitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(driver_, TestDriver(HostDriverOptions{2 * kMiB, 512 * kMiB}, &owned_));
  }

  // A pool set not to split: with the C++ defaults (4 MiB pages, growth by a fraction) unless
  // `options` are given.
  std::unique_ptr<Pool> MakePool(PoolOptions options = PoolOptions{}) {
    options.reserve_size = 2048 * kMiB;
    std::unique_ptr<Pool> pool = CreatePoolOrFail(driver_, options);
    if (pool != nullptr) {
      EXPECT_OK(pool->SetNoSplit());
    }
    return pool;
  }

  // Each live block of `pool` begins a snapshot segment that holds no other block, is its
  // whole chunk (allocated bytes) and has an unmapped neighbour on each side.
  static void ExpectAlone(const Pool& pool, const std::vector<void*>& live) {
    const Snapshot snap = pool.GetSnapshot();
    std::map<uintptr_t, const SegmentInfo*> by_addr;
    for (const SegmentInfo& s : snap.segments) by_addr[s.addr] = &s;
    for (void* p : live) {
      auto s = by_addr.find(reinterpret_cast<uintptr_t>(p));
      ASSERT_NE(s, by_addr.end()) << p << " begins no segment";
      const SegmentInfo& seg = *s->second;
      ASSERT_EQ(seg.blocks.size(), 1u) << "a segment of one block";
      EXPECT_EQ(seg.blocks[0].state, BlockState::kAllocated);
      EXPECT_EQ(seg.blocks[0].size, seg.size) << "handed out whole";
      ASSERT_EQ(seg.chunks.size(), 1u) << "one driver allocation";
      EXPECT_EQ(seg.chunks[0].size, seg.size);
    }
    // Segments never touch: a gap lies between any two.
    const SegmentInfo* prev = nullptr;
    for (const auto& [addr, seg] : by_addr) {
      if (prev != nullptr) {
        EXPECT_LT(prev->addr + prev->size, addr) << "two segments touch";
      }
      prev = seg;
    }
  }

  std::unique_ptr<Driver> owned_;
  Driver* driver_ = nullptr;
};

TEST_F(PoolNoSplitTest, EachBlockIsAChunkAndASegmentOfItsOwnTakenWhole) {
  for (const PoolOptions& options : {PoolOptions{}, SingleChunkOptions()}) {
    auto pool = MakePool(options);
    ASSERT_NE(pool, nullptr);
    const size_t sizes[] = {1, 512, 1000, 100000, kMiB, kMiB + 4, 3 * kMiB, 24 * kMiB, 4096};
    std::vector<void*> live;
    int64_t chunks_bytes = 0;
    for (size_t size : sizes) {
      live.push_back(AllocateOrFail(*pool, size));
      chunks_bytes += static_cast<int64_t>((size + 2 * kMiB - 1) / (2 * kMiB) * 2 * kMiB);
    }
    ExpectAlone(*pool, live);
    const PoolStats stats = pool->GetStats();
    EXPECT_EQ(stats.reserved_bytes.current, chunks_bytes) << "the requests rounded to 2 MiB";
    EXPECT_EQ(stats.allocated_bytes.current, chunks_bytes) << "each block its whole chunk";
    EXPECT_EQ(stats.segment.current, static_cast<int64_t>(std::size(sizes)));
    EXPECT_OK(pool->CheckInvariants());
    for (void* p : live) ASSERT_OK(pool->Free(p));
    EXPECT_OK(pool->CheckInvariants());
    ASSERT_OK(pool->EmptyCache());
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  }
}

TEST_F(PoolNoSplitTest, TheSmallestCachedBlockThatHoldsARequestServesItWholeWithoutADriverCall) {
  auto pool = MakePool();
  ASSERT_NE(pool, nullptr);
  void* big = AllocateOrFail(*pool, 24 * kMiB);
  void* mid = AllocateOrFail(*pool, 4 * kMiB);
  void* small = AllocateOrFail(*pool, 512);
  for (void* p : {big, mid, small}) ASSERT_OK(pool->Free(p));
  const int64_t creates = pool->GetStats().num_device_alloc;
  EXPECT_EQ(AllocateOrFail(*pool, 3 * kMiB), mid);
  EXPECT_EQ(pool->GetStats().allocated_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(AllocateOrFail(*pool, 100), small);
  EXPECT_EQ(AllocateOrFail(*pool, 22 * kMiB), big) << "within an eighth over 22 MiB";
  EXPECT_EQ(pool->GetStats().num_device_alloc, creates);
  ExpectAlone(*pool, {big, mid, small});
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {big, mid, small}) ASSERT_OK(pool->Free(p));
}

// A cached block much larger than a request would keep its rest from every other request for
// as long as it lives (PyTorch keeps small requests to small segments): it serves the request
// only when the pool cannot grow. A private pool keeps its memory, so this is what lets a
// large block come back for a large request later.
TEST_F(PoolNoSplitTest, ABlockFarLargerThanARequestServesItOnlyWhenMemoryIsShort) {
  PoolOptions options = SingleChunkOptions();
  options.memory_limit = 310 * kMiB;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  pool->SetKeepMemory(true);
  void* big = AllocateOrFail(*pool, 300 * kMiB);
  ASSERT_OK(pool->Free(big));
  void* tiny = AllocateOrFail(*pool, 512);
  EXPECT_NE(tiny, big);
  EXPECT_EQ(pool->GetStats().allocated_bytes.current, static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(AllocateOrFail(*pool, 290 * kMiB), big) << "the large block, for a large request";
  ASSERT_OK(pool->Free(big));
  // 20 MiB more would pass the limit: the cached 300 MiB block serves it, whole.
  EXPECT_EQ(AllocateOrFail(*pool, 20 * kMiB), big);
  EXPECT_EQ(pool->GetStats().allocated_bytes.current, static_cast<int64_t>(302 * kMiB));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(big));
  ASSERT_OK(pool->Free(tiny));
  pool->SetKeepMemory(false);
}

// A range that grows lengthens by what a guarded block needs (its two guards too).
TEST_F(PoolNoSplitTest, AGrowingRangeServesABlockPastItsFirstLargeArena) {
  SlackRangeDriver driver(driver_, 512 * kMiB);
  PoolOptions options = SingleChunkOptions();
  options.growth_fraction = 0;
  options.reserve_size = 64 * kMiB;  // a large arena of 56 MiB
  options.range_grows = true;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> pool, Pool::Create(&driver, options));
  ASSERT_OK(pool->SetNoSplit());
  for (size_t size : {size_t{56} * kMiB, size_t{100} * kMiB, size_t{100} * kMiB}) {
    void* p = AllocateOrFail(*pool, size);
    ASSERT_NE(p, nullptr) << size / kMiB << " MiB";
    ASSERT_OK(pool->Free(p));
  }
  EXPECT_LE(pool->GetStats().num_range_extensions, 2);
  EXPECT_OK(pool->CheckInvariants());
}

// A shareable block (a send's own chunk) gets guards too: it never joins a no_split block's
// segment.
TEST_F(PoolNoSplitTest, AShareableBlockIsASegmentApartToo) {
  auto pool = MakePool(SingleChunkOptions());
  ASSERT_NE(pool, nullptr);
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable here";
  void* p = AllocateOrFail(*pool, 3 * kMiB);
  ASSERT_OK_AND_ASSIGN(void* shared, pool->AllocateShareable(3 * kMiB, 0));
  ExpectAlone(*pool, {p});
  for (const SegmentInfo& seg : pool->GetSnapshot().segments) {
    if (seg.addr == reinterpret_cast<uintptr_t>(shared)) {
      EXPECT_EQ(seg.size, 4 * kMiB) << "its chunk alone";
    }
  }
  ASSERT_OK(pool->Free(shared));
  ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A MemPool context or a graph capture keeps a capture window open: blocks freed inside it
// are reused there at once by their stream, as PyTorch reuses them (exported chunks, whose
// frees wait for an event on their stream, would not be, and the pool would grow a chunk per
// allocation until out of memory).
TEST_F(PoolNoSplitTest, FreedBlocksAreReusedWhileACaptureWindowIsOpen) {
  PoolOptions options;
  options.memory_limit = 64 * kMiB;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  OpenCaptureWindow();
  for (int i = 0; i < 40; ++i) {
    void* p = AllocateOrFail(*pool, 8 * kMiB);
    ASSERT_NE(p, nullptr) << "allocation " << i;
    ASSERT_OK(pool->Free(p));
  }
  CloseCaptureWindow();
  EXPECT_EQ(pool->GetStats().num_device_alloc, 1);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolNoSplitTest, ItIsSetOnAFreshPoolOnly) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> pool, Pool::Create(driver_, PoolOptions{}));
  void* p = AllocateOrFail(*pool, kMiB);
  EXPECT_EQ(pool->SetNoSplit().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(pool->Free(p));
  ASSERT_OK(pool->EmptyCache());
  EXPECT_OK(pool->SetNoSplit()) << "it holds no memory any more";
}

// A block sent in place (its chunk marked exported) is free memory of the pool again, whole,
// once its free is done and no receiver maps it; also where the pool isolates sends, and in a
// pool that keeps its memory (a private pool in use), where a chunk kept apart for sends
// would stay unused for the pool's life.
TEST_F(PoolNoSplitTest, ASentBlockIsReusedWholeOnceNoReceiverMapsIt) {
  for (bool isolate : {false, true}) {
    PoolOptions options;
    options.isolate_sends = isolate;
    auto pool = MakePool(options);
    ASSERT_NE(pool, nullptr);
    if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
    pool->SetKeepMemory(true);
    void* first = nullptr;
    for (int i = 0; i < 5; ++i) {
      void* p = AllocateOrFail(*pool, 3 * kMiB);
      if (i == 0) first = p;
      EXPECT_EQ(p, first) << "isolate_sends=" << isolate << ", send " << i;
      ASSERT_OK_AND_ASSIGN(
          ExportedBlock e,
          pool->Export(p, HandleType::kNone, ExportNeighbours::kRefuse, ExportUse::kTracked));
      ASSERT_OK(pool->Free(p));
      pool->SettleExport(e.chunks, /*released=*/true);
      ASSERT_OK(pool->CheckInvariants());
    }
    EXPECT_EQ(pool->GetStats().num_device_alloc, 1) << "isolate_sends=" << isolate;
    pool->SetKeepMemory(false);
  }
}

TEST_F(PoolNoSplitTest, ARandomRunKeepsEveryBlockAloneAndTheInvariants) {
  auto pool = MakePool();
  ASSERT_NE(pool, nullptr);
  std::mt19937_64 rng(7);
  std::vector<void*> live;
  std::vector<Stream> streams = {0};
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<Stream> s = driver_->CreateStream(0);
    ASSERT_OK(s.status());
    streams.push_back(*s);
  }
  for (int step = 0; step < 400; ++step) {
    if (live.empty() || (live.size() < 40 && rng() % 2 == 0)) {
      const size_t size = std::uniform_int_distribution<size_t>(1, 20 * kMiB)(rng) >>
                          std::uniform_int_distribution<int>(0, 12)(rng);
      void* p = AllocateOrFail(*pool, size, streams[rng() % streams.size()]);
      ASSERT_NE(p, nullptr) << "step " << step;
      live.push_back(p);
    } else {
      const size_t i = rng() % live.size();
      ASSERT_OK(pool->Free(live[i]));
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_OK(pool->CheckInvariants()) << "step " << step;
    if (step % 50 == 0) ExpectAlone(*pool, live);
  }
  ExpectAlone(*pool, live);
  for (void* p : live) ASSERT_OK(pool->Free(p));
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  for (size_t i = 1; i < streams.size(); ++i) ASSERT_OK(driver_->DestroyStream(streams[i]));
}

}  // namespace
}  // namespace vmm
