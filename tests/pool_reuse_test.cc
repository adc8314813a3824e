// Reusing exported chunks (pool.h, "Reusing exported chunks"): a block exported for a tracked
// send is parked when freed, kept spare once its receivers report, and handed to the next
// shareable block without a driver call and under a fresh id; untracked exports, forwarded
// sends and spare_export_bytes=0 release instead; EmptyCache and a failing growth give spare
// chunks back; SendBytesInUse counts what sends hold. The pool's invariants are checked after
// every step. Runs on the backend of tests/test_backend.h.
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "allocator/driver.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gmock/gmock.h"
#include "allocator/forwarding_driver.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/status_matchers.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr size_t kMiB = size_t{1} << 20;

// Records what a pool tells its observer: releases and renames (ChunkRenamed overridden).
class ReuseObserver : public ExportObserver {
 public:
  struct Rename {
    uint64_t old_id, new_id;
    bool operator==(const Rename& o) const { return old_id == o.old_id && new_id == o.new_id; }
  };
  void ChunkReleased(uint64_t, uint64_t chunk_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    released_.push_back(chunk_id);
  }
  void ChunkRenamed(uint64_t, uint64_t old_id, uint64_t new_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    renamed_.push_back({old_id, new_id});
  }
  void PoolDestroyed(uint64_t) override {}
  std::vector<uint64_t> released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }
  std::vector<Rename> renamed() {
    std::lock_guard<std::mutex> lock(mu_);
    return renamed_;
  }

 private:
  std::mutex mu_;
  std::vector<uint64_t> released_;
  std::vector<Rename> renamed_;
};

void PrintTo(const ReuseObserver::Rename& r, std::ostream* os) {
  *os << r.old_id << " -> " << r.new_id;
}

// An observer that keeps ExportObserver's default ChunkRenamed (a release of the old id).
class ReleasesOnlyObserver : public ExportObserver {
 public:
  void ChunkReleased(uint64_t, uint64_t chunk_id) override { released.push_back(chunk_id); }
  void PoolDestroyed(uint64_t) override {}
  std::vector<uint64_t> released;
};

class PoolReuseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(driver_, TestDriver(HostDriverOptions{2 * kMiB, 256 * kMiB}, &owned_));
  }

  // Exact growth (reserved bytes predictable), sends in place unless `isolate_sends`.
  static PoolOptions Exact(bool isolate_sends = false) {
    PoolOptions options = SingleChunkOptions();
    options.growth_fraction = 0;
    options.reserve_size = 1024 * kMiB;
    options.isolate_sends = isolate_sends;
    return options;
  }

  // A pool observed by observer_; skips the test where memory is not exportable.
  std::unique_ptr<Pool> MakePool(PoolOptions options = Exact(), Driver* driver = nullptr,
                                 ExportObserver* observer = nullptr) {
    std::unique_ptr<Pool> pool = CreatePoolOrFail(driver != nullptr ? driver : driver_, options,
                                                  observer != nullptr ? observer : &observer_);
    if (pool == nullptr || pool->handle_type() == HandleType::kNone) return nullptr;
    return pool;
  }

  static void* Shareable(Pool& pool, size_t size) {
    absl::StatusOr<void*> p = pool.AllocateShareable(size, 0);
    EXPECT_OK(p);
    return p.ok() ? *p : nullptr;
  }

  // A shareable block of `size` sent once, freed and reported released by its receiver (so
  // its chunk is spare, where it fits); its address.
  static void* MakeSpare(Pool& pool, size_t size) {
    void* p = Shareable(pool, size);
    const std::vector<ExportedChunk> sent = Send(pool, p);
    EXPECT_OK(pool.Free(p));
    pool.SettleExport(sent, true);
    return p;
  }

  // Exports the block at `p` for one tracked send; its chunks.
  static std::vector<ExportedChunk> Send(Pool& pool, void* p) {
    absl::StatusOr<ExportedBlock> e =
        pool.Export(p, HandleType::kNone, ExportNeighbours::kAllow, ExportUse::kTracked);
    EXPECT_OK(e);
    return e.ok() ? e->chunks : std::vector<ExportedChunk>{};
  }

  static int64_t Reserved(const Pool& pool) { return pool.GetStats().reserved_bytes.current; }

  std::unique_ptr<Driver> owned_;
  Driver* driver_ = nullptr;
  ReuseObserver observer_;
};

#define SKIP_IF_NOT_EXPORTABLE(pool) \
  if ((pool) == nullptr) GTEST_SKIP() << "memory is not exportable here"

TEST_F(PoolReuseTest, EmptyCacheReleasesAParkedChunkAndItsLateReportIsIgnored) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 3 * kMiB);
  const std::vector<ExportedChunk> sent = Send(*pool, p);
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(4 * kMiB)) << "parked";
  // Given up: memory is asked back (its receiver keeps its own reference to the memory).
  ASSERT_OK(pool->EmptyCache());
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_THAT(observer_.released(), ElementsAre(sent[0].id));
  pool->SettleExport(sent, /*released=*/true);  // the receiver's late report: nothing to do
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 0);
}

