// The allocation history of the PyTorch plugin (torch_plugin/csrc/alloc_history.h), built on
// the host against a stand-in for PyTorch's allocator header (tests/torch_stand_in): which
// stack and stream each segment entry gets, what is traced while recording is off or an
// action skipped, how segment entries are counted for the snapshot's re-read, and which
// segment entries a snapshot leaves out for PyTorch's memory viewer.
#include "torch_plugin/csrc/alloc_history.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmm_torch {
namespace {

using Entry = cda::TraceEntry;
constexpr size_t kMiB = size_t{1} << 20;
constexpr c10::cuda::MempoolId_t kDefaultPool{0, 0};
constexpr c10::cuda::MempoolId_t kMemPool{1, 2};

// The context recorder PyTorch would pass: each call a new stack, "stack 1", "stack 2", ...
int stacks_made = 0;
std::shared_ptr<c10::GatheredContext> NextStack() {
  auto context = std::make_shared<c10::GatheredContext>();
  context->label = "stack " + std::to_string(++stacks_made);
  return context;
}
std::string LabelOf(const std::shared_ptr<c10::GatheredContext>& context) {
  return context == nullptr ? "none" : context->label;
}

cudaStream_t Stream(uintptr_t n) { return reinterpret_cast<cudaStream_t>(n); }

class AllocHistoryTest : public ::testing::Test {
 protected:
  void SetUp() override { stacks_made = 0; }
  // _record_memory_history(enabled="all", context=`when`, max_entries=100).
  void Record(cca::RecordContext when, std::vector<std::string> skip = {}) {
    history_.Configure(/*enabled=*/true, &NextStack, /*max_entries=*/100, when,
                       /*clear=*/true, skip);
  }
  std::vector<Entry> Trace() { return history_.Traces(1)[0]; }

  History history_;
};

TEST_F(AllocHistoryTest, SegmentEntriesGetTheStackOfTheAllocationThatGrew) {
  Record(cca::RecordContext::ALL);
  // A MemPool over another allocator got a segment for a side stream's allocation, and a
  // device pool mapped a chunk, both before that allocation was recorded.
  // (The segment's stream differs from the allocation's here only to tell them apart.)
  history_.RecordSegment(Entry::SEGMENT_ALLOC, 0, 0x100000, 2 * kMiB, Stream(8), kMemPool);
  history_.RecordSegment(Entry::SEGMENT_MAP, 0, 0x400000, 4 * kMiB, nullptr, kDefaultPool);
  history_.Record(Entry::ALLOC, 0, 0x100000, 4096, Stream(7), kMemPool, /*grew=*/true);

  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 3u);
  EXPECT_EQ(trace[0].action_, Entry::SEGMENT_ALLOC);
  EXPECT_EQ(LabelOf(trace[0].context_), "stack 1");
  EXPECT_EQ(trace[0].stream_, Stream(8)) << "a segment_alloc keeps the stream it was got for";
  EXPECT_EQ(trace[0].mempool_, kMemPool);
  EXPECT_EQ(trace[1].action_, Entry::SEGMENT_MAP);
  EXPECT_EQ(LabelOf(trace[1].context_), "stack 1");
  EXPECT_EQ(trace[1].stream_, Stream(7)) << "a segment_map takes its allocation's stream";
  EXPECT_EQ(trace[2].action_, Entry::ALLOC);
  EXPECT_EQ(LabelOf(trace[2].context_), "stack 1");
  // The segment's frames in a snapshot: the stack of the allocation that grew it.
  EXPECT_EQ(LabelOf(history_.GrowthOf(0x100000, 2 * kMiB)), "stack 1");
  EXPECT_EQ(LabelOf(history_.GrowthOf(0x100000 + 2 * kMiB, kMiB)), "none");
}

