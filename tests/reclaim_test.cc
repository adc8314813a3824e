// Tests of reclaiming free memory on a miss (allocator/reclaim_policy.h): a pool whose large
// arena grows in pages moves wholly free pages to where a request goes instead of growing,
// never moves exported memory or memory another stream may still use, and keeps its
// bookkeeping and every live block's bytes intact throughout.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "allocator/capture_window.h"
#include "allocator/driver_factory.h"
#include "allocator/forwarding_driver.h"
#include "allocator/growth_policy.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "allocator/reclaim_policy.h"
#include "allocator/sharing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/status_matchers.h"
#include "tests/stream_gate.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kPage = 4 * kMiB;

class ReclaimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    owned_ = NewHostDriver(HostDriverOptions{2 * kMiB, 256 * kMiB});
    driver_ = owned_.get();
  }

  // Exact growth in pages of kPage, so that the tests can predict the reserved bytes; every
  // chunk one page (growth_page), so that they can predict the pages each hole holds.
  // `growth_page` 0: the default; growth_page_from 0, so that requests of any size grow in
  // chunks of up to growth_page until the first move.
  std::unique_ptr<Pool> MakePool(ExportObserver* observer = nullptr,
                                 size_t growth_page = kPage) {
    PoolOptions options = Paged();
    options.growth_page = growth_page != 0 ? growth_page : PoolOptions().growth_page;
    return CreatePoolOrFail(driver_, options, observer);
  }

  // MakePool's options, for a test to change some.
  static PoolOptions Paged() {
    PoolOptions options;
    options.growth_fraction = 0;
    options.large_page = kPage;
    options.growth_page = kPage;
    options.growth_page_from = 0;
    options.reserve_size = 1024 * kMiB;
    return options;
  }

  // MakePool's with chunks of up to 32 MiB (kGrowthChunk) on a 4 GiB device, room for a
  // request of kLargeRequestChunks of them (1 GiB): such chunks are made only while the pool
  // holds at most half of what it may. `small_chunk` 0: the default.
  static constexpr size_t kGrowthChunk = 8 * kPage;
  static constexpr size_t kLargeGrowth = kLargeRequestChunks * kGrowthChunk;
  std::unique_ptr<Pool> MakeLargePool(size_t small_chunk = 0) {
    owned_ = NewHostDriver(HostDriverOptions{2 * kMiB, 4096 * kMiB});
    driver_ = owned_.get();
    PoolOptions options = Paged();
    options.growth_page = kGrowthChunk;
    options.reserve_size = 4096 * kMiB;
    if (small_chunk != 0) options.small_chunk = small_chunk;
    return CreatePoolOrFail(driver_, options);
  }
  // What a growth for kLargeGrowth bytes (a miss) created: bytes and chunks; the block is
  // appended to `live`.
  struct Created {
    int64_t bytes;
    int64_t chunks;
  };
  Created GrowLarge(Pool& pool, std::vector<void*>& live) {
    const PoolStats before = pool.GetStats();
    live.push_back(Alloc(pool, kLargeGrowth));
    const PoolStats after = pool.GetStats();
    return {after.reserved_bytes.current - before.reserved_bytes.current,
            after.driver_create - before.driver_create};
  }

  // Chunks of up to four pages until the first move, and a memory limit.
  std::unique_ptr<Pool> MakePoolWithLimit(size_t memory_limit) {
    PoolOptions options;
    options.growth_fraction = 0;
    options.large_page = kPage;
    options.growth_page = 4 * kPage;
    options.growth_page_from = 0;
    options.memory_limit = memory_limit;
    options.reserve_size = 1024 * kMiB;
    return CreatePoolOrFail(driver_, options);
  }

  void* Alloc(Pool& pool, size_t size, Stream stream = 0) {
    return AllocateOrFail(pool, size, stream);
  }

  // `count` blocks of one page each, block i filled with `first + i`.
  std::vector<void*> FilledPages(Pool& pool, int count, int first) {
    std::vector<void*> pages;
    for (int i = 0; i < count; ++i) {
      pages.push_back(Alloc(pool, kPage));
      std::memset(pages.back(), first + i, kPage);
    }
    return pages;
  }

  std::unique_ptr<Driver> owned_;
  Driver* driver_ = nullptr;
};

// Two 8 MiB holes between live blocks; a 16 MiB request fits neither.
struct Holes {
  void* a;
  void* b;
  void* c;
  void* d;
};

Holes MakeHoles(Pool& pool, Stream stream = 0) {
  Holes h;
  h.a = *pool.Allocate(8 * kMiB, stream);
  h.b = *pool.Allocate(4 * kMiB, stream);
  h.c = *pool.Allocate(8 * kMiB, stream);
  h.d = *pool.Allocate(4 * kMiB, stream);
  std::memset(h.b, 0xbb, 4 * kMiB);
  std::memset(h.d, 0xdd, 4 * kMiB);
  return h;
}

// The pool's reserved bytes and segments are its arenas' together (stats.h), also after
// memory moved between them.
void ExpectArenasAddUp(const PoolStats& s) {
  const ArenaStats& sm = s.arena[kSmallArena];
  const ArenaStats& lg = s.arena[kLargeArena];
  for (auto [all, small, large] : {std::tuple{&s.reserved_bytes, &sm.reserved_bytes,
                                              &lg.reserved_bytes},
                                   std::tuple{&s.segment, &sm.segment, &lg.segment}}) {
    EXPECT_EQ(all->current, small->current + large->current);
    EXPECT_EQ(all->allocated, small->allocated + large->allocated);
    EXPECT_EQ(all->freed, small->freed + large->freed);
  }
}

bool Filled(const void* p, size_t n, unsigned char value) {
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; i += 4096) {
    if (bytes[i] != value || bytes[n - 1 - (i % n)] != value) return false;
  }
  return true;
}

// With pages, growth is exact whatever growth_fraction says (growth_policy.h): extra pages
// would only be free memory in peak reserved. It is planned in half pages (PlanUnit).
TEST_F(ReclaimTest, PagedGrowthMapsOnlyWhatTheRequestNeeds) {
  PoolOptions options;
  options.large_page = kPage;
  options.growth_page = kPage;  // one chunk per page
  options.growth_fraction = 0.5;
  options.reserve_size = 1024 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  ASSERT_NE(pool, nullptr);
  void* a = Alloc(*pool, 12 * kMiB);
  void* b = Alloc(*pool, 9 * kMiB);  // rounded up to half pages: two pages and a half, 10 MiB
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(22 * kMiB));
  EXPECT_EQ(pool->GetStats().segment.current, 6);
  for (void* p : {a, b}) EXPECT_OK(pool->Free(p));
}

// By default the pool pages its large arena in 4 MiB pages and keeps only requests up to
// 256 KiB in the small arena, so blocks of a few hundred KiB land in pages that move once
// free. Requests below 128 MiB grow in single pages; larger ones, until the pool first moves
// memory, in chunks of up to 32 MiB.
TEST_F(ReclaimTest, DefaultsPageTheLargeArenaAndKeepTheSmallArenaSmall) {
  // A 1 GiB device: chunks of several pages are made only while the pool holds at most half
  // of what the device has.
  std::unique_ptr<Driver> device = NewHostDriver(HostDriverOptions{2 * kMiB, 1024 * kMiB});
  PoolOptions options;
  options.reserve_size = 1024 * kMiB;
  auto pool = CreatePoolOrFail(device.get(), options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().large_page, 4 * kMiB);
  EXPECT_EQ(pool->options().growth_page, 32 * kMiB);
  EXPECT_EQ(pool->options().growth_page_from, 128 * kMiB);
  void* tiny = Alloc(*pool, 256 * 1024);
  void* kv_page = Alloc(*pool, 512 * 1024);
  EXPECT_TRUE(pool->InSmallArena(tiny));
  EXPECT_FALSE(pool->InSmallArena(kv_page));
  // kv_page took a chunk of half a page, 2 MiB (growth is planned in half pages). Then the
  // rest of it and 18.5 MiB more, to 2 MiB: in single pages (below growth_page_from), five.
  void* big = Alloc(*pool, 20 * kMiB);
  PoolStats stats = pool->GetStats();
  // The small arena's 2 MiB chunk, 2 MiB, five 4 MiB pages.
  EXPECT_EQ(stats.reserved_bytes.current, static_cast<int64_t>(24 * kMiB));
  EXPECT_EQ(stats.segment.current, 7);
  // 130 MiB: four chunks of 32 MiB and a half page (the pool has not moved memory).
  void* huge = Alloc(*pool, 130 * kMiB);
  stats = pool->GetStats();
  EXPECT_EQ(stats.reserved_bytes.current, static_cast<int64_t>(154 * kMiB));
  EXPECT_EQ(stats.segment.current, 12);
  for (void* p : {tiny, kv_page, big, huge}) EXPECT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// Near a limit the rounding to half pages counts (pool.h): 21 MiB under a 22 MiB limit would
// take six 4 MiB halves; planned in granules instead (22 MiB: two pages and a 6 MiB chunk), it
// fits with no failed growth, as single chunks do.
TEST_F(ReclaimTest, NearALimitAPagedGrowthIsPlannedInGranules) {
  for (size_t page : {size_t{8} << 20, size_t{0}}) {
    SCOPED_TRACE(page);
    PoolOptions options;
    options.large_page = page;
    options.reserve_size = 1024 * kMiB;
    options.memory_limit = 22 * kMiB;
    auto pool = CreatePoolOrFail(driver_, options);
    ASSERT_NE(pool, nullptr);
    absl::StatusOr<void*> p = pool->Allocate(21 * kMiB, 0);
    ASSERT_OK(p.status());
    PoolStats stats = pool->GetStats();
    EXPECT_EQ(stats.reserved_bytes.current, static_cast<int64_t>(22 * kMiB));
    EXPECT_EQ(stats.num_alloc_retries, 0);
    EXPECT_OK(pool->CheckInvariants());
    EXPECT_OK(pool->Free(*p));
    EXPECT_TRUE(absl::IsResourceExhausted(pool->Allocate(23 * kMiB, 0).status()));
    EXPECT_OK(pool->CheckInvariants());
  }
}

// Where the GPU's capacity, not a limit the pool knows, refuses the half pages, the retry
// after the pool has released its free chunks plans in granules.
TEST_F(ReclaimTest, AtTheDevicesCapacityTheRetryIsPlannedInGranules) {
  std::unique_ptr<Driver> small = NewHostDriver(HostDriverOptions{2 * kMiB, 22 * kMiB});
  PoolOptions options;
  options.large_page = 8 * kMiB;  // planned in 4 MiB halves
  options.reserve_size = 1024 * kMiB;
  auto pool = CreatePoolOrFail(small.get(), options);
  ASSERT_NE(pool, nullptr);
  absl::StatusOr<void*> p = pool->Allocate(21 * kMiB, 0);
  ASSERT_OK(p.status());
  EXPECT_EQ(pool->GetStats().num_alloc_retries, 1);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(22 * kMiB));
  EXPECT_OK(pool->Free(*p));
  EXPECT_OK(pool->CheckInvariants());
}