TEST_F(PoolReuseTest, AFreedTrackedSendIsParkedThenSpareThenReusedUnderANewId) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 3 * kMiB);
  const std::vector<ExportedChunk> first = Send(*pool, p);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].size, 4 * kMiB);
  const PoolStats before_free = pool->GetStats();

  // Freed while its receiver maps it: parked (mapped, reserved, no driver call).
  ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(s.driver_unmap, before_free.driver_unmap);
  EXPECT_EQ(s.driver_release, before_free.driver_release);
  EXPECT_EQ(s.num_device_free, before_free.num_device_free);
  EXPECT_EQ(s.allocated_bytes.current, 0);
  EXPECT_THAT(observer_.released(), IsEmpty());
  EXPECT_EQ(pool->SendBytesInUse(), 4 * kMiB) << "a parked chunk is held by its send";

  // The receiver reports it unmapped the memory: spare, still mapped, no longer a send's.
  pool->SettleExport(first, /*released=*/true);
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(pool->SendBytesInUse(), 0u) << "a spare chunk is nobody's send";
  EXPECT_THAT(observer_.released(), IsEmpty());

  // The next shareable block that fits takes it: no driver call, a fresh id.
  const PoolStats before_reuse = pool->GetStats();
  void* q = Shareable(*pool, 2 * kMiB);
  EXPECT_EQ(q, p) << "the spare chunk, from its start";
  EXPECT_OK(pool->CheckInvariants());
  s = pool->GetStats();
  EXPECT_EQ(s.driver_create, before_reuse.driver_create);
  EXPECT_EQ(s.driver_map, before_reuse.driver_map);
  EXPECT_EQ(s.driver_set_access, before_reuse.driver_set_access);
  EXPECT_EQ(s.num_device_alloc, before_reuse.num_device_alloc);
  EXPECT_EQ(s.num_export_reuses, before_reuse.num_export_reuses + 1);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(s.allocated_bytes.current, static_cast<int64_t>(2 * kMiB));
  ASSERT_EQ(observer_.renamed().size(), 1u);
  const ReuseObserver::Rename rename = observer_.renamed()[0];
  EXPECT_EQ(rename.old_id, first[0].id);
  EXPECT_NE(rename.new_id, first[0].id);
  EXPECT_THAT(observer_.released(), IsEmpty()) << "renamed, not released";

  const std::vector<ExportedChunk> second = Send(*pool, q);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].addr, first[0].addr);
  EXPECT_EQ(second[0].size, first[0].size);
  EXPECT_EQ(second[0].id, rename.new_id) << "a later export names the chunk by its new id";
  EXPECT_EQ(pool->SendBytesInUse(), 4 * kMiB);

  ASSERT_OK(pool->Free(q));
  pool->SettleExport(second, /*released=*/true);
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  ASSERT_EQ(observer_.renamed().size(), 2u) << "renamed again when spare again";
  EXPECT_EQ(observer_.renamed()[1].old_id, rename.new_id);
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0) << "EmptyCache releases spare chunks";
  EXPECT_THAT(observer_.released(), ElementsAre(observer_.renamed()[1].new_id));
  EXPECT_OK(pool->CheckInvariants());
}

// The rest of a reused chunk is as retired as the slack of a fresh shareable block: no other
// block lands in it.
TEST_F(PoolReuseTest, TheRestOfAReusedChunkIsNeverHandedOut) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = MakeSpare(*pool, 6 * kMiB);
  void* q = Shareable(*pool, 4 * kMiB);  // 2 MiB of the chunk left: one granule
  ASSERT_EQ(q, p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 1);
  EXPECT_OK(pool->CheckInvariants());
  const auto start = reinterpret_cast<uintptr_t>(q);
  std::vector<void*> others;
  for (size_t size : {size_t{4096}, kMiB, kMiB + 4096, 2 * kMiB}) {
    absl::StatusOr<void*> o = pool->Allocate(size, 0);
    ASSERT_OK(o);
    const auto at = reinterpret_cast<uintptr_t>(*o);
    EXPECT_FALSE(at >= start && at < start + 6 * kMiB) << size << " bytes landed in the chunk";
    others.push_back(*o);
  }
  absl::StatusOr<bool> shares = pool->SharesChunks(q);
  ASSERT_OK(shares);
  EXPECT_FALSE(*shares);
  for (void* o : others) ASSERT_OK(pool->Free(o));
  ASSERT_OK(pool->Free(q));
  EXPECT_OK(pool->CheckInvariants());
}

// A spare chunk that a plain Export left (not dedicated) and a small send then reuses holds
// that block alone: its report keeps the chunk marked, so no other block lands in it.
TEST_F(PoolReuseTest, ASpareChunkReusedForASmallSendKeepsItsMark) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  absl::StatusOr<void*> a = pool->Allocate(2 * kMiB, 0);
  ASSERT_OK(a);
  const std::vector<ExportedChunk> first = Send(*pool, *a);
  ASSERT_OK(pool->Free(*a));
  pool->SettleExport(first, /*released=*/true);
  void* s = Shareable(*pool, 4096);
  ASSERT_EQ(s, *a) << "the spare chunk serves the send";
  const std::vector<ExportedChunk> second = Send(*pool, s);
  pool->SettleExport(second, /*released=*/true);
  absl::StatusOr<void*> b = pool->Allocate(kMiB + kMiB / 2, 0);
  ASSERT_OK(b);
  const auto at = reinterpret_cast<uintptr_t>(*b);
  const auto start = reinterpret_cast<uintptr_t>(s);
  EXPECT_FALSE(at >= start && at < start + 2 * kMiB) << "a block landed beside the send";
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(s));
  ASSERT_OK(pool->Free(*b));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, ASpareChunkTooSmallIsReleasedBeforeTheSendGrowsPastTwiceTheHigh) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  MakeSpare(*pool, 2 * kMiB);
  const size_t released_before = observer_.released().size();
  const PoolStats before = pool->GetStats();
  // No spare chunk fits a send of 6 MiB, and keeping the 2 MiB one beside it would take the
  // pool's spare chunks and that growth past twice the most it has had allocated (2 MiB):
  // the spare one goes back first.
  void* big = Shareable(*pool, 6 * kMiB);
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_export_reuses, before.num_export_reuses);
  EXPECT_GT(s.driver_create, before.driver_create);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(6 * kMiB)) << "the spare one went";
  EXPECT_EQ(observer_.released().size(), released_before + 1);
  ASSERT_OK(pool->Free(big));
  EXPECT_OK(pool->CheckInvariants());
}

// Within that, a spare chunk too small for a send stays for a later send it fits.
TEST_F(PoolReuseTest, ASpareChunkTooSmallStaysWithinTwiceTheHigh) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  absl::StatusOr<void*> plain = pool->Allocate(4 * kMiB, 0);  // the high: 4 MiB
  ASSERT_OK(plain);
  ASSERT_OK(pool->Free(*plain));
  ASSERT_OK(pool->EmptyCache());
  void* p = MakeSpare(*pool, 2 * kMiB);
  const PoolStats before = pool->GetStats();
  void* big = Shareable(*pool, 2 * kMiB + 4096);  // with the spare one, within 8 MiB
  EXPECT_NE(big, p);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(6 * kMiB))
      << "the spare one stays";
  void* fits = Shareable(*pool, 2 * kMiB);
  EXPECT_EQ(fits, p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, before.num_export_reuses + 1);
  for (void* b : {big, fits}) ASSERT_OK(pool->Free(b));
  EXPECT_OK(pool->CheckInvariants());
}

