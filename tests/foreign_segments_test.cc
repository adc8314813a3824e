// ForeignSegments (torch_plugin/csrc/foreign_segments.h): a MemPool over another allocator is
// served as PyTorch's own allocator serves it, in segments of PyTorch's sizes split into
// blocks, cached per stream, handed back only at ReleaseCached.
#include "torch_plugin/csrc/foreign_index.h"
#include "torch_plugin/csrc/foreign_segments.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmm_torch {
namespace {

using ::testing::ElementsAre;

constexpr size_t kMiB = size_t{1} << 20;

// Host memory as segments; events are numbers the test completes by hand.
struct HostLog {
  std::vector<size_t> allocated;  // segment sizes asked for, in order
  std::vector<void*> released;
  std::set<uintptr_t> done_events;
  std::set<uintptr_t> live_events;
  int syncs = 0;
  size_t fail_above = SIZE_MAX;  // Allocate returns null while this much is held
  size_t held = 0;
  bool capturing = false;  // RecordEvent cannot record (a CUDA graph's capture)
  bool sync_fails = false;
  bool elsewhere = false;          // events recorded now run on another GPU: a sync leaves them
  std::set<uintptr_t> other_gpu;   // such events
  std::function<void()> on_release;  // called inside Release (the allocator's own free)
  std::vector<int64_t> counted;      // CountAllocated's deltas, in order
};

class HostSource : public ForeignSource {
 public:
  explicit HostSource(HostLog* log) : log_(log) {}
  void* Allocate(size_t size, uintptr_t stream) override {
    log_->allocated.push_back(size);
    if (log_->held + size > log_->fail_above) return nullptr;
    log_->held += size;
    sizes_.emplace_back(std::malloc(size), size);
    streams_[sizes_.back().first] = stream;
    return sizes_.back().first;
  }
  void Release(void* segment, size_t size, uintptr_t stream) override {
    EXPECT_EQ(streams_[segment], stream) << "released with another stream than it was got for";
    streams_.erase(segment);
    log_->released.push_back(segment);
    if (std::function<void()> f = log_->on_release) f();  // a copy: f may reset it
    for (auto it = sizes_.begin(); it != sizes_.end(); ++it) {
      if (it->first == segment) {
        EXPECT_EQ(it->second, size) << "released with another size than it was asked for";
        log_->held -= it->second;
        std::free(segment);
        sizes_.erase(it);
        return;
      }
    }
    ADD_FAILURE() << "released a segment it never gave";
  }
  uintptr_t RecordEvent(uintptr_t) override {
    if (log_->capturing) return 0;
    log_->live_events.insert(++next_event_);
    if (log_->elsewhere) log_->other_gpu.insert(next_event_);
    return next_event_;
  }
  bool EventDone(uintptr_t event) override { return log_->done_events.count(event) != 0; }
  void CountAllocated(int64_t delta) override { log_->counted.push_back(delta); }
  void DestroyEvent(uintptr_t event) override {
    EXPECT_EQ(log_->live_events.erase(event), 1u) << "event " << event << " destroyed twice";
  }
  bool SynchronizeDevice() override {
    ++log_->syncs;
    if (log_->sync_fails) return false;
    for (uintptr_t e : log_->live_events) {
      if (log_->other_gpu.count(e) == 0) log_->done_events.insert(e);
    }
    return true;
  }
  ~HostSource() override {
    for (auto& [ptr, size] : sizes_) std::free(ptr);
  }