// Opens a gate (its stream's work) when the pool synchronises the device: the work is still
// queued for a miss's first attempt, and done once the retry after a failed growth has
// synchronised, as with work that ends meanwhile.
class GateOnSyncDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  void set_gate(StreamGate* gate) { gate_ = gate; }
  absl::Status SynchronizeDevice(int device) override {
    if (gate_ != nullptr) gate_->Release();
    return ForwardingDriver::SynchronizeDevice(device);
  }

 private:
  StreamGate* gate_ = nullptr;
};

// The retry after a failed growth synchronises the device, which makes the free space another
// stream left usable by every stream: where a cached block then fits, the retry takes it.
// (It went straight to growing, whose plan beside that block had nothing to map: the request
// failed with "no gap ... left in the pool's reserved address range", and the same request
// made again was served from the cache.) The pool's first block, of `first` bytes, is freed
// on t, which then takes `kept` bytes (a multiple of 512) of its chunk again; `request` bytes
// on s fit what is left of the chunk.
void ExpectTheRetryTakesWhatTheSynchronisationFreed(Driver* inner, const PoolOptions& options,
                                                    size_t first, size_t kept, size_t request) {
  GateOnSyncDriver driver(inner);
  Stream s = *driver.CreateStream(0);
  Stream t = *driver.CreateStream(0);
  {
    StreamGate gate(&driver, t);  // t's work runs only once the pool synchronises
    driver.set_gate(&gate);
    auto pool = CreatePoolOrFail(&driver, options);
    ASSERT_NE(pool, nullptr);
    void* x = AllocateOrFail(*pool, first, t);
    ASSERT_OK(pool->Free(x));
    void* k = AllocateOrFail(*pool, kept, t);
    ASSERT_EQ(k, x);  // the rest of the chunk stays cached for t, and t is busy
    const int64_t reserved = pool->GetStats().reserved_bytes.current;
    pool->SetMemoryLimit(static_cast<size_t>(reserved));  // no growth fits
    absl::StatusOr<void*> p = pool->Allocate(request, s);
    ASSERT_OK(p.status());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*p), reinterpret_cast<uintptr_t>(x) + kept);
    const PoolStats stats = pool->GetStats();
    EXPECT_EQ(stats.num_alloc_retries, 1);
    EXPECT_EQ(stats.num_ooms, 0);
    EXPECT_EQ(stats.reserved_bytes.current, reserved);
    EXPECT_OK(pool->CheckInvariants());
    ASSERT_OK(pool->Free(*p));
    ASSERT_OK(pool->Free(k));
    EXPECT_OK(pool->CheckInvariants());
    pool.reset();
    driver.set_gate(nullptr);
  }
  ASSERT_OK(driver.DestroyStream(s));
  ASSERT_OK(driver.DestroyStream(t));
}

TEST_F(ReclaimTest, TheRetryAfterAFailedGrowthTakesACachedBlockItMadeUsable) {
  PoolOptions options = SingleChunkOptions();
  options.growth_fraction = 0;
  options.reserve_size = 1024 * kMiB;
  // 40 MiB left of a 48 MiB chunk for a 32 MiB request.
  ExpectTheRetryTakesWhatTheSynchronisationFreed(driver_, options, 48 * kMiB, 8 * kMiB,
                                                 32 * kMiB);
}

// The same in the small arena, with the default options: a 512-byte request, and 2 MiB less
// 1 KiB of a small chunk cached.
TEST_F(ReclaimTest, TheRetryAfterAFailedGrowthTakesACachedSmallBlockItMadeUsable) {
  PoolOptions options;
  options.reserve_size = 1024 * kMiB;
  ExpectTheRetryTakesWhatTheSynchronisationFreed(driver_, options, 4096, 1024, 512);
}

// A cached block of whole pages that the retry's synchronisation made usable is taken as it
// lies: not released and made again by the growth (4 creates and 4 releases for 16 MiB).
TEST_F(ReclaimTest, TheRetryTakesACachedBlockOfWholePagesWithoutRemakingIt) {
  GateOnSyncDriver driver(driver_);
  Stream s = *driver.CreateStream(0);
  Stream t = *driver.CreateStream(0);
  {
    StreamGate gate(&driver, t);  // t's work runs only once the pool synchronises
    driver.set_gate(&gate);
    auto pool = CreatePoolOrFail(&driver, Paged());
    ASSERT_NE(pool, nullptr);
    void* keep = AllocateOrFail(*pool, 4 * kPage, s);
    void* x = AllocateOrFail(*pool, 4 * kPage, t);
    ASSERT_OK(pool->Free(x));  // cached for t, which is busy
    pool->SetMemoryLimit(static_cast<size_t>(pool->GetStats().reserved_bytes.current));
    const PoolStats before = pool->GetStats();
    absl::StatusOr<void*> p = pool->Allocate(4 * kPage, s);
    ASSERT_OK(p.status());
    EXPECT_EQ(*p, x);
    const PoolStats after = pool->GetStats();
    EXPECT_EQ(after.num_alloc_retries - before.num_alloc_retries, 1);
    EXPECT_EQ(after.driver_create, before.driver_create);
    EXPECT_EQ(after.driver_release, before.driver_release);
    EXPECT_OK(pool->CheckInvariants());
    for (void* q : {*p, keep}) ASSERT_OK(pool->Free(q));
    pool.reset();
    driver.set_gate(nullptr);
  }
  ASSERT_OK(driver.DestroyStream(s));
  ASSERT_OK(driver.DestroyStream(t));
}

// After a growth has failed for lack of memory, growth is planned in half pages again, so
// that a miss can still move whole free pages (a plan in granules fits fewer of them): a
// request of 14 MiB takes the two free 8 MiB pages and creates nothing.
TEST_F(ReclaimTest, AfterAFailedGrowthFreePagesStillMove) {
  PoolOptions options;
  options.large_page = 8 * kMiB;
  options.growth_page = 8 * kMiB;
  options.reserve_size = 1024 * kMiB;
  options.memory_limit = 48 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  ASSERT_NE(pool, nullptr);
  EXPECT_TRUE(absl::IsResourceExhausted(pool->Allocate(56 * kMiB, 0).status()));
  std::vector<void*> pages;
  for (int i = 0; i < 6; ++i) pages.push_back(Alloc(*pool, 8 * kMiB));
  ASSERT_OK(pool->Free(pages[1]));
  ASSERT_OK(pool->Free(pages[3]));
  const PoolStats before = pool->GetStats();
  void* q = Alloc(*pool, 14 * kMiB);
  ASSERT_NE(q, nullptr);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_alloc_retries, before.num_alloc_retries);
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 2);
  EXPECT_OK(pool->CheckInvariants());
  for (int i : {0, 2, 4, 5}) ASSERT_OK(pool->Free(pages[i]));
  ASSERT_OK(pool->Free(q));
}

// A range too small for whole half pages (a small reserve) still serves what fits it: the
// growth is planned to granularity there.
TEST_F(ReclaimTest, ARangeTooSmallForWholePagesStillServesWhatFits) {
  PoolOptions options;  // 8 MiB pages, planned in 4 MiB halves
  options.reserve_size = 8 * kMiB;  // small arena 2 MiB, large arena 6 MiB
  auto pool = CreatePoolOrFail(driver_, options);
  ASSERT_NE(pool, nullptr);
  void* p = Alloc(*pool, 5 * kMiB);  // two halves (8 MiB) do not fit; 6 MiB of granules do
  EXPECT_NE(p, nullptr);
  EXPECT_OK(pool->CheckInvariants());
  if (p != nullptr) {
    EXPECT_OK(pool->Free(p));
  }
}

// A pool made to export keeps single chunks unless told (pool_options.h): a 3 GiB block
// exports as one handle, not 384, so sharing it stays within a common open-file limit.
TEST_F(ReclaimTest, APoolMadeToExportKeepsSingleChunksUnlessTold) {
  std::unique_ptr<Driver> big = NewHostDriver(HostDriverOptions{2 * kMiB, size_t{16} << 30});
  PoolOptions options;
  options.reserve_size = size_t{8} << 30;
  options.handle_type = HandleRequest::kPosixFd;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> pool, CreateExportablePool(big.get(), options));
  EXPECT_EQ(pool->options().large_page, 0u);
  EXPECT_EQ(pool->options().small_size, size_t{1} << 20);
  ASSERT_OK_AND_ASSIGN(void* p, pool->Allocate(size_t{3} << 30, 0));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool, p));
  EXPECT_EQ(d.handles().size(), 1u);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> imported, ImportBuffer(big.get(), d));
  imported.reset();
  EXPECT_OK(pool->Free(p));

  options.large_page = 8 * kMiB;  // asked for: pages, and the small arena to 256 KiB
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> paged, CreateExportablePool(big.get(), options));
  EXPECT_EQ(paged->options().large_page, 8 * kMiB);
  EXPECT_EQ(paged->options().small_size, size_t{256} << 10);
}