// Sends of varying sizes, each received and released before the next batch: the pool stays
// near what the batches need (before: each spare chunk waited for a send of its own size, and
// reserved memory grew without bound, 2.8-4.4 GiB after 200 batches of at most 64 MiB).
TEST_F(PoolReuseTest, SendsOfVaryingSizesDoNotGrowThePoolWithoutBound) {
  for (bool isolate : {false, true}) {
    SCOPED_TRACE(isolate ? "isolated sends" : "sends in place");
    PoolOptions options = Exact(isolate);
    options.growth_fraction = 0.05;  // the default: growth follows what the pool holds
    auto pool = MakePool(options);
    SKIP_IF_NOT_EXPORTABLE(pool);
    std::mt19937 rng(0);
    std::uniform_int_distribution<size_t> size(kMiB, 8 * kMiB);
    for (int batch = 0; batch < 200; ++batch) {
      std::vector<void*> blocks;
      std::vector<std::vector<ExportedChunk>> sent;
      for (int i = 0; i < 8; ++i) {
        const size_t n = size(rng) / 4096 * 4096;
        blocks.push_back(isolate ? Shareable(*pool, n) : pool->Allocate(n, 0).value_or(nullptr));
        ASSERT_NE(blocks.back(), nullptr);
        sent.push_back(Send(*pool, blocks.back()));
      }
      for (void* b : blocks) ASSERT_OK(pool->Free(b));
      for (const auto& chunks : sent) pool->SettleExport(chunks, /*released=*/true);
    }
    EXPECT_OK(pool->CheckInvariants());
    const PoolStats s = pool->GetStats();
    EXPECT_LE(s.reserved_bytes.current, 4 * s.allocated_bytes.peak) << s.reserved_bytes.current;
  }
}

// An ordinary allocation of the large arena that fills a spare chunk closely (at most an
// eighth of the request, or a granule, left over) takes it before growing, as plain memory
// again: not exported, its free rest handed out, its frees on the cached path (no event, no
// rename). A later send of a block there exports the chunk again.
TEST_F(PoolReuseTest, AnAllocationThatFillsASpareChunkCloselyTakesItAsPlainMemory) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = MakeSpare(*pool, 6 * kMiB);
  const size_t renames = observer_.renamed().size();
  const PoolStats before = pool->GetStats();
  absl::StatusOr<void*> q = pool->Allocate(4 * kMiB, 0);  // 2 MiB left over: one granule
  ASSERT_OK(q);
  EXPECT_EQ(*q, p);
  EXPECT_OK(pool->CheckInvariants());
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.driver_create, before.driver_create);
  EXPECT_EQ(s.driver_map, before.driver_map);
  EXPECT_EQ(s.num_export_reuses, before.num_export_reuses + 1);
  EXPECT_EQ(s.exported_chunks.current, before.exported_chunks.current - 1);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(6 * kMiB));
  // The rest is plain free memory: the next request that fits gets it, without growing.
  absl::StatusOr<void*> beside = pool->Allocate(kMiB + 4096, 0);  // of the large arena
  ASSERT_OK(beside);
  const auto start = reinterpret_cast<uintptr_t>(p);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*beside), start + 4 * kMiB);
  EXPECT_EQ(pool->GetStats().driver_create, before.driver_create);
  // Frees on the cached path: no event, no rename; the memory stays cached.
  ASSERT_OK(pool->Free(*beside));
  ASSERT_OK(pool->Free(*q));
  EXPECT_OK(pool->CheckInvariants());
  s = pool->GetStats();
  EXPECT_EQ(s.driver_event, before.driver_event);
  EXPECT_EQ(observer_.renamed().size(), renames);
  EXPECT_THAT(observer_.released(), IsEmpty());
  // Sent again: exported again (the observer's cached handle serves it), parked, then spare.
  absl::StatusOr<void*> again = pool->Allocate(6 * kMiB, 0);
  ASSERT_OK(again);
  EXPECT_EQ(*again, p);
  const std::vector<ExportedChunk> sent = Send(*pool, *again);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].addr, start);
  ASSERT_OK(pool->Free(*again));
  pool->SettleExport(sent, /*released=*/true);
  EXPECT_OK(pool->CheckInvariants());
  void* shareable = Shareable(*pool, 5 * kMiB);
  EXPECT_EQ(shareable, p) << "spare again, for a send";
  ASSERT_OK(pool->Free(shareable));
  // Released, the observer hears of it, though the chunk was plain memory for a while.
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_FALSE(observer_.released().empty());
  EXPECT_OK(pool->CheckInvariants());
}

// The free rest of a spare chunk taken as plain memory joins the free block beside it: the
// two make one block that a request larger than either part gets without growing.
TEST_F(PoolReuseTest, TheRestOfASpareChunkTakenAsPlainMemoryJoinsItsFreeNeighbour) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = MakeSpare(*pool, 6 * kMiB);
  // Its own chunk just above the spare one (which it does not fit), live while a request of
  // 5 MiB takes the spare chunk as plain memory, then freed.
  absl::StatusOr<void*> above = pool->Allocate(8 * kMiB, 0);
  ASSERT_OK(above);
  const auto start = reinterpret_cast<uintptr_t>(p);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(*above), start + 6 * kMiB);
  absl::StatusOr<void*> q = pool->Allocate(5 * kMiB, 0);
  ASSERT_OK(q);
  EXPECT_EQ(*q, p) << "the spare chunk";
  ASSERT_OK(pool->Free(*above));
  EXPECT_OK(pool->CheckInvariants());
  const PoolStats before = pool->GetStats();
  absl::StatusOr<void*> joined = pool->Allocate(9 * kMiB, 0);  // 1 MiB rest + 8 MiB beside
  ASSERT_OK(joined);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*joined), start + 5 * kMiB);
  EXPECT_EQ(pool->GetStats().driver_create, before.driver_create) << "no growth";
  ASSERT_OK(pool->Free(*joined));
  ASSERT_OK(pool->Free(*q));
  EXPECT_OK(pool->CheckInvariants());
}