TEST_F(AllocHistoryTest, WithoutStacksASegmentMapStillGetsItsAllocationsStream) {
  // context=None: the trace is kept, no stack is gathered.
  history_.Configure(/*enabled=*/true, /*recorder=*/nullptr, 100, cca::RecordContext::NEVER,
                     /*clear=*/true, {});
  history_.RecordSegment(Entry::SEGMENT_MAP, 0, 0x400000, 4 * kMiB, nullptr, kDefaultPool);
  history_.Record(Entry::ALLOC, 0, 0x400000, 4096, Stream(9), kDefaultPool, /*grew=*/true);
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 2u);
  EXPECT_EQ(trace[0].stream_, Stream(9));
  EXPECT_EQ(trace[0].context_, nullptr);
}

TEST_F(AllocHistoryTest, AnAllocationThatDidNotGrowEndsTheWaitWithoutAStack) {
  Record(cca::RecordContext::ALL);
  // A send's block of its own, mapped in libvmm: the thread's next allocation grew nothing.
  history_.RecordSegment(Entry::SEGMENT_MAP, 0, 0x400000, 4 * kMiB, nullptr, kDefaultPool);
  history_.Record(Entry::ALLOC, 0, 0x900000, 512, Stream(3), kDefaultPool, /*grew=*/false);
  history_.Record(Entry::ALLOC, 0, 0xa00000, 512, Stream(3), kDefaultPool, /*grew=*/true);
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 3u);
  EXPECT_EQ(trace[0].context_, nullptr);
  EXPECT_EQ(trace[0].stream_, nullptr);
}

TEST_F(AllocHistoryTest, FreesAndUnmapsDoNotWaitForAStack) {
  Record(cca::RecordContext::ALL);
  history_.RecordSegment(Entry::SEGMENT_FREE, 0, 0x100000, 2 * kMiB, Stream(7), kMemPool);
  history_.RecordSegment(Entry::SEGMENT_UNMAP, 0, 0x400000, 4 * kMiB, nullptr, kDefaultPool);
  history_.Record(Entry::ALLOC, 0, 0x900000, 512, Stream(3), kDefaultPool, /*grew=*/true);
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 3u);
  EXPECT_EQ(trace[0].context_, nullptr);
  EXPECT_EQ(trace[0].stream_, Stream(7)) << "a segment_free names its segment's stream";
  EXPECT_EQ(trace[1].context_, nullptr);
  EXPECT_EQ(trace[1].stream_, nullptr);
}

TEST_F(AllocHistoryTest, ASegmentHandedBackCarriesTheStackOfTheAllocationThatGotIt) {
  Record(cca::RecordContext::ALLOC);
  history_.RecordSegment(Entry::SEGMENT_ALLOC, 0, 0x100000, 2 * kMiB, Stream(7), kMemPool);
  history_.Record(Entry::ALLOC, 0, 0x100000, 4096, Stream(7), kMemPool, /*grew=*/true);
  history_.Record(Entry::ALLOC, 0, 0x900000, 512, Stream(7), kDefaultPool);
  history_.RecordSegment(Entry::SEGMENT_FREE, 0, 0x100000, 2 * kMiB, Stream(7), kMemPool);
  history_.RecordSegment(Entry::SEGMENT_FREE, 0, 0x400000, 2 * kMiB, Stream(7), kMemPool);
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 5u);
  EXPECT_EQ(LabelOf(trace[3].context_), "stack 1");
  EXPECT_EQ(LabelOf(trace[4].context_), "none") << "a segment no recorded growth got";
}

TEST_F(AllocHistoryTest, TheSegmentSerialCountsSegmentEntriesOnly) {
  Record(cca::RecordContext::STATE);
  const uint64_t start = history_.SegmentSerial();
  history_.Record(Entry::ALLOC, 0, 0x900000, 512, Stream(3), kDefaultPool);
  history_.Record(Entry::FREE_REQUESTED, 0, 0x900000, 512, Stream(3), kDefaultPool);
  EXPECT_EQ(history_.SegmentSerial(), start);
  for (Entry::Action action : {Entry::SEGMENT_ALLOC, Entry::SEGMENT_FREE, Entry::SEGMENT_MAP,
                               Entry::SEGMENT_UNMAP}) {
    history_.RecordSegment(action, 0, 0x100000, 2 * kMiB, nullptr, kDefaultPool);
  }
  uint64_t with_trace = 0;
  history_.Traces(1, &with_trace);
  EXPECT_EQ(history_.SegmentSerial(), start + 4);
  EXPECT_EQ(with_trace, start + 4);
}