 private:
  HostLog* log_;
  std::vector<std::pair<void*, size_t>> sizes_;
  std::map<void*, uintptr_t> streams_;  // the stream each segment was got for
  uintptr_t next_event_ = 0;
};

class ForeignSegmentsTest : public ::testing::Test {
 protected:
  ForeignSegments& Make(bool no_split = false) {
    pool_ = std::make_unique<ForeignSegments>(std::make_unique<HostSource>(&log_), no_split);
    return *pool_;
  }
  HostLog log_;
  std::unique_ptr<ForeignSegments> pool_;
};

TEST_F(ForeignSegmentsTest, SmallRequestsShareOneTwoMiBSegment) {
  ForeignSegments& pool = Make();
  char* a = static_cast<char*>(pool.Allocate(100, 7));
  char* b = static_cast<char*>(pool.Allocate(1000, 7));
  char* c = static_cast<char*>(pool.Allocate(kMiB, 7));
  ASSERT_NE(a, nullptr);
  EXPECT_THAT(log_.allocated, ElementsAre(2 * kMiB));
  EXPECT_EQ(b, a + 512);   // 100 bytes take a 512-byte block
  EXPECT_EQ(c, b + 1024);  // 1000 bytes take two units
  const ForeignStats stats = pool.Stats();
  EXPECT_EQ(stats.segment[0].current, 1);
  EXPECT_EQ(stats.segment[1].current, 1);  // the small pool's
  EXPECT_EQ(stats.reserved_bytes[0].current, static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(stats.allocated_bytes[0].current, static_cast<int64_t>(512 + 1024 + kMiB));
  EXPECT_EQ(stats.requested_bytes[0].current, static_cast<int64_t>(100 + 1000 + kMiB));
  EXPECT_EQ(stats.allocation[0].current, 3);
}

TEST_F(ForeignSegmentsTest, LargeRequestsGetPyTorchSegmentSizes) {
  ForeignSegments& pool = Make();
  void* mid = pool.Allocate(5 * kMiB, 1);
  void* next_mid = pool.Allocate(9 * kMiB, 1);  // the 15 MiB left of the 20 MiB segment
  void* big = pool.Allocate(30 * kMiB + 1, 1);
  ASSERT_NE(mid, nullptr);
  ASSERT_NE(next_mid, nullptr);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(static_cast<char*>(next_mid), static_cast<char*>(mid) + 5 * kMiB);
  EXPECT_THAT(log_.allocated, ElementsAre(20 * kMiB, 32 * kMiB));
  EXPECT_EQ(pool.Stats().segment[2].current, 2);  // both in the large pool
}

TEST_F(ForeignSegmentsTest, AFreedBlockIsReusedByItsStreamOnly) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.Free(a));
  EXPECT_EQ(pool.Allocate(64 * kMiB, 1), a);  // cached: no new segment
  EXPECT_EQ(log_.allocated.size(), 1u);
  ASSERT_TRUE(pool.Free(a));
  void* other = pool.Allocate(64 * kMiB, 2);  // another stream gets a segment of its own
  EXPECT_NE(other, a);
  EXPECT_EQ(log_.allocated.size(), 2u);
}

TEST_F(ForeignSegmentsTest, FreedNeighboursMergeAndTheSegmentGoesBackAtReleaseCached) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(4 * kMiB, 1);
  void* b = pool.Allocate(4 * kMiB, 1);
  void* c = pool.Allocate(4 * kMiB, 1);
  EXPECT_EQ(log_.allocated.size(), 1u);
  ASSERT_TRUE(pool.Free(b));
  EXPECT_EQ(pool.ReleaseCached(), 0u);  // a and c still hold the segment
  EXPECT_TRUE(log_.released.empty());
  ASSERT_TRUE(pool.Free(a));
  ASSERT_TRUE(pool.Free(c));
  const std::vector<ForeignSegmentInfo> snap = pool.Snapshot();
  ASSERT_EQ(snap.size(), 1u);
  ASSERT_EQ(snap[0].blocks.size(), 1u);  // one free block: the three merged with the rest
  EXPECT_EQ(snap[0].blocks[0].size, 20 * kMiB);
  EXPECT_EQ(pool.ReleaseCached(), 1u);
  EXPECT_THAT(log_.released, ElementsAre(a));
  EXPECT_GE(log_.syncs, 1);  // the GPU's work on it finished first
  EXPECT_TRUE(pool.Empty());
  const ForeignStats stats = pool.Stats();
  EXPECT_EQ(stats.reserved_bytes[0].current, 0);
  EXPECT_EQ(stats.reserved_bytes[0].peak, static_cast<int64_t>(20 * kMiB));
  EXPECT_EQ(stats.inactive_split_bytes[0].current, 0);
  EXPECT_EQ(stats.inactive_split_bytes[0].peak, 0) << "never asked while split";
  EXPECT_EQ(stats.num_device_alloc, 1);
  EXPECT_EQ(stats.num_device_free, 1);
}