// A small send does not take a spare chunk much larger than itself: it would hold the whole
// chunk, and its receiver would map all of it.
TEST_F(PoolReuseTest, ASmallSendLeavesALargeSpareChunk) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = MakeSpare(*pool, 64 * kMiB);
  const PoolStats before = pool->GetStats();
  void* small = Shareable(*pool, 4096);
  EXPECT_NE(small, p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, before.num_export_reuses);
  absl::StatusOr<void*> big = pool->Allocate(64 * kMiB, 0);
  ASSERT_OK(big);
  EXPECT_EQ(*big, p);
  for (void* b : {small, *big}) ASSERT_OK(pool->Free(b));
  EXPECT_OK(pool->CheckInvariants());
}

// A release threshold counts spare chunks as cached memory and releases them first.
TEST_F(PoolReuseTest, AReleaseThresholdReleasesSpareChunks) {
  PoolOptions options = Exact();
  options.release_threshold = 4 * kMiB;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  MakeSpare(*pool, 16 * kMiB);
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(16 * kMiB)) << "spare after the report";
  // The next free applies the threshold.
  absl::StatusOr<void*> q = pool->Allocate(2 * kMiB, 0);
  ASSERT_OK(q);
  ASSERT_OK(pool->Free(*q));
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_LE(Reserved(*pool), static_cast<int64_t>(4 * kMiB));
  EXPECT_FALSE(observer_.released().empty());
}

// An ordinary allocation much smaller than the one spare chunk grows instead (the chunk stays
// for a later send of its size) while the spare chunks and the request are within twice the
// most the pool has had allocated.
TEST_F(PoolReuseTest, AnAllocationMuchSmallerThanASpareChunkGrowsWithinTwiceTheHigh) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = MakeSpare(*pool, 32 * kMiB);
  const PoolStats before = pool->GetStats();
  absl::StatusOr<void*> q = pool->Allocate(8 * kMiB, 0);  // 24 MiB would be left over
  ASSERT_OK(q);
  EXPECT_NE(*q, p);
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_export_reuses, before.num_export_reuses);
  EXPECT_GT(s.driver_create, before.driver_create);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(40 * kMiB));
  ASSERT_OK(pool->Free(*q));
  EXPECT_OK(pool->CheckInvariants());
}

// Past that, it takes the smallest spare chunk it fits, as plain memory, rather than grow
// beside idle ones: blocks of 32, 40 and 48 MiB, each sent in place, freed and released by
// its receiver in turn, leave 120 MiB of spare chunks after a high of 48 MiB.
TEST_F(PoolReuseTest, AnAllocationMuchSmallerThanASpareChunkTakesItPastTwiceTheHigh) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* first = nullptr;
  for (size_t mib : {32, 40, 48}) {
    absl::StatusOr<void*> b = pool->Allocate(mib * kMiB, 0);
    ASSERT_OK(b);
    if (first == nullptr) first = *b;
    const std::vector<ExportedChunk> sent = Send(*pool, *b);
    ASSERT_OK(pool->Free(*b));
    pool->SettleExport(sent, /*released=*/true);
  }
  ASSERT_EQ(Reserved(*pool), static_cast<int64_t>(120 * kMiB));
  const PoolStats before = pool->GetStats();
  absl::StatusOr<void*> q = pool->Allocate(8 * kMiB, 0);
  ASSERT_OK(q);
  EXPECT_EQ(*q, first) << "the smallest spare chunk, 32 MiB";
  absl::StatusOr<void*> r = pool->Allocate(16 * kMiB, 0);  // from its rest
  ASSERT_OK(r);
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_export_reuses, before.num_export_reuses + 1);
  EXPECT_EQ(s.driver_create, before.driver_create);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(120 * kMiB));
  ASSERT_OK(pool->Free(*q));
  ASSERT_OK(pool->Free(*r));
  EXPECT_OK(pool->CheckInvariants());
}

// Without a cap (the default), a chunk of any size is kept spare: a send of 128 MiB, then an
// allocation of the same size, makes no driver call.
TEST_F(PoolReuseTest, ALargeSendsChunkIsKeptSpareByDefault) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  ASSERT_EQ(pool->options().spare_export_bytes, SIZE_MAX);
  void* p = MakeSpare(*pool, 128 * kMiB);
  EXPECT_THAT(observer_.released(), IsEmpty());
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(128 * kMiB));
  const PoolStats before = pool->GetStats();
  absl::StatusOr<void*> q = pool->Allocate(128 * kMiB, 0);
  ASSERT_OK(q);
  EXPECT_EQ(*q, p);
  EXPECT_EQ(pool->GetStats().driver_create, before.driver_create);
  ASSERT_OK(pool->Free(*q));
  // Cached memory: EmptyCache gives it back.
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, AnUntrackedExportIsReleasedOnFree) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB) << "a block moved for a send";
  ASSERT_OK_AND_ASSIGN(ExportedBlock e, pool->Export(p));  // kUntracked by default
  EXPECT_EQ(pool->SendBytesInUse(), 0u) << "importers nobody counts are no send's";
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_THAT(observer_.released(), ElementsAre(e.chunks[0].id));
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  void* q = Shareable(*pool, 2 * kMiB);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 0);
  EXPECT_THAT(observer_.renamed(), IsEmpty());
  ASSERT_OK(pool->Free(q));
  EXPECT_OK(pool->CheckInvariants());
}