// A plan that joins free neighbours may not move their pages (reclaim_policy.h, invariant 4):
// where that leaves more to create than a plan elsewhere that moves them, the pool grows
// elsewhere. Here a 4-page gap lies between two free blocks of 2 pages, and nothing else is
// free: joining the left one needs 3 new pages, all created; growing at the end takes the 4
// free pages and creates 1.
TEST_F(ReclaimTest, AMissGrowsWhereItCanMoveTheMostAndCreateTheLeast) {
  auto pool = MakePool();
  std::vector<void*> pages = FilledPages(*pool, 10, 0x30);
  for (int i = 3; i <= 6; ++i) ASSERT_OK(pool->Free(pages[i]));
  // Five pages at the end: four moved from the hole, which becomes a gap, and one created.
  void* first = Alloc(*pool, 5 * kPage);
  ASSERT_EQ(pool->GetStats().num_chunk_moves, 4);
  EXPECT_EQ(pool->GetStats().moved_bytes, static_cast<int64_t>(4 * kPage));
  for (int i : {1, 2, 7, 8}) ASSERT_OK(pool->Free(pages[i]));
  const PoolStats before = pool->GetStats();
  void* second = Alloc(*pool, 5 * kPage);
  std::memset(second, 0xee, 5 * kPage);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 4);
  EXPECT_EQ(after.moved_bytes - before.moved_bytes, static_cast<int64_t>(4 * kPage));
  EXPECT_EQ(after.driver_create - before.driver_create, 1);
  EXPECT_EQ(after.reserved_bytes.current - before.reserved_bytes.current,
            static_cast<int64_t>(kPage));
  EXPECT_TRUE(Filled(pages[0], kPage, 0x30));
  EXPECT_TRUE(Filled(pages[9], kPage, 0x39));
  EXPECT_TRUE(Filled(second, 5 * kPage, 0xee));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {pages[0], pages[9], first, second}) ASSERT_OK(pool->Free(p));
}

// Below the allocated high a miss weighs moves as at a new high: it grows where pages can
// move rather than beside a free neighbour whose own pages would then stay and leave bytes to
// create, since the pool keeps what it creates and its peak reserved would rise for good.
TEST_F(ReclaimTest, BelowItsHighAMissMovesPagesRatherThanCreateBesideAFreeNeighbour) {
  auto pool = MakePool();
  std::vector<void*> p = FilledPages(*pool, 10, 0x40);
  // Pages 2 and 3 move to the end for three pages (one created): [2, 4) is a gap now.
  for (int i : {2, 3}) ASSERT_OK(pool->Free(p[i]));
  void* q = Alloc(*pool, 3 * kPage);
  std::memset(q, 0x77, 3 * kPage);
  ASSERT_EQ(pool->GetStats().num_chunk_moves, 2);
  // The gap's neighbours go free: page 1 on its left, pages 4-6 on its right. Four pages
  // fit neither, nor a new allocated high (11 pages were live, 7 are).
  for (int i : {1, 4, 5, 6}) ASSERT_OK(pool->Free(p[i]));
  const PoolStats before = pool->GetStats();
  // Joining pages 4-6 needs one page in the gap, which their pages may not fill (they are
  // the neighbour it joins) and which page 1 may not either (the gap's other neighbour): it
  // would be created. At the end the four free pages move and nothing is created.
  void* r = Alloc(*pool, 4 * kPage);
  std::memset(r, 0xee, 4 * kPage);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 4);
  EXPECT_GT(reinterpret_cast<uintptr_t>(r), reinterpret_cast<uintptr_t>(q));
  for (int i : {0, 7, 8, 9}) EXPECT_TRUE(Filled(p[i], kPage, 0x40 + i)) << i;
  EXPECT_TRUE(Filled(q, 3 * kPage, 0x77));
  EXPECT_TRUE(Filled(r, 4 * kPage, 0xee));
  EXPECT_OK(pool->CheckInvariants());
  for (void* x : {p[0], p[7], p[8], p[9], q, r}) ASSERT_OK(pool->Free(x));
}

// Half a page where that is whole granules (so it divides the page), else the page.
TEST(PlanUnitTest, IsHalfAPageInWholeGranules) {
  EXPECT_EQ(PlanUnit(8 * kMiB, 2 * kMiB), 4 * kMiB);
  EXPECT_EQ(PlanUnit(4 * kMiB, 2 * kMiB), 2 * kMiB);
  EXPECT_EQ(PlanUnit(12 * kMiB, 2 * kMiB), 6 * kMiB);
  EXPECT_EQ(PlanUnit(2 * kMiB, 2 * kMiB), 2 * kMiB);   // one granule
  EXPECT_EQ(PlanUnit(6 * kMiB, 2 * kMiB), 6 * kMiB);   // three granules
  EXPECT_EQ(PlanUnit(64 * kMiB, 64 * kMiB), 64 * kMiB);
}

// GrowthCost: the bytes left to create once the movable pages outside the plan's neighbours
// are taken, plus a sixty-fourth of its length (a half once the pool settles).
TEST(GrowthCostTest, CountsWhatTheNeighboursKeepAndWeighsTheMoves) {
  Block left, gap, right, elsewhere;
  gap.prev = &left;
  gap.next = &right;
  MovableMemory movable;
  movable.Add(&left, kPage, 4);
  movable.Add(&elsewhere, kPage, 6);
  Arena::GrowthPlan plan;
  plan.gap = &gap;
  plan.len = 8 * kPage;
  // The left neighbour's 4 pages stay: 6 of the 8 can move, 2 are created.
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/false, SIZE_MAX), 2 * kPage + plan.len / 64);
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/true, SIZE_MAX), 2 * kPage + plan.len / 2);
  // Away from that neighbour all 10 pages may move: nothing is created.
  gap.prev = nullptr;
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/false, SIZE_MAX), plan.len / 64);
  plan.len = 12 * kPage;
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/false, SIZE_MAX), 2 * kPage + plan.len / 64);
}

// A plan that creates more than the pool may still create (its memory limit) would fail: it
// costs more than any plan within that room, settling or not, and such plans rank by what
// they create.
TEST(GrowthCostTest, PlansPastTheRoomComeLast) {
  Block gap, elsewhere;
  MovableMemory movable;
  movable.Add(&elsewhere, kPage, 6);
  Arena::GrowthPlan plan;
  plan.gap = &gap;
  plan.len = 8 * kPage;  // 6 pages move, 2 are created
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/true, 2 * kPage), 2 * kPage + plan.len / 2);
  const size_t past = GrowthCost(movable, plan, /*settle=*/true, kPage);
  EXPECT_EQ(past, kPastRoom + 2 * kPage);
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/false, kPage), past);
  // Within the room, a plan of the whole address range still costs less.
  plan.len = size_t{1} << 48;
  EXPECT_LT(GrowthCost(movable, plan, /*settle=*/true, SIZE_MAX), past);
  plan.len = 12 * kPage;  // 6 created
  EXPECT_GT(GrowthCost(movable, plan, /*settle=*/false, kPage), past);
}

// Chunks of several pages move whole (invariant 5): a plan counts only those that fit it,
// the largest first.
TEST(GrowthCostTest, CountsOnlyTheChunksThatFitThePlan) {
  Block left, gap, elsewhere;
  gap.prev = &left;
  MovableMemory movable;
  movable.Add(&elsewhere, 4 * kPage, 1);
  movable.Add(&elsewhere, 2 * kPage, 1);
  movable.Add(&elsewhere, kPage, 1);
  movable.Add(&left, 8 * kPage, 1);
  EXPECT_EQ(movable.Fit(5 * kPage, nullptr, nullptr), 5 * kPage);   // 4 + 1
  EXPECT_EQ(movable.Fit(5 * kPage, &left, nullptr), 5 * kPage);
  EXPECT_EQ(movable.Fit(3 * kPage, &left, &left), 3 * kPage);       // 2 + 1
  EXPECT_EQ(movable.Fit(20 * kPage, &left, nullptr), 7 * kPage);
  EXPECT_EQ(movable.Fit(20 * kPage, nullptr, nullptr), 15 * kPage);
  Arena::GrowthPlan plan;
  plan.gap = &gap;
  plan.len = 3 * kPage;  // the 4-page chunk does not fit: 2 + 1 move, nothing is created
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/false, SIZE_MAX), plan.len / 64);
  movable = MovableMemory();
  movable.Add(&elsewhere, 4 * kPage, 1);
  // Only a chunk larger than the plan: all of it is created.
  EXPECT_EQ(GrowthCost(movable, plan, /*settle=*/false, SIZE_MAX), 3 * kPage + plan.len / 64);
}

// Releasing free pages that lie end to end takes one Unmap for all of them (whole mappings
// side by side), then one Release each; a page that is not next to them takes its own Unmap.
TEST_F(ReclaimTest, EmptyCacheUnmapsAdjacentPagesInOneCall) {
  auto pool = MakePool();
  void* run = Alloc(*pool, 4 * kPage);
  void* kept = Alloc(*pool, kPage);
  void* alone = Alloc(*pool, kPage);
  ASSERT_NE(alone, nullptr);
  ASSERT_OK(pool->Free(run));
  ASSERT_OK(pool->Free(alone));
  const PoolStats before = pool->GetStats();
  ASSERT_OK(pool->EmptyCache());
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.driver_unmap - before.driver_unmap, 2);
  EXPECT_EQ(after.driver_release - before.driver_release, 5);
  EXPECT_EQ(after.reserved_bytes.current, static_cast<int64_t>(kPage));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(kept));
}

TEST_F(ReclaimTest, AMissTakesWhollyFreePagesInsteadOfGrowing) {
  auto pool = MakePool();
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  ASSERT_OK(pool->Free(h.c));
  const PoolStats before = pool->GetStats();
  ASSERT_EQ(before.reserved_bytes.current, static_cast<int64_t>(24 * kMiB));
  void* e = Alloc(*pool, 16 * kMiB);
  ASSERT_NE(e, nullptr);
  std::memset(e, 0xee, 16 * kMiB);  // the moved pages are mapped and accessible
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.reserved_bytes.peak, before.reserved_bytes.peak);
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc);
  EXPECT_EQ(after.num_chunk_moves, 4);
  // One Unmap for each hole (its two pages lie end to end), one Map for each page.
  EXPECT_EQ(after.driver_unmap - before.driver_unmap, 2);
  EXPECT_EQ(after.driver_map - before.driver_map, 4);
  EXPECT_EQ(after.driver_set_access - before.driver_set_access, 1);
  EXPECT_EQ(after.num_sync_stream, 1);  // the holes were freed on the requesting stream
  EXPECT_TRUE(Filled(h.b, 4 * kMiB, 0xbb));
  EXPECT_TRUE(Filled(h.d, 4 * kMiB, 0xdd));
  EXPECT_TRUE(Filled(e, 16 * kMiB, 0xee));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {h.b, h.d, e}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
}