TEST_F(ForeignSegmentsTest, ABlockAnotherStreamUsedWaitsForItsEvent) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.RecordStream(a, 2));
  ASSERT_TRUE(pool.Free(a));
  ASSERT_EQ(log_.live_events.size(), 1u);
  void* b = pool.Allocate(64 * kMiB, 1);  // stream 2 may still read a
  EXPECT_NE(b, a);
  EXPECT_EQ(pool.Stats().active[0].current, 2);  // the pending block stays active
  log_.done_events.insert(*log_.live_events.begin());
  EXPECT_EQ(pool.Allocate(64 * kMiB, 1), a);
  EXPECT_TRUE(log_.live_events.empty());
}

// PyTorch's allocator frees no cache while a pool is routed to: an allocation the source
// cannot serve fails, and the pool keeps what it cached (NCCL may have registered it).
TEST_F(ForeignSegmentsTest, OutOfMemoryFailsAndKeepsTheCache) {
  ForeignSegments& pool = Make();
  log_.fail_above = 40 * kMiB;
  void* a = pool.Allocate(20 * kMiB, 1);
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(pool.Free(a));
  EXPECT_EQ(pool.Allocate(30 * kMiB, 1), nullptr);  // 20 cached + 30 > 40
  EXPECT_TRUE(log_.released.empty());
  EXPECT_EQ(log_.syncs, 0);
  EXPECT_EQ(pool.Stats().num_ooms, 1);
  EXPECT_EQ(pool.Allocate(20 * kMiB, 1), a);  // the cache still serves
  EXPECT_TRUE(pool.Free(a));
}

// Sizes whose rounding would wrap around (to a segment of 0 bytes, or a block smaller than
// asked) are out of memory: nothing is asked of the source, counted or handed out.
TEST_F(ForeignSegmentsTest, ASizeNoGpuCouldHoldIsOutOfMemory) {
  ForeignSegments& pool = Make();
  for (size_t size : {~size_t{0}, ~size_t{0} - kMiB, ~size_t{0} - 511,
                      ForeignSegments::kMaxRequest + 1}) {
    SCOPED_TRACE(size);
    EXPECT_EQ(pool.Allocate(size, 1), nullptr);
  }
  EXPECT_EQ(pool.Stats().num_ooms, 4);
  EXPECT_TRUE(log_.allocated.empty()) << "the source was asked for " << log_.allocated[0];
  EXPECT_TRUE(log_.counted.empty());
  EXPECT_EQ(pool.Stats().requested_bytes[0].current, 0);
  EXPECT_TRUE(pool.Snapshot().empty());
  void* a = pool.Allocate(kMiB, 1);  // the pool still serves
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(pool.Free(a));
}

TEST_F(ForeignSegmentsTest, WithoutGrowthOnlyACachedBlockServes) {
  ForeignSegments& pool = Make();
  EXPECT_EQ(pool.Allocate(64 * kMiB, 1, /*may_grow=*/false), nullptr);
  EXPECT_TRUE(log_.allocated.empty());
  void* a = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.Free(a));
  EXPECT_EQ(pool.Allocate(48 * kMiB, 1, /*may_grow=*/false), a);
  EXPECT_EQ(log_.allocated.size(), 1u);
  EXPECT_TRUE(pool.Free(a));
}