// Once exported untracked, a chunk stays untracked: a tracked send of it and its report do
// not make it reusable.
TEST_F(PoolReuseTest, AnUntrackedExportWinsOverATrackedOne) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> sent = Send(*pool, p);
  ASSERT_OK(pool->Export(p).status());
  pool->SettleExport(sent, true);
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_THAT(observer_.released(), ElementsAre(sent[0].id));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, ASettleThatIsNotAReleaseReleasesTheChunk) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  // Parked, then the send ends unreported (forwarded, or its lease ended): released.
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> first = Send(*pool, p);
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB));
  pool->SettleExport(first, /*released=*/false);
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_THAT(observer_.released(), ElementsAre(first[0].id));
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  EXPECT_OK(pool->CheckInvariants());
  // A report on a released chunk finds nothing.
  pool->SettleExport(first, true);
  pool->SettleExport(first, false);
  EXPECT_OK(pool->CheckInvariants());

  // Settled as not released while the block lives: released when freed.
  void* q = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> second = Send(*pool, q);
  pool->SettleExport(second, false);
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  ASSERT_OK(pool->Free(q));
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_THAT(observer_.released(), ElementsAre(first[0].id, second[0].id));
  EXPECT_EQ(pool->GetStats().num_export_reuses, 0);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, AReleaseReportedBeforeTheFreeMakesTheChunkSpareAtTheFree) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> sent = Send(*pool, p);
  pool->SettleExport(sent, true);  // the receiver was quick
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB) << "still live here";
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB));
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  EXPECT_EQ(Shareable(*pool, 2 * kMiB), p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 1);
  ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, EverySendOfAChunkMustReportBeforeItIsSpare) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> one = Send(*pool, p);
  const std::vector<ExportedChunk> two = Send(*pool, p);
  ASSERT_OK(pool->Free(p));
  pool->SettleExport(one, true);
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB) << "the second receiver still maps it";
  void* q = Shareable(*pool, 2 * kMiB);
  EXPECT_NE(q, p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 0);
  pool->SettleExport(two, true);
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB) << "only q's chunk now";
  void* r = Shareable(*pool, 2 * kMiB);
  EXPECT_EQ(r, p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 1);
  for (void* b : {q, r}) ASSERT_OK(pool->Free(b));
  EXPECT_OK(pool->CheckInvariants());
}

// A report of an earlier send of a chunk since reused names its old id: it changes nothing.
TEST_F(PoolReuseTest, AStaleSettleIsIgnored) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> old_send = Send(*pool, p);
  ASSERT_OK(pool->Free(p));
  pool->SettleExport(old_send, true);
  void* q = Shareable(*pool, 2 * kMiB);
  ASSERT_EQ(q, p);
  const std::vector<ExportedChunk> new_send = Send(*pool, q);
  ASSERT_NE(new_send[0].id, old_send[0].id);
  ASSERT_OK(pool->Free(q));
  // The old send's reports again: neither frees the parked chunk nor releases it.
  pool->SettleExport(old_send, true);
  pool->SettleExport(old_send, false);
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB) << "still parked for the new send";
  EXPECT_THAT(observer_.released(), IsEmpty());
  void* r = Shareable(*pool, 2 * kMiB);
  EXPECT_NE(r, p) << "a parked chunk was reused";
  EXPECT_OK(pool->CheckInvariants());
  pool->SettleExport(new_send, true);
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB) << "r's chunk only";
  ASSERT_OK(pool->Free(r));
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, SpareExportBytesZeroTurnsReuseOff) {
  PoolOptions options = Exact();
  options.spare_export_bytes = 0;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> sent = Send(*pool, p);
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(Reserved(*pool), 0) << "not parked: it could never be spare";
  EXPECT_THAT(observer_.released(), ElementsAre(sent[0].id));
  pool->SettleExport(sent, true);  // the late report finds nothing
  EXPECT_EQ(Reserved(*pool), 0);
  const PoolStats before = pool->GetStats();
  void* q = Shareable(*pool, 2 * kMiB);
  EXPECT_EQ(pool->GetStats().driver_create, before.driver_create + 1);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 0);
  ASSERT_OK(pool->Free(q));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, AChunkLargerThanSpareExportBytesIsReleasedOnceFreeNotParked) {
  PoolOptions options = Exact();
  options.spare_export_bytes = 4 * kMiB;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* big = Shareable(*pool, 6 * kMiB);
  void* small = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> big_send = Send(*pool, big);
  const std::vector<ExportedChunk> small_send = Send(*pool, small);
  ASSERT_OK(pool->Free(big));
  ASSERT_OK(pool->Free(small));
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB)) << "only the small one parked";
  EXPECT_THAT(observer_.released(), ElementsAre(big_send[0].id));
  pool->SettleExport(big_send, true);
  pool->SettleExport(small_send, true);
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB)) << "the small one spare";
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, SpareChunksStopAtSpareExportBytes) {
  PoolOptions options = Exact();
  options.spare_export_bytes = 4 * kMiB;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* a = Shareable(*pool, 4 * kMiB);
  void* b = Shareable(*pool, 4 * kMiB);
  const std::vector<ExportedChunk> sa = Send(*pool, a);
  const std::vector<ExportedChunk> sb = Send(*pool, b);
  ASSERT_OK(pool->Free(a));
  ASSERT_OK(pool->Free(b));
  pool->SettleExport(sa, true);
  pool->SettleExport(sb, true);
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(4 * kMiB)) << "one kept, one released";
  EXPECT_THAT(observer_.released(), ElementsAre(sb[0].id));
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, SendBytesInUseCountsLiveAndParkedSendsOnly) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  void* plain = pool->Allocate(6 * kMiB, 0).value_or(nullptr);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(pool->SendBytesInUse(), 0u) << "nothing exported";
  void* live = Shareable(*pool, 2 * kMiB);
  void* parked = Shareable(*pool, 4 * kMiB);
  void* spare = Shareable(*pool, 8 * kMiB);
  void* untracked = Shareable(*pool, 16 * kMiB);
  const std::vector<ExportedChunk> live_send = Send(*pool, live);
  const std::vector<ExportedChunk> parked_send = Send(*pool, parked);
  const std::vector<ExportedChunk> spare_send = Send(*pool, spare);
  ASSERT_OK(pool->Export(untracked).status());
  EXPECT_EQ(pool->SendBytesInUse(), (2 + 4 + 8) * kMiB);
  ASSERT_OK(pool->Free(parked));
  ASSERT_OK(pool->Free(spare));
  pool->SettleExport(spare_send, true);
  EXPECT_EQ(pool->SendBytesInUse(), (2 + 4) * kMiB);
  ASSERT_OK(pool->Free(untracked));
  EXPECT_EQ(pool->SendBytesInUse(), (2 + 4) * kMiB);
  // A plain block exported for a send counts its chunk too.
  ASSERT_OK(pool->Export(plain, HandleType::kNone, ExportNeighbours::kAllow, ExportUse::kTracked)
                .status());
  EXPECT_EQ(pool->SendBytesInUse(), (6 + 2 + 4) * kMiB);
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(live));
  ASSERT_OK(pool->Free(plain));
  pool->SettleExport(live_send, true);
  pool->SettleExport(parked_send, true);
  // Spare now: 8 (kept first), then 2 and 4 (no cap by default); the plain chunk is
  // parked for its send, which never reports here.
  EXPECT_EQ(pool->SendBytesInUse(), 6 * kMiB);
  // EmptyCache gives up on it too (its receiver keeps its own reference).
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_OK(pool->CheckInvariants());
}