// Memory moves between the arenas (reclaim_policy.h): once the small arena holds a surplus
// (more free than four small chunks and than it has allocated), a large growth takes its
// wholly free chunks instead of creating memory; a chunk that still holds a live block stays.
TEST_F(ReclaimTest, ALargeGrowthTakesTheChunksOfAnIdleSmallArena) {
  auto pool = MakePool();
  std::vector<void*> small;
  for (int i = 0; i < 80; ++i) small.push_back(Alloc(*pool, 200 * 1024));  // 16 MiB of chunks
  for (void* p : small) ASSERT_TRUE(pool->InSmallArena(p));
  void* kept = small.front();
  std::memset(kept, 0x5a, 200 * 1024);
  for (size_t i = 1; i < small.size(); ++i) ASSERT_OK(pool->Free(small[i]));
  const PoolStats before = pool->GetStats();
  ASSERT_EQ(before.reserved_bytes.current, static_cast<int64_t>(16 * kMiB));
  ASSERT_EQ(before.arena[kSmallArena].reserved_bytes.current, static_cast<int64_t>(16 * kMiB));

  void* big = Alloc(*pool, 12 * kMiB);
  ASSERT_FALSE(pool->InSmallArena(big));
  std::memset(big, 0xee, 12 * kMiB);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.num_chunk_moves, 6);
  EXPECT_EQ(after.arena[kSmallArena].reserved_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(after.arena[kSmallArena].segment.current, 2);
  EXPECT_EQ(after.arena[kLargeArena].reserved_bytes.current, static_cast<int64_t>(12 * kMiB));
  EXPECT_EQ(after.arena[kLargeArena].segment.current, 6);
  EXPECT_EQ(after.reserved_bytes.peak, before.reserved_bytes.peak);
  ExpectArenasAddUp(after);
  EXPECT_TRUE(Filled(kept, 200 * 1024, 0x5a));
  EXPECT_TRUE(Filled(big, 12 * kMiB, 0xee));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {kept, big}) ASSERT_OK(pool->Free(p));
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  EXPECT_OK(pool->CheckInvariants());
}

// A small arena keeps its free chunks for its own blocks while it has less cached than four
// small chunks, or less cached than allocated: a large growth then creates memory instead.
TEST_F(ReclaimTest, ASmallArenaInUseKeepsItsFreeChunks) {
  auto pool = MakePool();
  auto expect_created = [&](const char* what) {
    const PoolStats before = pool->GetStats();
    void* big = Alloc(*pool, 4 * kMiB);
    const PoolStats after = pool->GetStats();
    EXPECT_EQ(after.num_chunk_moves, before.num_chunk_moves) << what;
    EXPECT_EQ(after.driver_create, before.driver_create + 1) << what;
    EXPECT_EQ(after.arena[kSmallArena].reserved_bytes.current,
              before.arena[kSmallArena].reserved_bytes.current) << what;
    return big;
  };
  // About 6 MiB cached, nothing allocated: less than four small chunks (8 MiB).
  std::vector<void*> small;
  for (int i = 0; i < 30; ++i) small.push_back(Alloc(*pool, 200 * 1024));
  for (void* p : small) ASSERT_OK(pool->Free(p));
  small.clear();
  ASSERT_LT(pool->GetStats().arena[kSmallArena].inactive_split_bytes.current,
            static_cast<int64_t>(8 * kMiB));
  void* big1 = expect_created("too little cached");
  // About 10 MiB cached but 21 MiB allocated.
  for (int i = 0; i < 160; ++i) small.push_back(Alloc(*pool, 200 * 1024));
  for (size_t i = 110; i < small.size(); ++i) ASSERT_OK(pool->Free(small[i]));
  const PoolStats mid = pool->GetStats();
  ASSERT_GE(mid.arena[kSmallArena].inactive_split_bytes.current, static_cast<int64_t>(8 * kMiB));
  ASSERT_LT(mid.arena[kSmallArena].inactive_split_bytes.current,
            mid.arena[kSmallArena].allocated_bytes.current);
  void* big2 = expect_created("more allocated than cached");
  for (void* p : {big1, big2}) ASSERT_OK(pool->Free(p));
  for (size_t i = 0; i < 110; ++i) ASSERT_OK(pool->Free(small[i]));
  EXPECT_OK(pool->CheckInvariants());
}