TEST_F(AllocHistoryTest, SkippedActionsAreNeitherTracedNorCounted) {
  Record(cca::RecordContext::STATE, {"segment_alloc"});
  const uint64_t start = history_.SegmentSerial();
  history_.RecordSegment(Entry::SEGMENT_ALLOC, 0, 0x100000, 2 * kMiB, Stream(1), kMemPool);
  history_.RecordSegment(Entry::SEGMENT_FREE, 0, 0x100000, 2 * kMiB, Stream(1), kMemPool);
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 1u);
  EXPECT_EQ(trace[0].action_, Entry::SEGMENT_FREE);
  EXPECT_EQ(history_.SegmentSerial(), start + 1);
}

TEST_F(AllocHistoryTest, WhileOffOnlyTheTrackersSeeSegmentEntries) {
  EXPECT_FALSE(history_.on());
  std::vector<Entry::Action> seen;
  history_.AddTracker([&seen](const Entry& e) { seen.push_back(e.action_); });
  EXPECT_TRUE(history_.on());
  history_.RecordSegment(Entry::SEGMENT_ALLOC, 0, 0x100000, 2 * kMiB, Stream(1), kMemPool);
  history_.RecordSegment(Entry::SEGMENT_FREE, 0, 0x100000, 2 * kMiB, Stream(1), kMemPool);
  EXPECT_THAT(seen, ::testing::ElementsAre(Entry::SEGMENT_ALLOC, Entry::SEGMENT_FREE));
  EXPECT_TRUE(Trace().empty());
  EXPECT_EQ(history_.SegmentSerial(), 0u);
}

TEST_F(AllocHistoryTest, EachThreadsMappingsGetItsOwnAllocationsStream) {
  history_.Configure(/*enabled=*/true, /*recorder=*/nullptr, /*max_entries=*/100000,
                     cca::RecordContext::NEVER, /*clear=*/true, {});
  constexpr int kThreads = 4;
  constexpr int kGrowths = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      for (int i = 0; i < kGrowths; ++i) {
        const size_t addr = (static_cast<size_t>(t) << 32) + static_cast<size_t>(i) * 4 * kMiB;
        history_.RecordSegment(Entry::SEGMENT_MAP, 0, addr, 4 * kMiB, nullptr, kDefaultPool);
        history_.Record(Entry::ALLOC, 0, addr, 4096, Stream(t + 1), kDefaultPool,
                        /*grew=*/true);
      }
    });
  }
  // A snapshot's reads meanwhile.
  for (int i = 0; i < 100; ++i) {
    uint64_t serial = 0;
    history_.Traces(1, &serial);
    EXPECT_LE(serial, history_.SegmentSerial());
  }
  for (std::thread& thread : threads) thread.join();
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), size_t{2} * kThreads * kGrowths);
  for (const Entry& e : trace) {
    if (e.action_ != Entry::SEGMENT_MAP) continue;
    EXPECT_EQ(e.stream_, Stream((e.addr_ >> 32) + 1)) << "the map at " << e.addr_;
  }
}

// A growth is kept while any segment holds it, where another allocator's segment lies inside
// one of vmm's (the ranges overlap) too.
TEST_F(AllocHistoryTest, AGrowthIsKeptWhereSegmentsOverlap) {
  Record(cca::RecordContext::ALL);
  history_.Record(Entry::ALLOC, 0, 0x400000, 4096, Stream(7), kDefaultPool, /*grew=*/true);
  // vmm's segment [0, 8 MiB) and another allocator's [1 MiB, 2 MiB) inside it.
  history_.KeepGrowthsIn({{0x000000, 8 * kMiB}, {0x100000, kMiB}}, history_.GrowthMark());
  EXPECT_EQ(LabelOf(history_.GrowthOf(0x000000, 8 * kMiB)), "stack 1");
}

// A snapshot's segment and block, with the fields AddStacks reads and sets.
struct TestBlock {
  size_t size = 0;
  bool active = false;
  std::shared_ptr<c10::GatheredContext> context_when_allocated;
};
struct TestSegment {
  size_t address = 0, total_size = 0;
  std::vector<TestBlock> blocks;
  std::shared_ptr<c10::GatheredContext> context_when_allocated;
};