// A chunk only marked for a send (PrepareSend's kMark) has no receiver to wait for: spare once
// its block is freed.
TEST_F(PoolReuseTest, AMarkedChunkIsSpareOnceFree) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = pool->Allocate(4 * kMiB, 0).value_or(nullptr);
  ASSERT_NE(p, nullptr);
  ASSERT_OK(pool->Export(p, HandleType::kNone, ExportNeighbours::kRefuse, ExportUse::kMark)
                .status());
  EXPECT_EQ(pool->SendBytesInUse(), 4 * kMiB);
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(Shareable(*pool, 3 * kMiB), p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 1);
  ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A growth that fails for lack of memory (here the pool's memory limit) gives the spare chunks
// back before it fails: the request that needed the room succeeds.
TEST_F(PoolReuseTest, AFailedGrowthReleasesSpareChunksFirst) {
  PoolOptions options = Exact();
  options.memory_limit = 8 * kMiB;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  // Two spare chunks of 4 MiB (both sent at once: a later one would reuse the first).
  void* a = Shareable(*pool, 4 * kMiB);
  void* b = Shareable(*pool, 4 * kMiB);
  const std::vector<ExportedChunk> sa = Send(*pool, a);
  const std::vector<ExportedChunk> sb = Send(*pool, b);
  for (void* p : {a, b}) ASSERT_OK(pool->Free(p));
  pool->SettleExport(sa, true);
  pool->SettleExport(sb, true);
  // Spare, and so renamed: released under their new ids.
  ASSERT_EQ(observer_.renamed().size(), 2u);
  const std::vector<uint64_t> ids = {observer_.renamed()[0].new_id,
                                     observer_.renamed()[1].new_id};
  ASSERT_EQ(Reserved(*pool), static_cast<int64_t>(8 * kMiB));
  ASSERT_EQ(pool->SendBytesInUse(), 0u);
  const PoolStats before = pool->GetStats();
  // No spare chunk holds 6 MiB, and growing by 6 MiB passes the limit until they go.
  void* big = Shareable(*pool, 6 * kMiB);
  ASSERT_NE(big, nullptr);
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_alloc_retries, before.num_alloc_retries + 1);
  EXPECT_EQ(s.num_ooms, before.num_ooms);
  EXPECT_EQ(s.num_export_reuses, before.num_export_reuses);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(6 * kMiB));
  EXPECT_THAT(observer_.released(), ::testing::UnorderedElementsAreArray(ids));
  EXPECT_EQ(pool->SendBytesInUse(), 6 * kMiB);
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(big));  // spare (never exported, no receiver to wait for)
  ASSERT_OK(pool->EmptyCache());
  ASSERT_EQ(Reserved(*pool), 0);

  // The same for a plain allocation.
  MakeSpare(*pool, 2 * kMiB);
  ASSERT_EQ(Reserved(*pool), static_cast<int64_t>(2 * kMiB));
  void* plain = pool->Allocate(8 * kMiB, 0).value_or(nullptr);
  EXPECT_NE(plain, nullptr) << "the spare chunk was not given back for the growth";
  EXPECT_EQ(Reserved(*pool), static_cast<int64_t>(8 * kMiB));
  if (plain != nullptr) {
    ASSERT_OK(pool->Free(plain));
  }
  EXPECT_OK(pool->CheckInvariants());
}

// Without ChunkRenamed of its own, an observer hears a chunk made spare (renamed) as the
// release of the old id (export_observer.h), and the pool's release of the new id later.
TEST_F(PoolReuseTest, AnObserverWithoutRenamesHearsAReleaseOfTheOldId) {
  ReleasesOnlyObserver observer;
  auto pool = MakePool(Exact(), nullptr, &observer);
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* p = Shareable(*pool, 2 * kMiB);
  const std::vector<ExportedChunk> first = Send(*pool, p);
  ASSERT_OK(pool->Free(p));
  EXPECT_THAT(observer.released, IsEmpty()) << "parked";
  pool->SettleExport(first, true);
  EXPECT_THAT(observer.released, ElementsAre(first[0].id)) << "spare: renamed";
  void* q = Shareable(*pool, 2 * kMiB);
  EXPECT_THAT(observer.released, ElementsAre(first[0].id));
  const std::vector<ExportedChunk> second = Send(*pool, q);
  ASSERT_OK(pool->Free(q));
  pool->SettleExport(second, false);
  EXPECT_THAT(observer.released, ElementsAre(first[0].id, second[0].id));
}

// A block of the small arena exported for a tracked send: its chunk may be kept, but a shareable
// block (of the large arena) must never be made of it.
TEST_F(PoolReuseTest, ASmallArenaChunkIsNeverTakenForAShareableBlock) {
  auto pool = MakePool();
  SKIP_IF_NOT_EXPORTABLE(pool);
  void* small = pool->Allocate(1000, 0).value_or(nullptr);
  ASSERT_NE(small, nullptr);
  ASSERT_TRUE(pool->InSmallArena(small));
  const std::vector<ExportedChunk> sent = Send(*pool, small);
  ASSERT_EQ(sent.size(), 1u);
  ASSERT_OK(pool->Free(small));
  pool->SettleExport(sent, true);
  EXPECT_OK(pool->CheckInvariants());
  void* shared = Shareable(*pool, 1000);
  ASSERT_NE(shared, nullptr);
  EXPECT_FALSE(pool->InSmallArena(shared));
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_OK(pool->Free(shared));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0);
  EXPECT_OK(pool->CheckInvariants());
}

// A driver that forwards to another and fails the next Unmap once told to.
class FlakyUnmapDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  void FailNextUnmap() { fail_unmap_ = true; }
  absl::Status Unmap(DevPtr p, size_t size) override {
    if (fail_unmap_.exchange(false)) return absl::InternalError("unmap failed (test)");
    return ForwardingDriver::Unmap(p, size);
  }

 private:
  std::atomic<bool> fail_unmap_{false};
};