// Nothing moves while a capture is under way anywhere in the process (capture_window.h): the
// synchronisation a move may need would invalidate it. The miss creates memory instead; once
// the window closes, the next miss moves again.
TEST_F(ReclaimTest, NothingMovesWhileACaptureIsUnderWay) {
  auto pool = MakePool();
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  ASSERT_OK(pool->Free(h.c));
  const PoolStats before = pool->GetStats();
  OpenCaptureWindow();
  void* e = Alloc(*pool, 16 * kMiB);
  CloseCaptureWindow();
  const PoolStats during = pool->GetStats();
  EXPECT_EQ(during.num_chunk_moves, 0);
  EXPECT_EQ(during.driver_unmap, before.driver_unmap);
  EXPECT_EQ(during.reserved_bytes.current, before.reserved_bytes.current + static_cast<int64_t>(16 * kMiB));
  void* f = Alloc(*pool, 16 * kMiB);  // the two holes' pages move now
  EXPECT_EQ(pool->GetStats().num_chunk_moves, 4);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, during.reserved_bytes.current);
  for (void* p : {h.b, h.d, e, f}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// Counts the driver calls that would invalidate a capture once a capture window has opened
// (OpenCaptureWindow returned); after Arm(), the first Create (or RecordEvent) starts a
// thread that opens a window, and goes on once the window is being opened: another thread
// beginning a capture while this one is inside a miss.
class CaptureWatchingDriver : public ForwardingDriver {
 public:
  enum class At { kCreate, kRecordEvent };
  using ForwardingDriver::ForwardingDriver;
  ~CaptureWatchingDriver() override { Join(); }
  void Arm(At at) { armed_ = at; }
  // Waits for the window's opener; whether it opened one (to close).
  bool Join() {
    if (!opener_.joinable()) return false;
    opener_.join();
    return true;
  }
  absl::StatusOr<PhysHandle> Create(int device, size_t size, uint32_t types) override {
    OpenIfArmed(At::kCreate);
    return ForwardingDriver::Create(device, size, types);
  }
  absl::Status RecordEvent(Event event, Stream stream) override {
    OpenIfArmed(At::kRecordEvent);
    if (InWindow()) ++events_in_window;
    return ForwardingDriver::RecordEvent(event, stream);
  }
  absl::StatusOr<bool> EventDone(Event event) override {
    if (InWindow()) ++events_in_window;
    return ForwardingDriver::EventDone(event);
  }
  absl::Status Unmap(DevPtr ptr, size_t size) override {
    if (InWindowOnceSettled()) ++unmaps_in_window;
    return ForwardingDriver::Unmap(ptr, size);
  }
  absl::Status SynchronizeDevice(int device) override {
    if (CaptureWindowOpen()) ++syncs_in_window;
    return ForwardingDriver::SynchronizeDevice(device);
  }
  std::atomic<int> unmaps_in_window{0};
  std::atomic<int> events_in_window{0};
  std::atomic<int> syncs_in_window{0};

 private:
  // Whether a capture may be under way: a window this driver's thread opened and whose
  // opening returned, or one the test opened itself.
  bool InWindow() const { return opened_ || (!opener_.joinable() && CaptureWindowOpen()); }
  // The same once a window being opened has had time to finish opening: unless the call
  // under way holds it back (WorkOutsideCapture), it opens meanwhile.
  bool InWindowOnceSettled() const {
    for (int i = 0; i < 200 && opener_.joinable() && !opened_; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return InWindow();
  }
  void OpenIfArmed(At at) {
    if (armed_ != at) return;
    armed_.reset();
    opener_ = std::thread([this] {
      OpenCaptureWindow();
      opened_ = true;
    });
    while (!CaptureWindowOpen()) std::this_thread::yield();
  }
  std::optional<At> armed_;
  std::atomic<bool> opened_{false};
  std::thread opener_;
};

// A window that opens while a miss is moving memory waits for the moves to end: none of
// them unmaps once the capture may have begun.
TEST_F(ReclaimTest, ACaptureWindowOpeningDuringAMoveWaitsForIt) {
  CaptureWatchingDriver driver(driver_);
  driver_ = &driver;
  auto pool = MakePool();
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  ASSERT_OK(pool->Free(h.c));
  driver.Arm(CaptureWatchingDriver::At::kCreate);
  void* e = Alloc(*pool, 20 * kMiB);  // the holes' four pages move, one page is created
  ASSERT_TRUE(driver.Join());
  CloseCaptureWindow();
  EXPECT_EQ(pool->GetStats().num_chunk_moves, 4);
  EXPECT_EQ(driver.unmaps_in_window, 0);
  for (void* p : {h.b, h.d, e}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A free past the release threshold first asks whether other streams are done with their
// cached blocks, then trims: a window that opens while it asks waits for the trim too, so
// that no unmap lands once the capture may have begun.
TEST_F(ReclaimTest, ACaptureWindowOpeningDuringATrimWaitsForIt) {
  CaptureWatchingDriver driver(driver_);
  driver_ = &driver;
  PoolOptions options = Paged();
  options.release_threshold = 4 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  void* keep = Alloc(*pool, 4 * kMiB);
  void* b = Alloc(*pool, 8 * kMiB);
  driver.Arm(CaptureWatchingDriver::At::kRecordEvent);
  ASSERT_OK(pool->Free(b));  // 8 MiB cached, over the threshold
  ASSERT_TRUE(driver.Join()) << "the trim recorded no event: the window never opened";
  CloseCaptureWindow();
  EXPECT_EQ(driver.unmaps_in_window, 0);
  EXPECT_LT(pool->GetStats().reserved_bytes.current, 12 * kMiB) << "nothing was trimmed";
  ASSERT_OK(pool->Free(keep));
  EXPECT_OK(pool->CheckInvariants());
}

// The same for a miss's event work: a window that opens while a miss asks whether another
// stream is done with its cached blocks waits for the answer; no event is recorded or
// queried once the capture may have begun.
TEST_F(ReclaimTest, ACaptureWindowOpeningDuringAMissesEventWorkWaitsForIt) {
  CaptureWatchingDriver driver(driver_);
  driver_ = &driver;
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  void* a = Alloc(*pool, 8 * kMiB, t);
  ASSERT_OK(pool->Free(a));  // cached for t
  driver.Arm(CaptureWatchingDriver::At::kRecordEvent);
  void* b = Alloc(*pool, 8 * kMiB, s);  // misses on s: is t done with a?
  ASSERT_TRUE(driver.Join());
  CloseCaptureWindow();
  EXPECT_EQ(driver.events_in_window, 0);
  EXPECT_GT(pool->GetStats().driver_event, 0) << "the miss asked about t";
  ASSERT_OK(pool->Free(b));
  EXPECT_OK(pool->CheckInvariants());
  pool.reset();
  ASSERT_OK(driver_->DestroyStream(s));
  ASSERT_OK(driver_->DestroyStream(t));
}

// Near its memory limit, a miss during a capture neither moves memory nor falls back on
// synchronising the device and releasing the cache: it fails, saying why. Once the capture
// is over, the same request moves the holes' pages.
TEST_F(ReclaimTest, AMissNearTheLimitDuringACaptureFailsWithoutSyncOrUnmap) {
  CaptureWatchingDriver driver(driver_);
  PoolOptions options = Paged();
  options.memory_limit = 24 * kMiB;
  auto pool = CreatePoolOrFail(&driver, options);
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  ASSERT_OK(pool->Free(h.c));
  ASSERT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(24 * kMiB));
  OpenCaptureWindow();
  absl::StatusOr<void*> e = pool->Allocate(16 * kMiB, 0);
  CloseCaptureWindow();
  EXPECT_EQ(driver.syncs_in_window, 0);
  EXPECT_EQ(driver.unmaps_in_window, 0);
  ASSERT_TRUE(absl::IsResourceExhausted(e.status())) << e.status();
  EXPECT_THAT(std::string(e.status().message()), ::testing::HasSubstr("capture"));
  EXPECT_EQ(pool->GetStats().num_alloc_retries, 0);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(24 * kMiB));
  void* f = Alloc(*pool, 16 * kMiB);  // after the capture the holes' pages move
  EXPECT_EQ(pool->GetStats().num_chunk_moves, 4);
  for (void* p : {h.b, h.d, f}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A release threshold trims nothing while a capture is under way, not even free chunks
// known to be done with; the next free after it does.
TEST_F(ReclaimTest, AReleaseThresholdWaitsForTheCaptureToEnd) {
  PoolOptions options = Paged();
  options.release_threshold = 8 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  void* a = Alloc(*pool, 8 * kMiB);
  void* b = Alloc(*pool, 8 * kMiB);
  void* c = Alloc(*pool, 8 * kMiB);
  ASSERT_OK(pool->Free(a));
  ASSERT_OK(pool->Free(b));  // 16 MiB cached: trimmed to the threshold, the rest known done
  const PoolStats before = pool->GetStats();
  ASSERT_EQ(before.reserved_bytes.current, static_cast<int64_t>(16 * kMiB));
  OpenCaptureWindow();
  ASSERT_OK(pool->Free(c));
  const PoolStats during = pool->GetStats();
  CloseCaptureWindow();
  EXPECT_EQ(during.driver_unmap, before.driver_unmap);
  EXPECT_EQ(during.reserved_bytes.current, before.reserved_bytes.current);
  void* d = Alloc(*pool, 4 * kMiB);
  ASSERT_OK(pool->Free(d));
  EXPECT_LE(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_OK(pool->CheckInvariants());
}

// Fails, once each when told, the next Map (fail_map), and the next SetAccess and the first
// Unmap after it (fail_access_then_unmap: the undoing of a mapping fails too).
class OneShotFaultDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  absl::Status Map(DevPtr ptr, size_t size, PhysHandle handle) override {
    if (std::exchange(fail_map, false)) return absl::InternalError("injected Map");
    return ForwardingDriver::Map(ptr, size, handle);
  }
  absl::Status SetAccess(DevPtr ptr, size_t size, absl::Span<const int> devices) override {
    if (std::exchange(fail_access_then_unmap, false)) {
      unmap_armed_ = true;
      return absl::InternalError("injected SetAccess");
    }
    return ForwardingDriver::SetAccess(ptr, size, devices);
  }
  absl::Status Unmap(DevPtr ptr, size_t size) override {
    if (std::exchange(unmap_armed_, false)) return absl::InternalError("injected Unmap");
    return ForwardingDriver::Unmap(ptr, size);
  }
  bool fail_map = false;
  bool fail_access_then_unmap = false;

 private:
  bool unmap_armed_ = false;
};

// A growth that fails and cannot unmap what it mapped keeps that memory as free memory where
// it lies, rather than leaving a mapping the pool has forgotten in what it takes for a gap
// (which no later growth could map again, and which the pool would never give back).
TEST_F(ReclaimTest, AFailedGrowthThatCannotUnmapKeepsTheChunkAsFreeMemory) {
  OneShotFaultDriver driver(driver_);
  const size_t capacity = driver.GetMemInfo(0)->total;
  {
    auto pool = CreatePoolOrFail(&driver, Paged());
    driver.fail_access_then_unmap = true;
    EXPECT_FALSE(pool->Allocate(8 * kMiB, 0).ok());  // two pages: the first stays mapped
    PoolStats s = pool->GetStats();
    EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(kPage));
    EXPECT_EQ(s.arena[kLargeArena].reserved_bytes.current, static_cast<int64_t>(kPage));
    EXPECT_OK(pool->CheckInvariants());
    // The kept page serves the next request where it lies: one page is created beside it.
    void* a = Alloc(*pool, 8 * kMiB);
    EXPECT_EQ(pool->GetStats().driver_create, s.driver_create + 1);
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(8 * kMiB));
    std::memset(a, 0xaa, 8 * kMiB);
    void* b = Alloc(*pool, 8 * kMiB);  // a growth beside them maps as usual
    for (void* p : {a, b}) ASSERT_OK(pool->Free(p));
    ASSERT_OK(pool->EmptyCache());
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
    EXPECT_OK(pool->CheckInvariants());
  }
  EXPECT_EQ(driver.GetMemInfo(0)->free, capacity) << "every byte went back to the driver";
}

// The same for a move: a page that cannot be mapped where the request goes is mapped back,
// and one whose access then cannot be granted nor its mapping undone stays where it was, in
// the pool, rather than a mapping the pool has forgotten.
TEST_F(ReclaimTest, AMoveThatCannotUndoAMappingKeepsTheChunkWhereItWas) {
  OneShotFaultDriver driver(driver_);
  const size_t capacity = driver.GetMemInfo(0)->total;
  driver_ = &driver;
  {
    auto pool = MakePool();
    Holes h = MakeHoles(*pool);
    ASSERT_OK(pool->Free(h.a));
    ASSERT_OK(pool->Free(h.c));
    const PoolStats before = pool->GetStats();
    driver.fail_map = true;
    driver.fail_access_then_unmap = true;
    EXPECT_FALSE(pool->Allocate(16 * kMiB, 0).ok());
    PoolStats s = pool->GetStats();
    EXPECT_EQ(s.reserved_bytes.current, before.reserved_bytes.current) << "no page lost";
    EXPECT_OK(pool->CheckInvariants());
    void* e = Alloc(*pool, 16 * kMiB);  // the holes' four pages move now
    EXPECT_EQ(pool->GetStats().num_chunk_moves, 4);
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, before.reserved_bytes.current);
    std::memset(e, 0xee, 16 * kMiB);
    EXPECT_TRUE(Filled(h.b, 4 * kMiB, 0xbb));
    EXPECT_TRUE(Filled(h.d, 4 * kMiB, 0xdd));
    for (void* p : {h.b, h.d, e}) ASSERT_OK(pool->Free(p));
    ASSERT_OK(pool->EmptyCache());
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
    EXPECT_OK(pool->CheckInvariants());
  }
  EXPECT_EQ(driver.GetMemInfo(0)->free, capacity) << "every byte went back to the driver";
}

// A small-arena growth of several granules that moves part of them creates only the rest:
// the arena grows to small_chunk in all (growth_policy.h).
TEST_F(ReclaimTest, ASmallGrowthCreatesOnlyWhatItDoesNotMove) {
  PoolOptions options = Paged();  // half pages of one granule
  options.small_size = 3 * kMiB;
  options.small_chunk = 8 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  void* a = Alloc(*pool, 6 * kMiB);  // a page and a half page
  void* b = Alloc(*pool, 8 * kMiB);
  ASSERT_OK(pool->Free(a));
  void* c = Alloc(*pool, 4 * kMiB);  // a's page; its half page stays free
  ASSERT_EQ(c, a);
  const PoolStats before = pool->GetStats();
  void* s = Alloc(*pool, 3 * kMiB);  // two granules of the small arena
  ASSERT_TRUE(pool->InSmallArena(s));
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_chunk_moves, before.num_chunk_moves + 1);
  EXPECT_EQ(after.reserved_bytes.current - before.reserved_bytes.current,
            static_cast<int64_t>(6 * kMiB));
  EXPECT_EQ(after.arena[kSmallArena].reserved_bytes.current, static_cast<int64_t>(8 * kMiB));
  ExpectArenasAddUp(after);
  for (void* p : {b, c, s}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// The other way: a small-arena growth takes a wholly free chunk of the large arena that fits
// it (here the half page a growth ended in) instead of creating one.
TEST_F(ReclaimTest, ASmallGrowthTakesAFreeChunkOfTheLargeArena) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 6 * kMiB);  // a page and a half page
  void* b = Alloc(*pool, 4 * kMiB);  // keeps a's hole between live memory and the gap
  ASSERT_OK(pool->Free(a));
  const PoolStats before = pool->GetStats();
  ASSERT_EQ(before.reserved_bytes.current, static_cast<int64_t>(10 * kMiB));
  void* s = Alloc(*pool, 100 * 1024);
  ASSERT_TRUE(pool->InSmallArena(s));
  std::memset(s, 0x11, 100 * 1024);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.num_chunk_moves, 1);
  EXPECT_EQ(after.arena[kSmallArena].reserved_bytes.current, static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(after.arena[kLargeArena].reserved_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_TRUE(Filled(s, 100 * 1024, 0x11));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {b, s}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A growth is planned in half pages (growth_policy.h PlanUnit): a request that ends in the
// first half of a page gets a last chunk of half a page, not a page whose free rest would share
// a chunk with it. Once free, that half page moves like a page. With 4 MiB pages the half is
// one granule; with 8 MiB pages two (4 MiB), which only the half-page unit makes movable.
TEST_F(ReclaimTest, AGrowthEndsInAHalfPageThatMovesOnceFree) {
  for (size_t page : {kPage, 2 * kPage}) {
    SCOPED_TRACE(page);
    PoolOptions options;
    options.growth_fraction = 0;
    options.large_page = page;
    options.growth_page = page;  // single pages
    options.reserve_size = 1024 * kMiB;
    auto pool = CreatePoolOrFail(driver_, options);
    ASSERT_NE(pool, nullptr);
    void* a = Alloc(*pool, page + page / 2);  // a page and a half page
    void* b = Alloc(*pool, page);             // a page after it, live
    PoolStats before = pool->GetStats();
    EXPECT_EQ(before.reserved_bytes.current, static_cast<int64_t>(2 * page + page / 2));
    EXPECT_EQ(before.segment.current, 3);
    ASSERT_OK(pool->Free(a));
    before = pool->GetStats();
    // Nothing free fits 3 pages: the miss takes a's page and half page and creates the rest.
    void* c = Alloc(*pool, 3 * page);
    ASSERT_NE(c, nullptr);
    std::memset(c, 0xcc, 3 * page);
    const PoolStats after = pool->GetStats();
    EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 2);
    EXPECT_EQ(after.moved_bytes - before.moved_bytes, static_cast<int64_t>(page + page / 2));
    EXPECT_EQ(after.reserved_bytes.current,
              before.reserved_bytes.current + static_cast<int64_t>(page + page / 2));
    EXPECT_TRUE(Filled(c, 3 * page, 0xcc));
    EXPECT_OK(pool->CheckInvariants());
    for (void* p : {b, c}) ASSERT_OK(pool->Free(p));
    EXPECT_OK(pool->CheckInvariants());
  }
}

// Until a miss first moves memory, a paged growth is made of chunks of the largest
// power-of-two number of pages within the request and growth_page (pool_options.h); after it,
// of single pages.
TEST_F(ReclaimTest, AFreshPoolGrowsInChunksOfSeveralPagesUntilItFirstMoves) {
  auto pool = MakePool(nullptr, 4 * kPage);
  void* four = Alloc(*pool, 4 * kPage);  // one chunk of four pages
  EXPECT_EQ(pool->GetStats().segment.current, 1);
  void* three = Alloc(*pool, 3 * kPage);  // two pages, then one
  EXPECT_EQ(pool->GetStats().segment.current, 3);
  void* nine = Alloc(*pool, 9 * kPage);  // growth_page caps it: four, four, one
  EXPECT_EQ(pool->GetStats().segment.current, 6);
  EXPECT_EQ(pool->GetStats().driver_create, 6);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(16 * kPage));
  // The first move: `three`'s pages go where a request of four pages needs them.
  ASSERT_OK(pool->Free(three));
  const PoolStats before = pool->GetStats();
  void* moved_to = Alloc(*pool, 4 * kPage);
  PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 2);
  EXPECT_EQ(after.moved_bytes - before.moved_bytes, static_cast<int64_t>(3 * kPage));
  EXPECT_EQ(after.driver_create - before.driver_create, 1);  // the fourth page
  // From now on growth is in single pages.
  void* fresh = Alloc(*pool, 4 * kPage);
  const PoolStats last = pool->GetStats();
  EXPECT_EQ(last.driver_create - after.driver_create, 4);
  EXPECT_EQ(last.segment.current - after.segment.current, 4);
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {four, nine, moved_to, fresh}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// After the first move a request of kLargeRequestChunks growth chunks or more still grows in
// them (pool_options.h growth_page); one just below, in single pages.
TEST_F(ReclaimTest, AfterAMoveOnlyALargeRequestGrowsInChunksOfSeveralPages) {
  owned_ = NewHostDriver(HostDriverOptions{2 * kMiB, 2048 * kMiB});  // under half of it
  driver_ = owned_.get();
  constexpr size_t kGrowthPage = 2 * kPage;
  constexpr size_t kLarge = kLargeRequestChunks * kGrowthPage;  // 256 MiB
  auto pool = MakePool(nullptr, kGrowthPage);
  void* a = Alloc(*pool, kPage);
  void* b = Alloc(*pool, kPage);
  ASSERT_OK(pool->Free(a));
  void* moved_to = Alloc(*pool, 2 * kPage);  // a's page moves, one page is created
  ASSERT_EQ(pool->GetStats().num_chunk_moves, 1);
  PoolStats before = pool->GetStats();
  void* below = Alloc(*pool, kLarge - kPage);
  PoolStats after = pool->GetStats();
  EXPECT_EQ(after.driver_create - before.driver_create,
            static_cast<int64_t>((kLarge - kPage) / kPage));
  before = after;
  void* large = Alloc(*pool, kLarge);
  after = pool->GetStats();
  EXPECT_EQ(after.driver_create - before.driver_create,
            static_cast<int64_t>(kLarge / kGrowthPage));
  EXPECT_EQ(after.reserved_bytes.current - before.reserved_bytes.current,
            static_cast<int64_t>(kLarge));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {b, moved_to, below, large}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// Chunks of several pages only while the blocks grown in them fill them (pool.h): once a miss
// finds free memory in one that a live block shares, every later growth is in single pages,
// even a request that would otherwise get them (kLargeRequestChunks growth chunks, 1 GiB). A
// chunk gets shared by a block carved out of what a freed block left (a prefill's
// temporaries, then a layer's K and V cache) or by one that does not fill its growth.
TEST_F(ReclaimTest, ChunksOfSeveralPagesStopOnceOneIsShared) {
  for (const bool reuse : {true, false}) {
    SCOPED_TRACE(reuse ? "a block carved out of a freed one" : "a block that does not fill");
    auto pool = MakeLargePool();
    std::vector<void*> live;
    if (reuse) {
      void* temporary = Alloc(*pool, 8 * kGrowthChunk);  // eight chunks of 32 MiB
      ASSERT_EQ(pool->GetStats().driver_create, 8);
      ASSERT_OK(pool->Free(temporary));
      live.push_back(Alloc(*pool, 20 * kMiB));  // in the first chunk, whose rest stays free
    } else {
      // 249 MiB, planned in half pages: seven chunks of 32 MiB and one of 26 MiB, whose last
      // MiB stays free.
      live.push_back(Alloc(*pool, 249 * kMiB));
      ASSERT_EQ(pool->GetStats().driver_create, 8);
    }
    ASSERT_EQ(pool->GetStats().num_chunk_moves, 0);
    const Created created = GrowLarge(*pool, live);
    EXPECT_GT(created.bytes, 0);
    EXPECT_EQ(created.chunks, created.bytes / static_cast<int64_t>(kPage)) << "single pages";
    EXPECT_OK(pool->CheckInvariants());
    for (void* p : live) ASSERT_OK(pool->Free(p));
  }
}

// A pool whose growth chunks are pairs of its pages (16 MiB pages, 32 MiB growth chunks)
// stops them once one is shared, as one of smaller pages does: chunks of two pages are
// chunks of several pages (a trial that counted only larger ones turned the rule off there).
TEST_F(ReclaimTest, GrowthChunksOfTwoPagesStillStopOnceOneIsShared) {
  owned_ = NewHostDriver(HostDriverOptions{2 * kMiB, 4096 * kMiB});
  driver_ = owned_.get();
  constexpr size_t kBigPage = 16 * kMiB;
  PoolOptions options = Paged();
  options.large_page = kBigPage;
  options.growth_page = 2 * kBigPage;
  options.reserve_size = 4096 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  void* temporary = Alloc(*pool, 256 * kMiB);  // eight chunks of two pages
  ASSERT_EQ(pool->GetStats().driver_create, 8);
  ASSERT_OK(pool->Free(temporary));
  std::vector<void*> live = {Alloc(*pool, 20 * kMiB)};  // in the first chunk; its rest free
  ASSERT_EQ(pool->GetStats().num_chunk_moves, 0);
  const Created created = GrowLarge(*pool, live);
  // Enough that chunks of two pages and single pages differ in number.
  EXPECT_GE(created.bytes, static_cast<int64_t>(8 * kBigPage));
  // Single pages (the growth's last chunk may be half of one).
  EXPECT_GE(created.chunks, created.bytes / static_cast<int64_t>(kBigPage));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : live) ASSERT_OK(pool->Free(p));
}