TEST_F(AllocHistoryTest, ASnapshotsSegmentsAndLiveBlocksGetTheirAllocationsStacks) {
  Record(cca::RecordContext::STATE);
  history_.RecordSegment(Entry::SEGMENT_MAP, 0, 0x400000, 4 * kMiB, nullptr, kDefaultPool);
  history_.Record(Entry::ALLOC, 0, 0x400000, kMiB, Stream(1), kDefaultPool, /*grew=*/true);
  history_.Record(Entry::ALLOC, 0, 0x500000, kMiB, Stream(1), kDefaultPool);
  std::vector<TestSegment> segments(2);
  segments[0].address = 0x400000;
  segments[0].total_size = 4 * kMiB;
  segments[0].blocks = {{kMiB, true, nullptr}, {kMiB, true, nullptr}, {2 * kMiB, false, nullptr}};
  segments[1].address = 0x1000000;  // memory no recorded allocation grew
  segments[1].total_size = 2 * kMiB;
  segments[1].blocks = {{2 * kMiB, false, nullptr}};
  AddStacks(history_, &segments);
  EXPECT_EQ(LabelOf(segments[0].context_when_allocated), "stack 1");
  EXPECT_EQ(LabelOf(segments[0].blocks[0].context_when_allocated), "stack 1");
  EXPECT_EQ(LabelOf(segments[0].blocks[1].context_when_allocated), "stack 2");
  EXPECT_EQ(LabelOf(segments[0].blocks[2].context_when_allocated), "none");
  EXPECT_EQ(LabelOf(segments[1].context_when_allocated), "none");
}

// The viewer walks the trace back from the snapshot's blocks: a segment entry under a block
// whose allocation is not after it in the trace would leave that block in no segment.
TEST(KeepWhatTheViewerCanWalkTest, LeavesOutSegmentEntriesUnderABlockAfterItsLastAlloc) {
  auto entry = [](Entry::Action action, size_t addr, size_t size) {
    return Entry(action, 0, addr, size, nullptr, kDefaultPool, 0);
  };
  std::vector<Entry> trace = {
      entry(Entry::SEGMENT_ALLOC, 0x000000, 4 * kMiB),  // 0: under block A, before its alloc
      entry(Entry::ALLOC, 0x000000, kMiB),              // 1: block A
      entry(Entry::SEGMENT_ALLOC, 0x400000, 2 * kMiB),  // 2: under B, which has no alloc
      entry(Entry::SEGMENT_MAP, 0x800000, 2 * kMiB),    // 3: under no block
      entry(Entry::SEGMENT_FREE, 0x000000, 4 * kMiB),   // 4: under A, after its alloc
      entry(Entry::SEGMENT_UNMAP, 0x400000, 2 * kMiB),  // 5: under B
  };
  const std::vector<std::pair<size_t, size_t>> blocks = {{0x000000, kMiB}, {0x400000, 512}};
  KeepWhatTheViewerCanWalk(blocks, &trace);
  std::vector<std::pair<Entry::Action, size_t>> kept;
  for (const Entry& e : trace) kept.emplace_back(e.action_, e.addr_);
  EXPECT_THAT(kept, ::testing::ElementsAre(std::make_pair(Entry::SEGMENT_ALLOC, size_t{0}),
                                           std::make_pair(Entry::ALLOC, size_t{0}),
                                           std::make_pair(Entry::SEGMENT_MAP, size_t{0x800000})));
}

// Ranges that reach the top of the address space are matched against the blocks without
// wrapping: their end would wrap to 0, and they would cover no block.
TEST(KeepWhatTheViewerCanWalkTest, ARangeAtTheTopOfTheAddressSpaceDoesNotWrap) {
  const size_t top = SIZE_MAX - 4 * kMiB + 1;  // [top, top + 4 MiB) ends at 2^64
  std::vector<Entry> trace = {
      Entry(Entry::SEGMENT_MAP, 0, top, 4 * kMiB, nullptr, kDefaultPool, 0),
      Entry(Entry::SEGMENT_MAP, 0, top - kMiB, 5 * kMiB, nullptr, kDefaultPool, 0),
  };
  // A block in the first range, whose allocation is not in the trace.
  const std::vector<std::pair<size_t, size_t>> blocks = {{top + kMiB, kMiB}};
  KeepWhatTheViewerCanWalk(blocks, &trace);
  EXPECT_TRUE(trace.empty()) << "both ranges hold the block; " << trace.size() << " kept";
}