// A block freed while the stream that used it captures a CUDA graph: its event is recorded
// once the capture is over, and only then can the block be reused.
TEST_F(ForeignSegmentsTest, AnEventACaptureDefersIsRecordedLater) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.RecordStream(a, 2));
  log_.capturing = true;
  ASSERT_TRUE(pool.Free(a));
  EXPECT_TRUE(log_.live_events.empty());
  void* b = pool.Allocate(64 * kMiB, 1);
  EXPECT_NE(b, a) << "reused before any event ordered it after stream 2";
  EXPECT_EQ(pool.ReleaseCached(), 0u) << "a synchronisation cannot complete what is unrecorded";
  log_.capturing = false;
  void* c = pool.Allocate(64 * kMiB, 1);  // records the event, not done yet
  EXPECT_NE(c, a);
  ASSERT_EQ(log_.live_events.size(), 1u);
  log_.done_events.insert(*log_.live_events.begin());
  EXPECT_EQ(pool.Allocate(64 * kMiB, 1), a);
  for (void* p : {a, b, c}) EXPECT_TRUE(pool.Free(p));
}

TEST_F(ForeignSegmentsTest, AFailedSynchronisationCompletesNothing) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  void* b = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.RecordStream(a, 2));
  ASSERT_TRUE(pool.Free(a));
  ASSERT_TRUE(pool.Free(b));
  log_.sync_fails = true;
  EXPECT_EQ(pool.ReleaseCached(), 0u);
  EXPECT_TRUE(log_.released.empty());
  log_.sync_fails = false;
  EXPECT_EQ(pool.ReleaseCached(), 2u);
}

// A device synchronisation waits for the pool's GPU only: a block used by another GPU's
// stream stays pending until its event is done.
TEST_F(ForeignSegmentsTest, ABlockAnotherGpuUsedOutlastsTheSynchronisation) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  log_.elsewhere = true;
  ASSERT_TRUE(pool.RecordStream(a, 2));
  ASSERT_TRUE(pool.Free(a));
  log_.elsewhere = false;
  EXPECT_EQ(pool.ReleaseCached(), 0u) << "released while the other GPU may still use it";
  EXPECT_TRUE(log_.released.empty());
  log_.done_events.insert(log_.other_gpu.begin(), log_.other_gpu.end());
  EXPECT_EQ(pool.ReleaseCached(), 1u);
}

// The allocator's own free may free a block of the same pool (a Python allocator dropping a
// tensor): the pool's lock is taken again on the same thread, as PyTorch's allocator allows.
TEST_F(ForeignSegmentsTest, TheAllocatorMayFreeAPoolBlockWhileItReleasesASegment) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  void* b = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.Free(a));
  bool freed = false;
  log_.on_release = [&] {
    if (!freed) freed = pool.Free(b);
  };
  EXPECT_GE(pool.ReleaseCached(), 1u);
  EXPECT_TRUE(freed);
  log_.on_release = nullptr;
  EXPECT_EQ(pool.ReleaseCached(), 1u) << "b's segment, freed meanwhile";
  EXPECT_TRUE(pool.Empty());
}

// The allocator's free may also allocate from the pool or release its cache again: the
// segment going back is no longer the pool's, so it is neither handed out nor released twice.
TEST_F(ForeignSegmentsTest, ASegmentGoingBackIsNoLongerThePools) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.Free(a));
  void* during = nullptr;
  size_t again = 99;
  log_.on_release = [&] {
    log_.on_release = nullptr;  // once
    during = pool.Allocate(64 * kMiB, 1);
    again = pool.ReleaseCached();
  };
  EXPECT_EQ(pool.ReleaseCached(), 1u);
  EXPECT_EQ(again, 0u) << "released twice";
  ASSERT_NE(during, nullptr);
  EXPECT_NE(during, a) << "handed out the segment going back";
  EXPECT_EQ(log_.released.size(), 1u);
  ASSERT_TRUE(pool.Free(during));
  EXPECT_EQ(pool.ReleaseCached(), 1u);
}