// The small arena's chunks are shared by many blocks by design: a free block beside a live
// one there, in a chunk larger than a page (small_chunk 8 MiB), does not stop chunks of
// several pages in the large arena.
TEST_F(ReclaimTest, SharedSmallArenaChunksDoNotStopChunksOfSeveralPages) {
  auto pool = MakeLargePool(/*small_chunk=*/2 * kPage);
  std::vector<void*> live = {Alloc(*pool, 4 * kGrowthChunk)};  // four chunks, filled
  std::vector<void*> small;
  for (int i = 0; i < 160; ++i) small.push_back(Alloc(*pool, 256 * 1024));
  ASSERT_TRUE(pool->InSmallArena(small[0]));
  live.push_back(small[0]);
  for (size_t i = 1; i < small.size(); ++i) ASSERT_OK(pool->Free(small[i]));
  const Created created = GrowLarge(*pool, live);
  // Chunks of 32 MiB, but for the last one of the growth.
  EXPECT_LE(created.chunks, created.bytes / static_cast<int64_t>(kGrowthChunk) + 1);
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : live) ASSERT_OK(pool->Free(p));
}

// While the blocks grown in chunks of several pages fill them, as a loop's same-sized
// temporaries do, the pool goes on making them.
TEST_F(ReclaimTest, ChunksOfSeveralPagesGoOnWhileBlocksFillThem) {
  auto pool = MakeLargePool();
  void* temporary = Alloc(*pool, 8 * kGrowthChunk);
  ASSERT_OK(pool->Free(temporary));
  std::vector<void*> live = {Alloc(*pool, 8 * kGrowthChunk)};  // the same block, from the cache
  const Created created = GrowLarge(*pool, live);
  EXPECT_EQ(created.chunks, static_cast<int64_t>(kLargeGrowth / kGrowthChunk));
  EXPECT_EQ(created.bytes, static_cast<int64_t>(kLargeGrowth));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : live) ASSERT_OK(pool->Free(p));
}