// An entry of no device (a negative index) is in no device's trace, nor counted among the
// segment entries; the trackers still see it.
TEST_F(AllocHistoryTest, AnEntryOfNoDeviceIsNotTraced) {
  int tracked = 0;
  history_.AddTracker([&](const Entry&) { ++tracked; });
  Record(cca::RecordContext::ALL);
  const uint64_t start = history_.SegmentSerial();
  history_.RecordSegment(Entry::SEGMENT_MAP, -1, 0x400000, 4 * kMiB, nullptr, kDefaultPool);
  history_.Record(Entry::ALLOC, -1, 0x400000, 4096, Stream(7), kDefaultPool, /*grew=*/true);
  history_.Record(Entry::ALLOC, 0, 0x800000, 4096, Stream(7), kDefaultPool);
  EXPECT_EQ(tracked, 3);
  EXPECT_EQ(history_.SegmentSerial(), start);
  const std::vector<Entry> trace = Trace();
  ASSERT_EQ(trace.size(), 1u);
  EXPECT_EQ(trace[0].addr_, 0x800000u);
}

// A growth at the top of the address space is found in its segment and kept while the
// segment is (the segment's end would wrap to 0).
TEST_F(AllocHistoryTest, AGrowthAtTheTopOfTheAddressSpaceIsFoundAndKept) {
  Record(cca::RecordContext::ALL);
  const size_t top = SIZE_MAX - 4 * kMiB + 1;  // [top, top + 4 MiB) ends at 2^64
  history_.Record(Entry::ALLOC, 0, top + kMiB, 4096, Stream(7), kDefaultPool, /*grew=*/true);
  EXPECT_EQ(LabelOf(history_.GrowthOf(top, 4 * kMiB)), "stack 1");
  history_.KeepGrowthsIn({{top, 4 * kMiB}}, history_.GrowthMark());
  EXPECT_EQ(LabelOf(history_.GrowthOf(top, 4 * kMiB)), "stack 1") << "its segment is there";
  history_.KeepGrowthsIn({{0x100000, 2 * kMiB}}, history_.GrowthMark());
  EXPECT_EQ(LabelOf(history_.GrowthOf(top, 4 * kMiB)), "none") << "its segment went";
}

// A segment entry that starts inside a block, or ends where one starts, is matched as the
// viewer walks: under the block if they overlap, else not.
TEST(KeepWhatTheViewerCanWalkTest, ABlockStartingBeforeTheEntryCoversItOnlyWhereTheyOverlap) {
  auto entry = [](Entry::Action action, size_t addr, size_t size) {
    return Entry(action, 0, addr, size, nullptr, kDefaultPool, 0);
  };
  std::vector<Entry> trace = {
      entry(Entry::SEGMENT_MAP, 0x100000, kMiB),  // 0: starts inside block A
      entry(Entry::SEGMENT_MAP, 0x400000, kMiB),  // 1: starts where A ends
      entry(Entry::SEGMENT_MAP, 0x700000, kMiB),  // 2: ends where B starts
  };
  // Block A [0, 4 MiB) and block B [8 MiB, 9 MiB), neither allocated in the trace.
  const std::vector<std::pair<size_t, size_t>> blocks = {{0x000000, 4 * kMiB},
                                                         {0x800000, kMiB}};
  KeepWhatTheViewerCanWalk(blocks, &trace);
  std::vector<size_t> kept;
  for (const Entry& e : trace) kept.push_back(e.addr_);
  EXPECT_THAT(kept, ::testing::ElementsAre(size_t{0x400000}, size_t{0x700000}));
}

}  // namespace
}  // namespace vmm_torch