// A release of spare chunks that fails part way (EmptyCache's error) loses none of them: a
// later EmptyCache releases them all, and none is left counted as a send's.
TEST_F(PoolReuseTest, SpareChunksLeftByAFailedReleaseAreReleasedLater) {
  FlakyUnmapDriver flaky(driver_);
  auto pool = MakePool(Exact(), &flaky);
  SKIP_IF_NOT_EXPORTABLE(pool);
  std::vector<void*> blocks;
  std::vector<std::vector<ExportedChunk>> sends;
  for (int i = 0; i < 3; ++i) blocks.push_back(Shareable(*pool, 2 * kMiB));
  for (void* p : blocks) sends.push_back(Send(*pool, p));
  for (void* p : blocks) ASSERT_OK(pool->Free(p));
  for (const auto& sent : sends) pool->SettleExport(sent, true);
  ASSERT_EQ(Reserved(*pool), static_cast<int64_t>(6 * kMiB));
  ASSERT_EQ(pool->SendBytesInUse(), 0u);
  flaky.FailNextUnmap();
  EXPECT_FALSE(pool->EmptyCache().ok());
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->SendBytesInUse(), 0u) << "a chunk left spare-but-lost counts as a send";
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0) << "a spare chunk was lost by the failed release";
  EXPECT_OK(pool->CheckInvariants());
}

// Threads send (allocate shareable, export tracked, free) while others report the sends,
// released or not, in any order; a monitor checks the invariants and trims the cache.
TEST_F(PoolReuseTest, ThreadsSendAndSettleConcurrently) {
  PoolOptions options = Exact();
  options.spare_export_bytes = 16 * kMiB;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  std::mutex mu;
  std::vector<std::vector<ExportedChunk>> unsettled;  // sends whose receiver has not reported
  std::atomic<bool> done{false};
  std::vector<std::thread> senders;
  for (int t = 0; t < 3; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<void*> p = pool->AllocateShareable((1 + (i + t) % 5) * 512 * 1024, 0);
        ASSERT_OK(p);
        absl::StatusOr<ExportedBlock> e =
            pool->Export(*p, HandleType::kNone, ExportNeighbours::kRefuse, ExportUse::kTracked);
        EXPECT_OK(e);
        EXPECT_OK(pool->Free(*p));
        if (e.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          unsettled.push_back(e->chunks);
        }
        // At most a few sends outstanding (parked chunks hold memory until reported).
        for (;;) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (unsettled.size() < 8) break;
          }
          std::this_thread::yield();
        }
      }
    });
  }
  // Reports come newest first; every seventh send was forwarded (settled as not released).
  std::thread settler([&] {
    size_t n = 0;
    for (;;) {
      std::vector<ExportedChunk> chunks;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (unsettled.empty()) {
          if (done.load()) return;
        } else {
          chunks = std::move(unsettled.back());
          unsettled.pop_back();
        }
      }
      if (chunks.empty()) {
        std::this_thread::yield();
        continue;
      }
      pool->SettleExport(chunks, ++n % 7 != 0);
    }
  });
  std::thread monitor([&] {
    int i = 0;
    while (!done.load()) {
      EXPECT_OK(pool->CheckInvariants());
      if (++i % 20 == 0) {
        EXPECT_OK(pool->EmptyCache());
      }
      std::this_thread::yield();
    }
  });
  for (std::thread& s : senders) s.join();
  done.store(true);
  settler.join();
  monitor.join();
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->SendBytesInUse(), 0u) << "every send settled";
  EXPECT_GT(pool->GetStats().num_export_reuses, 0);
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(Reserved(*pool), 0);
}

}  // namespace
// A chunk exported with live neighbours (a block sent in place, ExportNeighbours::kAllow)
// loses its mark when its last receiver reports: its retired space is free again, its
// neighbours untouched; a retired block that crosses into a chunk still exported keeps that
// part retired. Dedicated chunks, untracked exports and pools that isolate sends keep the
// mark (pool.h).
TEST_F(PoolReuseTest, AChunkWithLiveBlocksLosesItsMarkWhenItsLastReceiverReports) {
  PoolOptions options = Exact();
  options.small_size = 64 << 10;  // 1 MiB blocks in the large arena
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  // a [0, 3M) in chunk A [0, 4M); b [3M, 5M) across A and chunk B [4M, 6M); c [5M, 6M) in B.
  ASSERT_OK_AND_ASSIGN(void* a, pool->Allocate(3 * kMiB, 0));
  ASSERT_OK_AND_ASSIGN(void* b, pool->Allocate(2 * kMiB, 0));
  ASSERT_OK_AND_ASSIGN(void* c, pool->Allocate(kMiB, 0));
  auto at = [a](size_t offset) { return static_cast<void*>(static_cast<char*>(a) + offset); };
  ASSERT_EQ(b, at(3 * kMiB));
  ASSERT_EQ(c, at(5 * kMiB));
  const std::vector<ExportedChunk> sent_c = Send(*pool, c);
  const std::vector<ExportedChunk> sent_a = Send(*pool, a);
  ASSERT_EQ(sent_c.size(), 1u);
  ASSERT_EQ(sent_a.size(), 1u);
  ASSERT_EQ(sent_c[0].addr, reinterpret_cast<uintptr_t>(at(4 * kMiB)));
  ASSERT_OK(pool->Free(b));  // retired in both chunks, as one block
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->GetStats().exported_bytes.current, static_cast<int64_t>(6 * kMiB));

  pool->SettleExport(sent_c, /*released=*/true);
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->GetStats().exported_bytes.current, static_cast<int64_t>(4 * kMiB)) << "A";
  ASSERT_EQ(observer_.renamed().size(), 1u);
  EXPECT_EQ(observer_.renamed()[0].old_id, sent_c[0].id);
  EXPECT_THAT(observer_.released(), IsEmpty());
  const int64_t reserved = Reserved(*pool);
  ASSERT_OK_AND_ASSIGN(void* in_b, pool->Allocate(kMiB, 0));
  EXPECT_EQ(in_b, at(4 * kMiB)) << "B's part of b is free again; A's is still retired";
  ASSERT_OK_AND_ASSIGN(void* more, pool->Allocate(kMiB, 0));
  EXPECT_NE(more, at(3 * kMiB));
  EXPECT_GT(Reserved(*pool), reserved) << "grown: A's retired part is not handed out";

  pool->SettleExport(sent_a, /*released=*/true);
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->GetStats().exported_bytes.current, 0);
  // A's rest is free again (the best fit may first take the same size elsewhere).
  ASSERT_OK_AND_ASSIGN(void* one, pool->Allocate(kMiB, 0));
  ASSERT_OK_AND_ASSIGN(void* two, pool->Allocate(kMiB, 0));
  EXPECT_TRUE(one == at(3 * kMiB) || two == at(3 * kMiB));
  for (void* p : {a, c, in_b, more, one, two}) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A chunk of the small arena sent in place and then freed is parked while its receiver maps