// A chunk of several pages wholly inside a free block moves whole, one Map for all its pages,
// and only where it fits what the plan still needs (reclaim_policy.h, invariant 5); with
// chunks of several sizes the choice covers the need exactly where it can.
TEST_F(ReclaimTest, AChunkOfSeveralPagesMovesWholeWhereItFits) {
  auto pool = MakePool(nullptr, 4 * kPage);
  void* x = Alloc(*pool, 4 * kPage);  // one chunk of four pages
  void* y = Alloc(*pool, kPage);
  void* z = Alloc(*pool, 3 * kPage);  // chunks of two pages and one
  void* w = Alloc(*pool, kPage);
  std::memset(y, 0x11, kPage);
  std::memset(w, 0x22, kPage);
  ASSERT_OK(pool->Free(x));
  ASSERT_OK(pool->Free(z));
  // Five pages fit neither hole (four, three). The smaller hole first would take its two
  // chunks (three pages) and leave two to create, the four-page chunk not fitting; x's chunk
  // and z's single page cover the five exactly.
  PoolStats before = pool->GetStats();
  void* five = Alloc(*pool, 5 * kPage);
  std::memset(five, 0x55, 5 * kPage);
  PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 2);
  EXPECT_EQ(after.moved_bytes - before.moved_bytes, static_cast<int64_t>(5 * kPage));
  EXPECT_EQ(after.driver_map - before.driver_map, 2);  // one Map for four pages
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  // z's chunk of two pages stayed: two pages fit its hole without a driver call.
  before = after;
  void* two = Alloc(*pool, 2 * kPage);
  EXPECT_EQ(two, z);
  after = pool->GetStats();
  EXPECT_EQ(after.driver_create + after.driver_map, before.driver_create + before.driver_map);
  std::memset(two, 0x44, 2 * kPage);
  EXPECT_TRUE(Filled(y, kPage, 0x11));
  EXPECT_TRUE(Filled(w, kPage, 0x22));
  EXPECT_TRUE(Filled(five, 5 * kPage, 0x55));
  EXPECT_TRUE(Filled(two, 2 * kPage, 0x44));
  EXPECT_OK(pool->CheckInvariants());
  for (void* p : {y, w, five, two}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// After a move, or where a growth would take the pool past half of what it may hold (its
// memory limit here), growth is in single pages: a chunk of several pages moves and is
// released only whole, and near a limit the pages a small block strands in one could be
// what a later request needs.
TEST_F(ReclaimTest, NearItsLimitAPoolGrowsInSinglePages) {
  auto pool = MakePoolWithLimit(12 * kPage);
  ASSERT_NE(pool, nullptr);
  void* a = Alloc(*pool, 4 * kPage);  // 4 of 12 pages: one chunk
  EXPECT_EQ(pool->GetStats().segment.current, 1);
  void* b = Alloc(*pool, 4 * kPage);  // 8 of 12, past half: single pages
  EXPECT_EQ(pool->GetStats().segment.current, 5);
  for (void* p : {a, b}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// Whether a growth may be of several pages depends on what the GPU has free, a driver call
// (GetMemInfo) made only when the answer could change the chunk: not for a growth of one
// page, nor where the memory limit already decides it.
TEST_F(ReclaimTest, AGrowthAsksWhatTheGpuHasFreeOnlyWhenItCouldMatter) {
  class CountingDriver : public ForwardingDriver {
   public:
    using ForwardingDriver::ForwardingDriver;
    absl::StatusOr<MemInfo> GetMemInfo(int device) override {
      ++mem_info_calls;
      return ForwardingDriver::GetMemInfo(device);
    }
    int mem_info_calls = 0;
  };
  CountingDriver counting(driver_);
  PoolOptions options;
  options.growth_fraction = 0;
  options.large_page = kPage;
  options.growth_page = 4 * kPage;
  options.growth_page_from = 0;
  options.memory_limit = 12 * kPage;
  options.reserve_size = 1024 * kMiB;
  auto pool = CreatePoolOrFail(&counting, options);
  ASSERT_NE(pool, nullptr);
  const int at_create = counting.mem_info_calls;
  void* one = Alloc(*pool, kPage);  // a single page: nothing to decide
  EXPECT_EQ(counting.mem_info_calls, at_create);
  void* four = Alloc(*pool, 4 * kPage);  // 5 of 12 pages: within half the limit, so ask
  EXPECT_EQ(counting.mem_info_calls, at_create + 1);
  EXPECT_EQ(pool->GetStats().segment.current, 2);
  void* more = Alloc(*pool, 4 * kPage);  // past half the limit: single pages, not asked
  EXPECT_EQ(counting.mem_info_calls, at_create + 1);
  EXPECT_EQ(pool->GetStats().segment.current, 6);
  for (void* p : {one, four, more}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A growth that fails for lack of memory turns the pool to single pages too.
TEST_F(ReclaimTest, AfterRunningShortAPoolGrowsInSinglePages) {
  auto pool = MakePoolWithLimit(40 * kPage);
  ASSERT_NE(pool, nullptr);
  EXPECT_FALSE(pool->Allocate(41 * kPage, 0).ok());
  void* a = Alloc(*pool, 4 * kPage);
  EXPECT_EQ(pool->GetStats().segment.current, 4);
  ASSERT_OK(pool->Free(a));
  EXPECT_OK(pool->CheckInvariants());
}

// growth_page is rounded down to whole pages, raised to one page and capped by max_chunk; a
// growth's chunks are the largest power-of-two number of pages within it, the last what is
// left (seven pages: 4 + 3).
TEST_F(ReclaimTest, GrowthPageIsWholePagesWithinMaxChunk) {
  struct Case {
    size_t growth_page;
    size_t max_chunk;
    size_t expected;
    int chunks_for_seven_pages;
  };
  for (const Case& c : {Case{6 * kPage + kMiB, 64 * kPage, 6 * kPage, 2},
                        Case{kMiB, 64 * kPage, kPage, 7}, Case{0, 64 * kPage, kPage, 7},
                        Case{64 * kPage, 5 * kPage, 5 * kPage, 2},
                        Case{2 * kPage, 64 * kPage, 2 * kPage, 4},
                        Case{SIZE_MAX - 1, 8 * kPage, 8 * kPage, 2}}) {
    SCOPED_TRACE(c.growth_page);
    PoolOptions options;
    options.large_page = kPage;
    options.growth_page = c.growth_page;
    options.growth_page_from = 0;
    options.max_chunk = c.max_chunk;
    options.reserve_size = 1024 * kMiB;
    auto pool = CreatePoolOrFail(driver_, options);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(pool->options().growth_page, c.expected);
    void* p = Alloc(*pool, 7 * kPage);
    EXPECT_EQ(pool->GetStats().segment.current, c.chunks_for_seven_pages);
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(7 * kPage));
    EXPECT_OK(pool->CheckInvariants());
    ASSERT_OK(pool->Free(p));
  }
}

// growth_page left to the pool: 32 MiB, at least the page the pool uses (large_page rounded
// up to the granularity), one page for a pool made to export, nothing without pages; and
// growth_page_from four of them.
TEST_F(ReclaimTest, TheDefaultGrowthPageIs32MiBOfThePoolsPages) {
  PoolOptions options;
  options.large_page = 3 * kMiB;  // the granularity is 2 MiB: 4 MiB pages
  options.reserve_size = 1024 * kMiB;
  auto pool = CreatePoolOrFail(driver_, options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().large_page, 4 * kMiB);
  EXPECT_EQ(pool->options().growth_page, 32 * kMiB);
  EXPECT_EQ(pool->options().growth_page_from, 128 * kMiB);
  options.large_page = 64 * kMiB;
  pool = CreatePoolOrFail(driver_, options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().growth_page, 64 * kMiB);
  EXPECT_EQ(pool->options().growth_page_from, 256 * kMiB);
  options.large_page = 3 * kMiB;
  auto exportable = CreateExportablePool(driver_, options);
  ASSERT_OK(exportable.status());
  EXPECT_EQ((*exportable)->options().growth_page, 4 * kMiB);
  options.large_page = 0;
  options.growth_page = 64 * kMiB;
  options.growth_page_from = 64 * kMiB;
  pool = CreatePoolOrFail(driver_, options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().growth_page, 0u);
  EXPECT_EQ(pool->options().growth_page_from, 0u);
}

TEST_F(ReclaimTest, OnlyWhatIsMissingIsCreated) {
  auto pool = MakePool();
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  const PoolStats before = pool->GetStats();
  void* e = Alloc(*pool, 16 * kMiB);  // one 8 MiB hole: two pages moved, two created
  ASSERT_NE(e, nullptr);
  std::memset(e, 0xee, 16 * kMiB);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.reserved_bytes.current - before.reserved_bytes.current,
            static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(after.driver_create - before.driver_create, 2);
  EXPECT_EQ(after.num_chunk_moves, 2);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(ReclaimTest, ExportedChunksAreNeverMoved) {
  auto pool = MakePool();
  Holes h = MakeHoles(*pool);
  // c's pages are exported to a receiver that has not reported: they stay parked where the
  // receiver maps them.
  ASSERT_OK_AND_ASSIGN(ExportedBlock exported,
                       pool->Export(h.c, HandleType::kNone, ExportNeighbours::kRefuse,
                                    ExportUse::kTracked));
  ASSERT_EQ(exported.chunks.size(), 2u);
  ASSERT_OK(pool->Free(h.a));
  ASSERT_OK(pool->Free(h.c));
  const PoolStats before = pool->GetStats();
  void* e = Alloc(*pool, 16 * kMiB);
  ASSERT_NE(e, nullptr);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_chunk_moves, 2);  // a's pages only
  EXPECT_EQ(after.driver_create - before.driver_create, 2);
  EXPECT_EQ(after.exported_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(pool->SendBytesInUse(), 8 * kMiB);
  // The exported chunks are where they were, under the same ids.
  const Snapshot snap = pool->GetSnapshot();
  for (const ExportedChunk& c : exported.chunks) {
    EXPECT_FALSE(reinterpret_cast<uintptr_t>(e) <= c.addr &&
                 c.addr < reinterpret_cast<uintptr_t>(e) + 16 * kMiB);
  }
  EXPECT_OK(pool->CheckInvariants());
  // Once the receiver reported, the pages are spare (kept for sends), still not moved.
  pool->SettleExport(exported.chunks, /*released=*/true);
  void* f = Alloc(*pool, 16 * kMiB);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(pool->GetStats().num_chunk_moves, 2);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(ReclaimTest, AFreeBlockAnotherStreamMayStillUseIsNotMoved) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  {
    auto gate = std::make_unique<StreamGate>(driver_, t);
    // a: freed while t still uses it (record_stream); c: freed on busy t itself.
    void* a = Alloc(*pool, 8 * kMiB, s);
    void* b = Alloc(*pool, 4 * kMiB, s);
    void* c = Alloc(*pool, 8 * kMiB, t);
    void* d = Alloc(*pool, 4 * kMiB, s);
    ASSERT_OK(pool->RecordStream(a, t));
    ASSERT_OK(pool->Free(a));
    ASSERT_OK(pool->Free(c));
    const PoolStats before = pool->GetStats();
    void* e = Alloc(*pool, 16 * kMiB, s);
    ASSERT_NE(e, nullptr);
    PoolStats after = pool->GetStats();
    EXPECT_EQ(after.num_chunk_moves, 0) << "t's work may still use a and c";
    EXPECT_EQ(after.driver_unmap, before.driver_unmap);
    EXPECT_EQ(after.driver_create - before.driver_create, 4);
    EXPECT_OK(pool->CheckInvariants());
    // Once t is done, the next miss takes them: c's pages (now for every stream) as they are,
    // a's (back on s, the requester's own) after synchronising s.
    gate->Release();
    ASSERT_OK(driver_->SynchronizeStream(t));
    void* f = Alloc(*pool, 16 * kMiB, s);
    ASSERT_NE(f, nullptr);
    after = pool->GetStats();
    EXPECT_EQ(after.num_chunk_moves, 4);
    EXPECT_EQ(after.num_sync_stream, 1);
    EXPECT_EQ(after.driver_create - before.driver_create, 4);
    EXPECT_OK(pool->CheckInvariants());
    for (void* p : {b, d, e, f}) ASSERT_OK(pool->Free(p));
  }
  ASSERT_OK(driver_->DestroyStream(s));
  ASSERT_OK(driver_->DestroyStream(t));
}

TEST_F(ReclaimTest, AKeepingPoolMovesNothing) {
  auto pool = MakePool();
  pool->SetKeepMemory(true);
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  ASSERT_OK(pool->Free(h.c));
  void* e = Alloc(*pool, 16 * kMiB);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(pool->GetStats().num_chunk_moves, 0);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(40 * kMiB));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(ReclaimTest, TheCachedPathMakesNoDriverCall) {
  auto pool = MakePool();
  Holes h = MakeHoles(*pool);
  ASSERT_OK(pool->Free(h.a));
  const PoolStats before = pool->GetStats();
  for (int i = 0; i < 100; ++i) {
    void* p = Alloc(*pool, (i % 7 + 2) * kMiB);
    ASSERT_OK(pool->Free(p));
  }
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.driver_map, before.driver_map);
  EXPECT_EQ(after.driver_unmap, before.driver_unmap);
  EXPECT_EQ(after.driver_event, before.driver_event);
  EXPECT_EQ(after.num_sync_stream, before.num_sync_stream);
  EXPECT_EQ(after.num_chunk_moves, 0);
}

// The live blocks of a randomized test, each filled with a byte of its own; whether they
// still hold it after memory moved.
class FilledBlocks {
 public:
  FilledBlocks(Pool& pool, std::mt19937_64& rng) : pool_(pool), rng_(rng) {}
  ~FilledBlocks() { FreeMost(/*keep_one_in=*/0); }

  bool empty() const { return live_.empty(); }
  size_t bytes() const { return bytes_; }

  // Allocates `size` bytes and fills them; nullptr (and a test failure) if the pool cannot.
  void* Allocate(size_t size) {
    absl::StatusOr<void*> p = pool_.Allocate(size, 0);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    const auto value = static_cast<unsigned char>(1 + rng_() % 250);
    std::memset(*p, value, size);
    live_[*p] = Live{size, value};
    bytes_ += size;
    return *p;
  }
  // Frees one block, picked at random, after checking its bytes.
  void FreeOne() {
    auto it = live_.begin();
    std::advance(it, static_cast<long>(rng_() % live_.size()));
    Free(it);
  }
  // Frees every block but, at random, about one in `keep_one_in` (0: every block).
  void FreeMost(uint64_t keep_one_in) {
    for (auto it = live_.begin(); it != live_.end();) {
      auto next = std::next(it);
      if (keep_one_in == 0 || rng_() % keep_one_in != 0) Free(it);
      it = next;
    }
  }
  bool AllFilled() const {
    for (const auto& [p, l] : live_) {
      if (!Filled(p, l.size, l.value)) return false;
    }
    return true;
  }

 private:
  struct Live {
    size_t size;
    unsigned char value;
  };
  void Free(std::map<void*, Live>::iterator it) {
    EXPECT_TRUE(Filled(it->first, it->second.size, it->second.value));
    bytes_ -= it->second.size;
    EXPECT_OK(pool_.Free(it->first));
    live_.erase(it);
  }

  Pool& pool_;
  std::mt19937_64& rng_;
  std::map<void*, Live> live_;
  size_t bytes_ = 0;
};

// Random allocations and frees (some exported) under a memory limit: after every step the
// pool's invariants hold and every live block still holds the bytes written into it.
TEST_F(ReclaimTest, InvariantsAndContentsHoldThroughRandomSteps) {
  auto pool = MakePool();
  pool->SetMemoryLimit(200 * kMiB);
  std::mt19937_64 rng(42);
  FilledBlocks blocks(*pool, rng);
  int64_t moves_seen = 0;
  for (int step = 0; step < 3000; ++step) {
    if (blocks.empty() || (rng() % 100 < 55 && blocks.bytes() < 120 * kMiB)) {
      const size_t size = rng() % 4 == 0 ? 512 * (1 + rng() % 1024)
                                         : (1 + rng() % (24 * kMiB / 512)) * 512;
      void* p = blocks.Allocate(size);
      ASSERT_NE(p, nullptr) << "step " << step;
      if (rng() % 50 == 0) {
        ASSERT_OK(pool->Export(p).status());
      }
    } else {
      blocks.FreeOne();
    }
    ASSERT_FALSE(HasFailure()) << "step " << step;
    ASSERT_OK(pool->CheckInvariants()) << "step " << step;
    const int64_t moves = pool->GetStats().num_chunk_moves;
    if (moves != moves_seen) {
      // Memory moved: every live block must still hold its bytes.
      ASSERT_TRUE(blocks.AllFilled()) << "step " << step;
      moves_seen = moves;
    }
  }
  EXPECT_GT(moves_seen, 0);
  blocks.FreeMost(/*keep_one_in=*/0);
  EXPECT_OK(pool->CheckInvariants());
}

// Phases of small blocks and of large ones, each freeing most of what the other left: memory
// moves both ways between the arenas, and the bookkeeping and every live block's bytes hold.
TEST_F(ReclaimTest, InvariantsAndContentsHoldAsMemoryMovesBetweenTheArenas) {
  auto pool = MakePool();
  pool->SetMemoryLimit(160 * kMiB);
  std::mt19937_64 rng(7);
  FilledBlocks blocks(*pool, rng);
  int small_gave = 0;  // steps whose moves shrank the small arena
  int small_took = 0;  // small-arena growths that created nothing
  for (int phase = 0; phase < 12; ++phase) {
    const bool small_phase = phase % 2 == 0;
    for (int step = 0; step < 400; ++step) {
      const PoolStats before = pool->GetStats();
      if (blocks.empty() || (rng() % 100 < 60 && blocks.bytes() < 100 * kMiB)) {
        const size_t size = small_phase ? 512 * (1 + rng() % 512)
                                        : (1 + rng() % (12 * kMiB / 512)) * 512;
        ASSERT_NE(blocks.Allocate(size), nullptr) << "phase " << phase << " step " << step;
      } else {
        blocks.FreeOne();
      }
      ASSERT_FALSE(HasFailure()) << "phase " << phase << " step " << step;
      ASSERT_OK(pool->CheckInvariants()) << "phase " << phase << " step " << step;
      const PoolStats after = pool->GetStats();
      ExpectArenasAddUp(after);
      const int64_t small_before = before.arena[kSmallArena].reserved_bytes.current;
      const int64_t small_after = after.arena[kSmallArena].reserved_bytes.current;
      if (small_after < small_before && after.num_chunk_moves > before.num_chunk_moves) {
        ++small_gave;
      }
      if (small_after > small_before && after.driver_create == before.driver_create) {
        ++small_took;
      }
      if (after.num_chunk_moves != before.num_chunk_moves) {
        ASSERT_TRUE(blocks.AllFilled()) << "phase " << phase << " step " << step;
      }
    }
    blocks.FreeMost(/*keep_one_in=*/10);  // the phase ends: most of its blocks go
    ASSERT_OK(pool->CheckInvariants()) << "end of phase " << phase;
  }
  EXPECT_GT(small_gave, 0);
  EXPECT_GT(small_took, 0);
  blocks.FreeMost(/*keep_one_in=*/0);
  EXPECT_OK(pool->CheckInvariants());
}

}  // namespace
}  // namespace vmm