// no_split: PyTorch's segment sizes, never split; a cached segment serves any request it fits.
TEST_F(ForeignSegmentsTest, NoSplitKeepsEachSegmentWhole) {
  ForeignSegments& pool = Make(/*no_split=*/true);
  void* a = pool.Allocate(100, 1);
  void* b = pool.Allocate(100, 1);  // not beside a: a's 2 MiB segment is all a's
  void* c = pool.Allocate(5 * kMiB, 1);
  EXPECT_THAT(log_.allocated, ElementsAre(2 * kMiB, 2 * kMiB, 20 * kMiB));
  ASSERT_TRUE(pool.Free(c));
  EXPECT_EQ(pool.Allocate(2 * kMiB, 1), c);  // the cached 20 MiB segment, reused whole
  EXPECT_EQ(pool.Stats().allocated_bytes[0].current, static_cast<int64_t>(24 * kMiB));
  for (void* p : {a, b, c}) EXPECT_TRUE(pool.Free(p));
}

TEST_F(ForeignSegmentsTest, OnlyFreeBlocksOfSplitSegmentsAreInactiveSplit) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(4 * kMiB, 1);
  ForeignStats stats = pool.Stats();
  EXPECT_EQ(stats.inactive_split[0].current, 1);  // the 16 MiB left of a's segment
  EXPECT_EQ(stats.inactive_split_bytes[2].current, static_cast<int64_t>(16 * kMiB));
  ASSERT_TRUE(pool.Free(a));
  stats = pool.Stats();
  EXPECT_EQ(stats.inactive_split[0].current, 0);  // one whole cached segment
  EXPECT_EQ(stats.inactive_split_bytes[0].peak, static_cast<int64_t>(16 * kMiB));
}

TEST_F(ForeignSegmentsTest, UnknownAndTwiceFreedPointersAreRefused) {
  ForeignSegments& pool = Make();
  int local = 0;
  EXPECT_FALSE(pool.Free(&local));
  EXPECT_FALSE(pool.RecordStream(&local, 1));
  void* a = pool.Allocate(100, 1);
  EXPECT_TRUE(pool.Free(a));
  EXPECT_FALSE(pool.Free(a));
  EXPECT_FALSE(pool.RecordStream(a, 2));
  EXPECT_EQ(pool.Stats().allocation[0].current, 0);
}

TEST_F(ForeignSegmentsTest, PeaksAndTotalsReset) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(64 * kMiB, 1);
  ASSERT_TRUE(pool.Free(a));
  pool.ResetPeaks();
  ForeignStats stats = pool.Stats();
  EXPECT_EQ(stats.allocated_bytes[0].peak, 0);
  EXPECT_EQ(stats.reserved_bytes[0].peak, static_cast<int64_t>(64 * kMiB));  // still held
  pool.ResetAccumulated();
  stats = pool.Stats();
  EXPECT_EQ(stats.allocation[0].allocated, 0);
  EXPECT_EQ(stats.num_device_alloc, 0);
  EXPECT_EQ(stats.num_ooms, 0);
}

// Every block handed out and taken back is told (the GPU's joint allocated bytes, whose peak
// is max_memory_allocated): its size as the pool counts it, not the request; a refused free
// and a failed allocation tell nothing; a block freed while another stream still uses it is
// told at once, as the pool's allocated figure drops at once.
TEST_F(ForeignSegmentsTest, EveryBlockHandedOutAndTakenBackIsCounted) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(100, 1);
  void* b = pool.Allocate(3 * kMiB, 1);
  EXPECT_THAT(log_.counted, ElementsAre(512, static_cast<int64_t>(3 * kMiB)));
  ASSERT_TRUE(pool.RecordStream(b, 2));
  ASSERT_TRUE(pool.Free(b));
  EXPECT_FALSE(pool.Free(b));
  log_.fail_above = 0;
  EXPECT_EQ(pool.Allocate(64 * kMiB, 1), nullptr);
  ASSERT_TRUE(pool.Free(a));
  EXPECT_THAT(log_.counted, ElementsAre(512, static_cast<int64_t>(3 * kMiB),
                                        -static_cast<int64_t>(3 * kMiB), -512));
  int64_t sum = 0;
  for (int64_t d : log_.counted) sum += d;
  EXPECT_EQ(sum, pool.Stats().allocated_bytes[0].current);
}