// it, and is free small-arena memory again once the receiver reports: a stream of small sends
// reuses its chunks with no driver call. A pool that isolates sends releases it as before.
TEST_F(PoolReuseTest, ASmallChunkSentInPlaceIsParkedThenFreeAgain) {
  for (const bool isolate : {false, true}) {
    auto pool = MakePool(Exact(isolate));
    SKIP_IF_NOT_EXPORTABLE(pool);
    ASSERT_OK_AND_ASSIGN(void* p, pool->Allocate(4096, 0));
    ASSERT_TRUE(pool->InSmallArena(p));
    const int64_t reserved = Reserved(*pool);
    const std::vector<ExportedChunk> sent = Send(*pool, p);
    ASSERT_OK(pool->Free(p));
    EXPECT_OK(pool->CheckInvariants());
    if (isolate) {
      EXPECT_EQ(Reserved(*pool), 0) << "released once free";
      continue;
    }
    EXPECT_EQ(Reserved(*pool), reserved) << "parked";
    EXPECT_EQ(pool->SendBytesInUse(), static_cast<size_t>(reserved));
    ASSERT_OK_AND_ASSIGN(void* q, pool->Allocate(4096, 0));
    EXPECT_EQ(Reserved(*pool), 2 * reserved) << "nothing lands where the receiver sees it";
    ASSERT_OK(pool->Free(q));
    pool->SettleExport(sent, /*released=*/true);
    EXPECT_OK(pool->CheckInvariants());
    EXPECT_EQ(pool->GetStats().exported_bytes.current, 0);
    EXPECT_EQ(pool->SendBytesInUse(), 0u);
    EXPECT_EQ(Reserved(*pool), 2 * reserved) << "free memory again, not released";
    const PoolStats before = pool->GetStats();
    std::vector<void*> blocks;  // both chunks, filled
    for (int i = 0; i < 4; ++i) {
      ASSERT_OK_AND_ASSIGN(void* b, pool->Allocate(kMiB, 0));
      blocks.push_back(b);
    }
    EXPECT_THAT(blocks, ::testing::Contains(p)) << "the chunk is used again";
    EXPECT_EQ(pool->GetStats().driver_create, before.driver_create);
    for (void* b : blocks) ASSERT_OK(pool->Free(b));
    ASSERT_OK(pool->EmptyCache());
    EXPECT_EQ(Reserved(*pool), 0);
    EXPECT_OK(pool->CheckInvariants());
  }
}

// The space an export retired without waiting (free blocks of the exporting block's own
// stream: Pool::WaitForSpaceBeforeExport) comes back tagged with that stream, so that another
// stream reuses it only after that stream's work, as any free block of it.
TEST_F(PoolReuseTest, SpaceAnUnmarkedChunkReturnsIsTaggedWithTheExportingStream) {
  PoolOptions options = Exact();
  options.small_size = 64 << 10;
  auto pool = MakePool(options);
  SKIP_IF_NOT_EXPORTABLE(pool);
  constexpr Stream kStream = 7;
  ASSERT_OK_AND_ASSIGN(void* a, pool->Allocate(3 * kMiB, kStream));
  const uintptr_t rest = reinterpret_cast<uintptr_t>(a) + 3 * kMiB;  // free, of kStream
  const std::vector<ExportedChunk> sent = Send(*pool, a);
  pool->SettleExport(sent, /*released=*/true);
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->GetStats().exported_bytes.current, 0);
  std::optional<BlockInfo> found;
  for (const SegmentInfo& segment : pool->GetSnapshot().segments) {
    for (const BlockInfo& b : segment.blocks) {
      if (b.addr == rest) found = b;
    }
  }
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->state, BlockState::kFree);
  EXPECT_EQ(found->stream, kStream);
  ASSERT_OK(pool->Free(a));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolReuseTest, DedicatedUntrackedAndIsolatedChunksKeepTheirMark) {
  for (const bool isolate : {false, true}) {
    auto pool = MakePool(Exact(isolate));
    SKIP_IF_NOT_EXPORTABLE(pool);
    const size_t renames = observer_.renamed().size();
    // A shareable block keeps its chunk to itself.
    void* shared = Shareable(*pool, kMiB);
    const std::vector<ExportedChunk> sent = Send(*pool, shared);
    pool->SettleExport(sent, /*released=*/true);
    EXPECT_EQ(pool->GetStats().exported_bytes.current, static_cast<int64_t>(2 * kMiB));
    EXPECT_EQ(observer_.renamed().size(), renames) << "dedicated";
    // Blocks with neighbours: one exported also untracked, one in a pool that isolates.
    ASSERT_OK_AND_ASSIGN(void* x, pool->Allocate(3 * kMiB, 0));
    ASSERT_OK_AND_ASSIGN(void* y, pool->Allocate(kMiB, 0));
    const std::vector<ExportedChunk> sent_x = Send(*pool, x);
    if (!isolate) {
      ASSERT_OK(pool->Export(x).status());  // untracked: importers unknown
    }
    pool->SettleExport(sent_x, /*released=*/true);
    EXPECT_EQ(pool->GetStats().exported_bytes.current, static_cast<int64_t>(6 * kMiB))
        << (isolate ? "isolated" : "untracked");
    EXPECT_EQ(observer_.renamed().size(), renames);
    for (void* p : {shared, x, y}) ASSERT_OK(pool->Free(p));
    EXPECT_OK(pool->CheckInvariants());
  }
}

}  // namespace vmm