TEST_F(ForeignSegmentsTest, SnapshotListsBlocksInAddressOrder) {
  ForeignSegments& pool = Make();
  void* a = pool.Allocate(512, 3);
  void* b = pool.Allocate(512, 3);
  ASSERT_TRUE(pool.RecordStream(a, 4));
  ASSERT_TRUE(pool.Free(a));
  const std::vector<ForeignSegmentInfo> snap = pool.Snapshot();
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(snap[0].stream, 3u);
  EXPECT_TRUE(snap[0].small);
  ASSERT_EQ(snap[0].blocks.size(), 3u);
  EXPECT_TRUE(snap[0].blocks[0].active);  // pending on stream 4
  EXPECT_FALSE(snap[0].blocks[0].allocated);
  EXPECT_TRUE(snap[0].blocks[1].allocated);
  EXPECT_EQ(snap[0].blocks[1].requested, 512u);
  EXPECT_FALSE(snap[0].blocks[2].active);
  EXPECT_EQ(snap[0].blocks[2].size, 2 * kMiB - 1024);
  EXPECT_TRUE(pool.Free(b));
}

// The index finds the pool of any address inside one of its segments, and nothing elsewhere;
// an entry keeps its pool alive while it is entered.
TEST(ForeignIndexTest, FindsThePoolOfEveryAddressInASegment) {
  HostLog log_a, log_b;
  auto a = std::make_shared<ForeignSegments>(std::make_unique<HostSource>(&log_a), false);
  auto b = std::make_shared<ForeignSegments>(std::make_unique<HostSource>(&log_b), false);
  ForeignIndex index;
  EXPECT_TRUE(index.Empty());
  char* base = reinterpret_cast<char*>(uintptr_t{1} << 32);
  index.Add(base, 2 * kMiB, ForeignIndex::Owner{a.get(), a});
  index.Add(base + 2 * kMiB, 20 * kMiB, ForeignIndex::Owner{b.get(), b});
  EXPECT_FALSE(index.Empty());
  EXPECT_EQ(index.Find(base).pool, a.get());
  EXPECT_EQ(index.Find(base + 2 * kMiB - 1).pool, a.get());
  EXPECT_EQ(index.Find(base + 2 * kMiB).pool, b.get());
  EXPECT_EQ(index.Find(base + 22 * kMiB - 1).pool, b.get());
  EXPECT_EQ(index.Find(base + 22 * kMiB).pool, nullptr);
  EXPECT_EQ(index.Find(base - 1).pool, nullptr);
  // The segment's start, which a CUDA IPC handle of a block names (with the block's offset).
  EXPECT_EQ(index.FindSegment(base + kMiB).base, base);
  EXPECT_EQ(index.FindSegment(base + 21 * kMiB).base, base + 2 * kMiB);
  EXPECT_EQ(index.FindSegment(base + 21 * kMiB).owner.pool, b.get());
  EXPECT_EQ(index.FindSegment(base + 22 * kMiB).base, nullptr);
  EXPECT_EQ(a.use_count(), 2) << "the entry holds its pool";
  index.Remove(base);
  EXPECT_EQ(a.use_count(), 1);
  EXPECT_EQ(index.Find(base).pool, nullptr);
  index.Remove(base + 2 * kMiB);
  EXPECT_TRUE(index.Empty());
}

}  // namespace
}  // namespace vmm_torch
