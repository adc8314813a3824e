// Tests of Arena (arena.h): the blocks tiling one address range, their splitting and
// coalescing, growth planning, retirement and gaps. The arena calls no driver: its range is a
// fake base address and nothing is mapped. CheckInvariants() is checked after every step.
#include "allocator/arena.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "allocator/block.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;
using Side = Arena::GrowthPlan::Side;

constexpr uintptr_t kBase = uintptr_t{1} << 40;
constexpr size_t kKiB = 1024;
constexpr size_t kG = 64 * kKiB;        // growth granularity of most tests
constexpr size_t kArenaSize = 64 * kG;  // 4 MiB
constexpr Stream kS = 7;
constexpr Stream kT = 9;
constexpr Stream kAny = kAnyStream;

#define EXPECT_VALID(arena) EXPECT_EQ((arena).CheckInvariants(), "")
#define ASSERT_VALID(arena) ASSERT_EQ((arena).CheckInvariants(), "")

std::string Size(size_t size) {
  return size % kKiB == 0 ? absl::StrCat(size / kKiB, "K") : absl::StrCat(size, "B");
}

// The arena's blocks in address order, e.g. "F7:128K A:512B R:64K U:3840K" (F free with its tag,
// * for kAnyStream; A allocated; P pending; R retired; U unmapped).
std::string Layout(const Arena& arena) {
  std::vector<std::string> parts;
  for (const Block* b = arena.head(); b != nullptr; b = b->next) {
    switch (b->state) {
      case BlockState::kFree:
        parts.push_back(
            absl::StrCat("F", b->stream == kAnyStream ? std::string("*") : absl::StrCat(b->stream),
                         ":", Size(b->size)));
        break;
      case BlockState::kAllocated:
        parts.push_back(absl::StrCat("A:", Size(b->size)));
        break;
      case BlockState::kPendingFree:
        parts.push_back(absl::StrCat("P:", Size(b->size)));
        break;
      case BlockState::kRetired:
        parts.push_back(absl::StrCat("R:", Size(b->size)));
        break;
      case BlockState::kUnmapped:
        parts.push_back(absl::StrCat("U:", Size(b->size)));
        break;
    }
  }
  return absl::StrJoin(parts, " ");
}

class ArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    arena_.Init(kBase, kArenaSize, 9);
    ASSERT_VALID(arena_);
  }

  // Maps [addr, addr + len) (inside one gap) as a free block of `stream`, as the pool would
  // after mapping it, merging with the free neighbours `stream` may use unless `alone`.
  Block* Grow(uintptr_t addr, size_t len, Stream stream, bool alone = false) {
    Block* gap = arena_.BlockContaining(addr);
    EXPECT_NE(gap, nullptr);
    EXPECT_EQ(gap->state, BlockState::kUnmapped);
    EXPECT_LE(addr + len, gap->end());
    Arena::GrowthPlan plan{gap, addr, len, Side::kAlone};
    Block* b = arena_.CommitGrowth(plan, stream, alone);
    EXPECT_VALID(arena_);
    return b;
  }

  // Takes the first n bytes of a free block for `stream` as the pool does (Take, then the
  // caller fills in its stream).
  Block* Alloc(Block* free, size_t n, Stream stream) {
    arena_.Take(free, n, 512);
    free->stream = stream;
    EXPECT_VALID(arena_);
    return free;
  }

  // Cuts a free block into consecutive allocated blocks of the given sizes (which must add up
  // to its size).
  std::vector<Block*> Carve(Block* free, const std::vector<size_t>& sizes, Stream stream) {
    std::vector<Block*> out;
    for (size_t n : sizes) {
      const bool last = n == free->size;
      out.push_back(Alloc(free, n, stream));
      free = last ? nullptr : out.back()->next;  // the rest Take left cached
    }
    EXPECT_EQ(free, nullptr) << "sizes do not add up";
    return out;
  }

  // Eight allocated blocks of 8 KiB at the base (one 64 KiB chunk), then a gap.
  std::vector<Block*> EightBlocks(Stream stream = kS) {
    Block* b = Grow(kBase, kG, stream);
    std::vector<Block*> out = Carve(b, std::vector<size_t>(8, 8 * kKiB), stream);
    EXPECT_EQ(Layout(arena_), "A:8K A:8K A:8K A:8K A:8K A:8K A:8K A:8K U:4032K");
    return out;
  }

  Arena arena_;
};

// --- Init, Contains, BlockContaining -------------------------------------------------------------

TEST_F(ArenaTest, InitMakesOneGap) {
  EXPECT_EQ(arena_.base(), kBase);
  EXPECT_EQ(arena_.size(), kArenaSize);
  EXPECT_EQ(Layout(arena_), "U:4096K");
  ASSERT_NE(arena_.head(), nullptr);
  EXPECT_EQ(arena_.head()->addr, kBase);
  EXPECT_EQ(arena_.head()->size, kArenaSize);
  EXPECT_EQ(arena_.head()->prev, nullptr);
  EXPECT_EQ(arena_.head()->next, nullptr);
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
  EXPECT_EQ(arena_.live().count(), 0u);
  EXPECT_EQ(arena_.BestFit(kS, 512), nullptr);
  EXPECT_EQ(arena_.BestFit(kAny, 512), nullptr);
  EXPECT_TRUE(arena_.Contains(kBase));
  EXPECT_TRUE(arena_.Contains(kBase + kArenaSize - 1));
  EXPECT_FALSE(arena_.Contains(kBase - 1));
  EXPECT_FALSE(arena_.Contains(kBase + kArenaSize));
  EXPECT_EQ(arena_.BlockContaining(kBase), arena_.head());
  EXPECT_EQ(arena_.BlockContaining(kBase + kArenaSize - 1), arena_.head());
  EXPECT_EQ(arena_.BlockContaining(kBase + kArenaSize), nullptr);
  EXPECT_EQ(arena_.BlockContaining(kBase - 1), nullptr);
}

TEST(ArenaEmptyTest, DefaultArenaIsValidAndEmpty) {
  Arena arena;
  EXPECT_VALID(arena);
  EXPECT_EQ(arena.head(), nullptr);
  EXPECT_EQ(arena.BlockContaining(kBase), nullptr);
}

TEST_F(ArenaTest, BlockContainingFindsEveryByteRange) {
  std::vector<Block*> a = EightBlocks();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(arena_.BlockContaining(a[i]->addr), a[i]) << i;
    EXPECT_EQ(arena_.BlockContaining(a[i]->addr + 4097), a[i]) << i;
    EXPECT_EQ(arena_.BlockContaining(a[i]->end() - 1), a[i]) << i;
  }
  Block* gap = a.back()->next;
  ASSERT_NE(gap, nullptr);
  EXPECT_EQ(arena_.BlockContaining(kBase + kG), gap);
  EXPECT_EQ(arena_.BlockContaining(kBase + kArenaSize - 1), gap);
  EXPECT_EQ(arena_.BlockContaining(kBase + kArenaSize), nullptr);
}

// --- PlanGrowth, Extend, CommitGrowth ------------------------------------------------------------

TEST_F(ArenaTest, PlanGrowthInAnEmptyArena) {
  for (bool alone : {false, true}) {
    std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(1, kS, kG, alone);
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->gap, arena_.head());
    EXPECT_EQ(plan->addr, kBase);
    EXPECT_EQ(plan->len, kG);
    EXPECT_EQ(plan->side, Side::kAlone);
    plan = arena_.PlanGrowth(3 * kG + 512, kS, kG, alone);
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->len, 4 * kG);  // whole granules
    plan = arena_.PlanGrowth(kArenaSize, kS, kG, alone);
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->len, kArenaSize);
    EXPECT_FALSE(arena_.PlanGrowth(kArenaSize + 512, kS, kG, alone).has_value());
  }
  EXPECT_EQ(Layout(arena_), "U:4096K");  // planning changes nothing
  EXPECT_VALID(arena_);
}

TEST_F(ArenaTest, CommitGrowthMakesATaggedFreeBlock) {
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(100 * kKiB, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->len, 2 * kG);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:128K U:3968K");
  EXPECT_EQ(b->addr, kBase);
  EXPECT_EQ(b->size, 2 * kG);
  EXPECT_EQ(b->state, BlockState::kFree);
  EXPECT_EQ(b->stream, kS);
  EXPECT_TRUE(arena_.free_blocks().Contains(b));
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
  EXPECT_EQ(arena_.BestFit(kS, 100 * kKiB), b);
  EXPECT_EQ(arena_.BestFit(kS, 2 * kG), b);
  EXPECT_EQ(arena_.BestFit(kS, 2 * kG + 512), nullptr);
  EXPECT_EQ(arena_.BestFit(kT, 512), nullptr);  // tagged for kS only
  EXPECT_EQ(arena_.BestFit(kAny, 512), nullptr);
}

TEST_F(ArenaTest, CommitGrowthInTheMiddleOfAGap) {
  Block* b = Grow(kBase + 10 * kG, 3 * kG, kT);
  EXPECT_EQ(Layout(arena_), "U:640K F9:192K U:3264K");
  EXPECT_EQ(b->addr, kBase + 10 * kG);
  EXPECT_EQ(b->prev->state, BlockState::kUnmapped);
  EXPECT_EQ(b->next->state, BlockState::kUnmapped);
  // Growth at the very end.
  Block* c = Grow(kBase + kArenaSize - kG, kG, kS);
  EXPECT_EQ(Layout(arena_), "U:640K F9:192K U:3200K F7:64K");
  EXPECT_EQ(c->next, nullptr);
  // Filling the gap between two blocks of other tags: three blocks, none merged.
  Block* d = Grow(kBase + 13 * kG, kArenaSize - 14 * kG, kAny);
  EXPECT_EQ(Layout(arena_), "U:640K F9:192K F*:3200K F7:64K");
  EXPECT_EQ(d->stream, kAny);
  EXPECT_EQ(arena_.free_blocks().count(), 3u);
}

TEST_F(ArenaTest, PlanGrowthExtendsAFreeBlockOnTheLeftOfAGap) {
  Block* f = Grow(kBase, 3 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->addr, kBase + 3 * kG);
  EXPECT_EQ(plan->len, kG);  // the free block supplies the other 3 granules
  EXPECT_EQ(plan->gap, f->next);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:256K U:3840K");
  EXPECT_EQ(b, f);  // the old block absorbed the new memory
  EXPECT_EQ(b->addr, kBase);
  EXPECT_EQ(arena_.BestFit(kS, 4 * kG), b);
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
}

TEST_F(ArenaTest, PlanGrowthExtendsAFreeBlockOnTheRightOfAGap) {
  Grow(kBase + kArenaSize - 3 * kG, 3 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG + 512, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kRight);
  EXPECT_EQ(plan->len, 2 * kG);
  EXPECT_EQ(plan->addr, kBase + kArenaSize - 5 * kG);  // ends where the free block starts
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:3776K F7:320K");
  EXPECT_EQ(b->addr, kBase + kArenaSize - 5 * kG);
  EXPECT_EQ(arena_.BestFit(kS, 4 * kG + 512), b);
}

// With a cost, the candidate of least cost wins over the one with the fewest new bytes; equal
// costs go to the fewest new bytes. [gap 30G][F7 3G][gap 10G][A 1G][gap 20G]: extending the
// free block takes one granule; a cost that charges every range bordering it picks the gap
// beyond the allocated block.
TEST_F(ArenaTest, PlanGrowthWithACostPicksTheCheapestCandidate) {
  Block* f = Grow(kBase + 30 * kG, 3 * kG, kS);
  Alloc(Grow(kBase + 43 * kG, kG, kS, /*alone=*/true), kG, kS);
  auto borders_f = [&](const Arena::GrowthPlan& p) {
    return p.gap->prev == f || p.gap->next == f ? size_t{100} * kG : p.len;
  };
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, false, borders_f);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->addr, kBase + 44 * kG);
  EXPECT_EQ(plan->len, 4 * kG);
  EXPECT_EQ(plan->side, Side::kAlone);
  auto flat = [](const Arena::GrowthPlan&) { return size_t{0}; };
  plan = arena_.PlanGrowth(4 * kG, kS, kG, false, flat);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->len, kG) << "equal costs: the fewest new bytes";
  EXPECT_EQ(Layout(arena_), "U:1920K F7:192K U:640K A:64K U:1280K");  // nothing changed
}

TEST_F(ArenaTest, PlanGrowthTieGoesToTheLowerAddress) {
  // [gap 30G][F7 3G][gap 31G]: extending the block to the left (the first gap's right end) or
  // to the right (the second gap's left end) both cost one granule; the lower address wins.
  Grow(kBase + 30 * kG, 3 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kRight);
  EXPECT_EQ(plan->addr, kBase + 29 * kG);
  EXPECT_EQ(plan->len, kG);
  arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:1856K F7:256K U:1984K");
  // Two separate gaps with no neighbours: the lower one.
  Arena arena;
  arena.Init(kBase, 8 * kG, 9);
  Arena::GrowthPlan middle{arena.head(), kBase + 3 * kG, 2 * kG, Side::kAlone};
  Block* m = arena.CommitGrowth(middle, kT, false);
  arena.Take(m, 2 * kG, 512);
  ASSERT_VALID(arena);
  ASSERT_EQ(Layout(arena), "U:192K A:128K U:192K");
  plan = arena.PlanGrowth(kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->addr, kBase);
  EXPECT_EQ(plan->side, Side::kAlone);
}

TEST_F(ArenaTest, PlanGrowthJoinsFreeBlocksOnBothSides) {
  // [F7 2G][gap 1G][F7 2G][gap]: mapping the whole small gap joins both blocks.
  Grow(kBase, 2 * kG, kS);
  Grow(kBase + 3 * kG, 2 * kG, kS);
  ASSERT_EQ(Layout(arena_), "F7:128K U:64K F7:128K U:3776K");
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(5 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kBoth);
  EXPECT_EQ(plan->addr, kBase + 2 * kG);
  EXPECT_EQ(plan->len, kG);
  // Extend cannot grow a plan that fills its gap.
  Arena::Extend(*plan, 10 * kG);
  EXPECT_EQ(plan->addr, kBase + 2 * kG);
  EXPECT_EQ(plan->len, kG);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:320K U:3776K");
  EXPECT_EQ(b->addr, kBase);
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
  // The merged block is extended to the right by what it lacks.
  plan = arena_.PlanGrowth(6 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->len, kG);
}

TEST_F(ArenaTest, BothSidesIsChosenOnlyWhenItIsCheapest) {
  // [F7 2G][gap 4G][F7 3G][gap]: n = 5G. Left side: 3G; right side: 2G; both: 4G. Right wins.
  Grow(kBase, 2 * kG, kS);
  Grow(kBase + 6 * kG, 3 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(5 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kRight);
  EXPECT_EQ(plan->addr, kBase + 4 * kG);
  EXPECT_EQ(plan->len, 2 * kG);
  arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:128K U:128K F7:320K U:3520K");
}

TEST_F(ArenaTest, PlanGrowthPicksTheGapNeedingFewestNewBytes) {
  // [gap 10G][A 1G][F7 3G][gap 50G]: the first gap would need 4 granules, the second one.
  Block* f = Grow(kBase + 10 * kG, 4 * kG, kS);
  Alloc(f, kG, kS);
  ASSERT_EQ(Layout(arena_), "U:640K A:64K F7:192K U:3200K");
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->addr, kBase + 14 * kG);
  EXPECT_EQ(plan->len, kG);
  // Another stream cannot use the free block: it gets the lowest gap, from scratch.
  plan = arena_.PlanGrowth(4 * kG, kT, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kAlone);
  EXPECT_EQ(plan->addr, kBase);
  EXPECT_EQ(plan->len, 4 * kG);
  // A gap that is too small is skipped.
  plan = arena_.PlanGrowth(11 * kG, kT, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->addr, kBase + 14 * kG);
  EXPECT_EQ(plan->len, 11 * kG);
}

TEST_F(ArenaTest, PlanGrowthNulloptWhenNothingFits) {
  Arena arena;
  arena.Init(kBase, 8 * kG, 9);
  // [gap 2G][F7 2G][gap 4G]
  Arena::GrowthPlan p{arena.head(), kBase + 2 * kG, 2 * kG, Side::kAlone};
  arena.CommitGrowth(p, kS, false);
  ASSERT_VALID(arena);
  ASSERT_EQ(Layout(arena), "U:128K F7:128K U:256K");
  // 6G for kS: the second gap plus the free block.
  std::optional<Arena::GrowthPlan> plan = arena.PlanGrowth(6 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->len, 4 * kG);
  // 6G for another stream, or alone: no gap has 6G.
  EXPECT_FALSE(arena.PlanGrowth(6 * kG, kT, kG, false).has_value());
  EXPECT_FALSE(arena.PlanGrowth(6 * kG, kS, kG, true).has_value());
  // 8G: it would take both gaps, which no single block can span.
  EXPECT_FALSE(arena.PlanGrowth(8 * kG, kS, kG, false).has_value());
  EXPECT_FALSE(arena.PlanGrowth(6 * kG + 512, kS, kG, false).has_value());
  // HasGrowthRoomFor says the same as PlanGrowth (alone = false), for each size and stream.
  for (size_t n : {512 * size_t{1}, 2 * kG, 4 * kG, 4 * kG + 512, 6 * kG, 6 * kG + 512, 8 * kG}) {
    for (Stream s : {kS, kT}) {
      EXPECT_EQ(arena.HasGrowthRoomFor(n, s, kG), arena.PlanGrowth(n, s, kG, false).has_value())
          << n << " bytes, stream " << s;
    }
  }
  // A full arena has no gaps.
  arena.CommitGrowth(*arena.PlanGrowth(6 * kG, kS, kG, false), kS, false);
  ASSERT_VALID(arena);
  ASSERT_EQ(Layout(arena), "U:128K F7:384K");
  Arena::GrowthPlan first{arena.head(), kBase, 2 * kG, Side::kAlone};
  Block* all = arena.CommitGrowth(first, kS, false);
  ASSERT_VALID(arena);
  EXPECT_EQ(Layout(arena), "F7:512K");
  EXPECT_EQ(all->addr, kBase);
  EXPECT_EQ(all->size, 8 * kG);
  EXPECT_FALSE(arena.PlanGrowth(512, kS, kG, false).has_value());
  EXPECT_FALSE(arena.PlanGrowth(512, kT, kG, true).has_value());
  EXPECT_FALSE(arena.HasGrowthRoomFor(512, kS, kG));
}

// HasGrowthRoomFor where a gap has usable free blocks on both sides: a plan may join either,
// or both (the gap mapped whole).
TEST_F(ArenaTest, HasGrowthRoomForCountsFreeBlocksOnBothSidesOfAGap) {
  Arena arena;
  arena.Init(kBase, 4 * kG, 9);
  // [F7 1G][gap 2G][F7 1G]
  arena.CommitGrowth(Arena::GrowthPlan{arena.head(), kBase, kG, Side::kAlone}, kS, false);
  Block* gap = arena.BlockContaining(kBase + kG);
  ASSERT_NE(gap, nullptr);
  arena.CommitGrowth(Arena::GrowthPlan{gap, kBase + 3 * kG, kG, Side::kAlone}, kS, false);
  ASSERT_VALID(arena);
  ASSERT_EQ(Layout(arena), "F7:64K U:128K F7:64K");
  for (size_t n : {2 * kG, 2 * kG + 512, 3 * kG, 3 * kG + 512, 4 * kG, 4 * kG + 512}) {
    for (Stream s : {kS, kT}) {
      EXPECT_EQ(arena.HasGrowthRoomFor(n, s, kG), arena.PlanGrowth(n, s, kG, false).has_value())
          << n << " bytes, stream " << s;
    }
  }
  EXPECT_TRUE(arena.HasGrowthRoomFor(4 * kG, kS, kG)) << "both sides and the gap";
  EXPECT_FALSE(arena.HasGrowthRoomFor(4 * kG + 512, kS, kG));
  EXPECT_FALSE(arena.HasGrowthRoomFor(2 * kG + 512, kT, kG)) << "kT may use neither side";
}

TEST_F(ArenaTest, PlanGrowthUsesAnyStreamNeighboursAndNarrowsThem) {
  Grow(kBase, 3 * kG, kAny);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->len, kG);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:256K U:3840K");
  EXPECT_EQ(b->stream, kS);
  EXPECT_EQ(arena_.BestFit(kT, 512), nullptr);  // no longer free for every stream
  EXPECT_EQ(arena_.BestFit(kS, 4 * kG), b);
}

TEST_F(ArenaTest, GrowthForAnyStreamUsesOnlyAnyStreamNeighbours) {
  Grow(kBase, 3 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kAny, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kAlone);
  EXPECT_EQ(plan->len, 4 * kG);
  arena_.CommitGrowth(*plan, kAny, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:192K F*:256K U:3648K");
  plan = arena_.PlanGrowth(5 * kG, kAny, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->len, kG);
}

TEST_F(ArenaTest, NarrowedNeighbourMergesWithTheBlockBeyondIt) {
  // [F7 1G][F* 1G][gap]: growing for kS absorbs the kAnyStream block, which then has kS's tag
  // and joins the kS block beyond it.
  Block* f = Grow(kBase, 2 * kG, kS);
  std::vector<Block*> a = Carve(f, {kG, kG}, kS);
  arena_.AddFree(a[0], kS, 1);
  arena_.AddFree(a[1], kAny, 2);
  ASSERT_VALID(arena_);
  ASSERT_EQ(Layout(arena_), "F7:64K F*:64K U:3968K");
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(2 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kLeft);
  EXPECT_EQ(plan->len, kG);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:192K U:3904K");
  EXPECT_EQ(b->addr, kBase);
  EXPECT_EQ(b->free_seq, 2u);  // the newest of the merged frees
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
}

TEST_F(ArenaTest, GrowthDoesNotAttachToOtherStreamsBlocks) {
  Grow(kBase, 3 * kG, kT);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kAlone);
  EXPECT_EQ(plan->addr, kBase + 3 * kG);
  EXPECT_EQ(plan->len, 4 * kG);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F9:192K F7:256K U:3648K");
  EXPECT_EQ(b->addr, kBase + 3 * kG);
  EXPECT_EQ(b->size, 4 * kG);
}

TEST_F(ArenaTest, AloneIgnoresFreeNeighbours) {
  // A gap between a kAnyStream block and a kS block: with `alone`, the plan counts neither,
  // and the committed block merges with neither (nor narrows the kAnyStream one).
  Grow(kBase, 3 * kG, kAny);
  Grow(kBase + 10 * kG, 3 * kG, kS);
  Block* t = Grow(kBase + 13 * kG, kArenaSize - 13 * kG, kT);
  Alloc(t, t->size, kT);
  ASSERT_EQ(Layout(arena_), "F*:192K U:448K F7:192K A:3264K");
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(4 * kG, kS, kG, true);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->side, Side::kAlone);
  EXPECT_EQ(plan->len, 4 * kG);
  // Without `alone` the same request would need only one granule.
  std::optional<Arena::GrowthPlan> shared = arena_.PlanGrowth(4 * kG, kS, kG, false);
  ASSERT_TRUE(shared.has_value());
  EXPECT_EQ(shared->len, kG);
  // kT alone, filling the gap: its neighbours stay as they are.
  plan = arena_.PlanGrowth(7 * kG, kT, kG, true);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->len, 7 * kG);
  EXPECT_EQ(plan->side, Side::kAlone);
  Block* b = arena_.CommitGrowth(*plan, kT, true);
  ASSERT_VALID(arena_);
  EXPECT_EQ(b->addr, kBase + 3 * kG);
  EXPECT_EQ(b->size, 7 * kG);
  EXPECT_EQ(b->stream, kT);
  EXPECT_EQ(Layout(arena_), "F*:192K F9:448K F7:192K A:3264K");
  EXPECT_EQ(arena_.free_blocks().count(), 3u);
}

TEST_F(ArenaTest, AloneNextToADifferentTagKeepsInvariants) {
  Grow(kBase, 3 * kG, kT);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(2 * kG, kS, kG, true);
  ASSERT_TRUE(plan.has_value());
  Block* b = arena_.CommitGrowth(*plan, kS, true);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F9:192K F7:128K U:3776K");
  // The block gets a chunk of its own: taken whole.
  arena_.Take(b, 2 * kG, 512);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F9:192K A:128K U:3776K");
}

// An `alone` plan takes nothing from a free neighbour of the same tag, though it may border
// it: the committed block stays apart (uncoalesced) until the caller takes it.
TEST_F(ArenaTest, AloneGrowthBordersButNeverJoinsASameTagNeighbour) {
  Grow(kBase, 3 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(2 * kG, kS, kG, true);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->len, 2 * kG) << "nothing taken from the free neighbour";
  Block* b = arena_.CommitGrowth(*plan, kS, true);
  EXPECT_EQ(b->size, 2 * kG);
  EXPECT_EQ(b->addr, plan->addr);
  EXPECT_NE(arena_.CheckInvariants(), "") << "bordering the kS block, uncoalesced until taken";
  arena_.Take(b, b->size, 512);
  EXPECT_VALID(arena_);
}

// The pool's dedicated path: CommitGrowth(alone), Take, then Retire what Take left (the rest
// of a chunk of its own is never handed out). The arena is valid afterwards, also when the
// new block borders a free block of the same tag.
TEST_F(ArenaTest, AloneGrowthTakenAndItsRestRetiredLeavesAValidArena) {
  Grow(kBase + 2 * kG, kG, kS);
  Block* t = Grow(kBase + 3 * kG, kArenaSize - 3 * kG, kT);
  Alloc(t, t->size, kT);
  ASSERT_EQ(Layout(arena_), "U:128K F7:64K A:3904K");
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(kG + 512, kS, kG, true);
  ASSERT_TRUE(plan.has_value());
  Block* b = arena_.CommitGrowth(*plan, kS, true);
  arena_.Take(b, kG + 512, 512);
  ASSERT_NE(b->next, nullptr);
  ASSERT_EQ(b->next->state, BlockState::kFree);
  arena_.Retire(b->next);
  EXPECT_VALID(arena_) << Layout(arena_);
  EXPECT_EQ(b->state, BlockState::kAllocated);
}

TEST_F(ArenaTest, ExtendGrowsAwayFromTheFreeNeighbour) {
  // kAlone and kLeft grow to the right, up to the end of the gap.
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  ASSERT_EQ(plan->side, Side::kAlone);
  Arena::Extend(*plan, 3 * kG);
  EXPECT_EQ(plan->addr, kBase);
  EXPECT_EQ(plan->len, 4 * kG);
  Arena::Extend(*plan, 1000 * kG);
  EXPECT_EQ(plan->addr, kBase);
  EXPECT_EQ(plan->len, kArenaSize);
  Arena::Extend(*plan, kG);
  EXPECT_EQ(plan->len, kArenaSize);

  Grow(kBase, 2 * kG, kS);
  Grow(kBase + kArenaSize - 2 * kG, 2 * kG, kT);
  ASSERT_EQ(Layout(arena_), "F7:128K U:3840K F9:128K");
  plan = arena_.PlanGrowth(3 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  ASSERT_EQ(plan->side, Side::kLeft);
  ASSERT_EQ(plan->addr, kBase + 2 * kG);
  Arena::Extend(*plan, 2 * kG);
  EXPECT_EQ(plan->addr, kBase + 2 * kG);
  EXPECT_EQ(plan->len, 3 * kG);
  Arena::Extend(*plan, kArenaSize);
  EXPECT_EQ(plan->addr, kBase + 2 * kG);
  EXPECT_EQ(plan->len, kArenaSize - 4 * kG);  // stops at the kT block

  // kRight grows to the left, down to the start of the gap.
  plan = arena_.PlanGrowth(3 * kG, kT, kG, false);
  ASSERT_TRUE(plan.has_value());
  ASSERT_EQ(plan->side, Side::kRight);
  ASSERT_EQ(plan->addr, kBase + kArenaSize - 3 * kG);
  ASSERT_EQ(plan->len, kG);
  Arena::Extend(*plan, 2 * kG);
  EXPECT_EQ(plan->addr, kBase + kArenaSize - 5 * kG);
  EXPECT_EQ(plan->len, 3 * kG);
  Arena::Extend(*plan, kArenaSize);
  EXPECT_EQ(plan->addr, kBase + 2 * kG);  // stops at the kS block
  EXPECT_EQ(plan->len, kArenaSize - 4 * kG);
  // Committing the fully extended kT plan: the whole gap joins the kT block only.
  Block* b = arena_.CommitGrowth(*plan, kT, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:128K F9:3968K");
  EXPECT_EQ(b->addr, kBase + 2 * kG);
}

TEST_F(ArenaTest, ExtendedPlanCommits) {
  Grow(kBase + 20 * kG, 2 * kG, kS);
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(3 * kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  ASSERT_EQ(plan->side, Side::kRight);
  Arena::Extend(*plan, 4 * kG);
  Block* b = arena_.CommitGrowth(*plan, kS, false);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:960K F7:448K U:2688K");
  EXPECT_EQ(b->addr, kBase + 15 * kG);
  EXPECT_EQ(b->size, 7 * kG);
}

// --- Take ----------------------------------------------------------------------------------------

TEST_F(ArenaTest, TakeSplitsOffTheRestWhenItIsLargeEnough) {
  Block* f = Grow(kBase, 2 * kG, kS);
  arena_.Take(f, 100 * kKiB, 512);
  ASSERT_VALID(arena_);
  EXPECT_EQ(f->state, BlockState::kAllocated);
  EXPECT_EQ(f->size, 100 * kKiB);
  EXPECT_FALSE(arena_.free_blocks().Contains(f));
  Block* rest = f->next;
  ASSERT_NE(rest, nullptr);
  EXPECT_EQ(rest->addr, kBase + 100 * kKiB);
  EXPECT_EQ(rest->size, 28 * kKiB);
  EXPECT_EQ(rest->state, BlockState::kFree);
  EXPECT_EQ(rest->stream, kS);  // the rest keeps the tag
  EXPECT_TRUE(arena_.free_blocks().Contains(rest));
  EXPECT_EQ(arena_.BestFit(kS, 28 * kKiB), rest);
  EXPECT_EQ(Layout(arena_), "A:100K F7:28K U:3968K");

  // A remainder of exactly min_rest is split off.
  arena_.Take(rest, 27 * kKiB, kKiB);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:100K A:27K F7:1K U:3968K");
  Block* last = rest->next;
  EXPECT_EQ(last->size, kKiB);

  // A remainder smaller than min_rest stays with the block.
  arena_.Take(last, 512, kKiB);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:100K A:27K A:1K U:3968K");
  EXPECT_EQ(last->size, kKiB);
  EXPECT_EQ(last->state, BlockState::kAllocated);
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
  EXPECT_EQ(arena_.BestFit(kS, 512), nullptr);
}

TEST_F(ArenaTest, TakeAWholeBlock) {
  Block* f = Grow(kBase, kG, kAny);
  arena_.Take(f, kG, 512);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:64K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
  EXPECT_EQ(f->size, kG);
}

TEST_F(ArenaTest, TakeFromALargeBlockKeepsTheRestFindable) {
  // In a large bin the rest usually stays in the block's bin (FreeBlocks::Replace in place);
  // sometimes it drops to a lower one. Both must leave the rest findable and filed.
  constexpr size_t kMiB = 1024 * kKiB;
  Arena arena;
  arena.Init(kBase, size_t{4} << 30, 12);
  Arena::GrowthPlan p{arena.head(), kBase, 1024 * kMiB + 80 * kMiB, Side::kAlone};
  Block* f = arena.CommitGrowth(p, kS, false);
  Arena::GrowthPlan q{f->next, f->end(), 64 * kMiB, Side::kAlone};
  Block* other = arena.CommitGrowth(q, kT, false);
  ASSERT_VALID(arena);
  arena.Take(f, 4096, 4096);  // same bin
  ASSERT_VALID(arena);
  Block* rest = f->next;
  EXPECT_EQ(rest->size, 1024 * kMiB + 80 * kMiB - 4096);
  EXPECT_EQ(arena.BestFit(kS, 4096), rest);
  arena.Take(rest, 48 * kMiB, 4096);  // to a lower bin
  ASSERT_VALID(arena);
  Block* rest2 = rest->next;
  EXPECT_EQ(rest2->size, 1024 * kMiB + 32 * kMiB - 4096);
  EXPECT_EQ(arena.BestFit(kS, 1024 * kMiB), rest2);
  EXPECT_EQ(arena.BestFit(kT, 4096), other);
  EXPECT_EQ(arena.free_blocks().count(), 2u);
}

// --- AddFree: coalescing -------------------------------------------------------------------------

TEST_F(ArenaTest, AddFreeMergesEqualTags) {
  std::vector<Block*> a = EightBlocks();
  // Alone.
  Block* r = arena_.AddFree(a[1], kS, 1);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[1]);
  EXPECT_EQ(r->state, BlockState::kFree);
  EXPECT_EQ(r->free_seq, 1u);
  EXPECT_EQ(Layout(arena_), "A:8K F7:8K A:8K A:8K A:8K A:8K A:8K A:8K U:4032K");
  // With the block below: it absorbs this one.
  r = arena_.AddFree(a[2], kS, 2);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[1]);
  EXPECT_EQ(r->size, 16 * kKiB);
  EXPECT_EQ(r->free_seq, 2u);
  EXPECT_EQ(Layout(arena_), "A:8K F7:16K A:8K A:8K A:8K A:8K A:8K U:4032K");
  // With the block above: this one absorbs it.
  arena_.AddFree(a[5], kS, 3);
  r = arena_.AddFree(a[4], kS, 4);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[4]);
  EXPECT_EQ(r->addr, kBase + 4 * 8 * kKiB);
  EXPECT_EQ(r->size, 16 * kKiB);
  EXPECT_EQ(r->free_seq, 4u);
  EXPECT_EQ(Layout(arena_), "A:8K F7:16K A:8K F7:16K A:8K A:8K U:4032K");
  // With both: the block below absorbs the other two.
  r = arena_.AddFree(a[3], kS, 5);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[1]);
  EXPECT_EQ(r->size, 40 * kKiB);
  EXPECT_EQ(r->free_seq, 5u);
  EXPECT_EQ(Layout(arena_), "A:8K F7:40K A:8K A:8K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
  EXPECT_EQ(arena_.BestFit(kS, 40 * kKiB), a[1]);
  EXPECT_EQ(arena_.BestFit(kS, 40 * kKiB + 512), nullptr);
}

TEST_F(ArenaTest, AddFreeKeepsTheNewestFreeSeq) {
  std::vector<Block*> a = EightBlocks();
  arena_.AddFree(a[0], kS, 50);
  Block* r = arena_.AddFree(a[1], kS, 10);  // an older sequence number joining a newer block
  ASSERT_VALID(arena_);
  EXPECT_EQ(r->free_seq, 50u);
  arena_.AddFree(a[3], kS, 70);
  r = arena_.AddFree(a[2], kS, 20);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r->free_seq, 70u);
  EXPECT_EQ(Layout(arena_), "F7:32K A:8K A:8K A:8K A:8K U:4032K");
}

TEST_F(ArenaTest, AddFreeDoesNotMergeDifferentTags) {
  std::vector<Block*> a = EightBlocks();
  arena_.AddFree(a[0], kS, 1);
  arena_.AddFree(a[1], kT, 2);
  arena_.AddFree(a[2], kAny, 3);
  arena_.AddFree(a[3], kS, 4);
  arena_.AddFree(a[4], 0, 5);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:8K F9:8K F*:8K F7:8K F0:8K A:8K A:8K A:8K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 5u);
  // A block of the default stream's tag joins its equal-tag neighbour only.
  arena_.AddFree(a[5], 0, 6);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:8K F9:8K F*:8K F7:8K F0:16K A:8K A:8K U:4032K");
  // kAnyStream blocks merge with each other.
  arena_.AddFree(a[7], kAny, 7);
  arena_.AddFree(a[6], kAny, 8);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:8K F9:8K F*:8K F7:8K F0:16K F*:16K U:4032K");
  // The best fit for kS is its own block or a kAnyStream one.
  EXPECT_EQ(arena_.BestFit(kS, 8 * kKiB), a[0]);  // own wins the tie, lowest address
  EXPECT_EQ(arena_.BestFit(kS, 16 * kKiB), a[6]);
  EXPECT_EQ(arena_.BestFit(kT, 16 * kKiB), a[6]);
  EXPECT_EQ(arena_.BestFit(0, 16 * kKiB), a[4]);
}

TEST_F(ArenaTest, FreeBlocksDoNotMergeWithGapsOrRetiredBlocks) {
  std::vector<Block*> a = EightBlocks();
  arena_.Retire(a[6]);
  arena_.AddFree(a[7], kS, 1);  // between a retired block and the gap
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:8K A:8K A:8K A:8K A:8K A:8K R:8K F7:8K U:4032K");
  arena_.AddFree(a[5], kS, 2);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:8K A:8K A:8K A:8K A:8K F7:8K R:8K F7:8K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 2u);
}

TEST_F(ArenaTest, AddFreeResetsAllocationFields) {
  std::vector<Block*> a = EightBlocks();
  a[2]->requested = 1234;
  a[2]->stream_uses = {kT, 0};
  Block* r = arena_.AddFree(a[2], kS, 9);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r->requested, 0u);
  EXPECT_TRUE(r->stream_uses.empty());
  EXPECT_EQ(r->stream, kS);
}

// --- Retag, NarrowAnyTo --------------------------------------------------------------------------

TEST_F(ArenaTest, RetagMergesUnderTheNewTag) {
  std::vector<Block*> a = EightBlocks();
  arena_.AddFree(a[0], kS, 1);
  arena_.AddFree(a[1], kT, 2);
  arena_.AddFree(a[2], kS, 3);
  ASSERT_EQ(Layout(arena_), "F7:8K F9:8K F7:8K A:8K A:8K A:8K A:8K A:8K U:4032K");
  Block* r = arena_.Retag(a[1], kS);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[0]);
  EXPECT_EQ(r->size, 24 * kKiB);
  EXPECT_EQ(r->free_seq, 3u);
  EXPECT_EQ(Layout(arena_), "F7:24K A:8K A:8K A:8K A:8K A:8K U:4032K");
  // Retagged to kAnyStream: every stream sees it, and it merges with nothing tagged.
  r = arena_.Retag(r, kAny);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F*:24K A:8K A:8K A:8K A:8K A:8K U:4032K");
  EXPECT_EQ(arena_.BestFit(kT, 24 * kKiB), r);
  arena_.AddFree(a[3], kS, 4);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F*:24K F7:8K A:8K A:8K A:8K A:8K U:4032K");
  // Retag to the same tag changes nothing.
  Block* s = arena_.Retag(a[3], kS);
  ASSERT_VALID(arena_);
  EXPECT_EQ(s, a[3]);
  EXPECT_EQ(Layout(arena_), "F*:24K F7:8K A:8K A:8K A:8K A:8K U:4032K");
  // Retagging the upper block to kAnyStream merges it into the lower one.
  s = arena_.Retag(a[3], kAny);
  ASSERT_VALID(arena_);
  EXPECT_EQ(s, a[0]);
  EXPECT_EQ(Layout(arena_), "F*:32K A:8K A:8K A:8K A:8K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
}

TEST_F(ArenaTest, NarrowAnyToJoinsAnyStreamBlocksToTheStreamsNeighbours) {
  std::vector<Block*> a = EightBlocks();
  arena_.AddFree(a[0], kS, 1);
  arena_.AddFree(a[1], kAny, 2);
  arena_.AddFree(a[3], kAny, 3);
  arena_.AddFree(a[4], kT, 4);
  arena_.AddFree(a[5], kS, 5);
  arena_.AddFree(a[6], kAny, 6);
  arena_.AddFree(a[7], kS, 7);
  ASSERT_VALID(arena_);
  ASSERT_EQ(Layout(arena_), "F7:8K F*:8K A:8K F*:8K F9:8K F7:8K F*:8K F7:8K U:4032K");
  // No single block of 16K for kS before.
  EXPECT_EQ(arena_.BestFit(kS, 16 * kKiB), nullptr);
  arena_.NarrowAnyTo(kAnyStream);  // nothing to do
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:8K F*:8K A:8K F*:8K F9:8K F7:8K F*:8K F7:8K U:4032K");
  arena_.NarrowAnyTo(kS);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:16K A:8K F*:8K F9:8K F7:24K U:4032K");
  EXPECT_EQ(arena_.BestFit(kS, 16 * kKiB), a[0]);
  EXPECT_EQ(arena_.BestFit(kS, 24 * kKiB), a[5]);
  // A stream with no neighbouring blocks: nothing changes.
  arena_.NarrowAnyTo(0);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:16K A:8K F*:8K F9:8K F7:24K U:4032K");
  arena_.NarrowAnyTo(kT);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:16K A:8K F9:16K F7:24K U:4032K");
  EXPECT_EQ(arena_.free_blocks().BlocksOf(kAnyStream).size(), 0u);
}

// Blocks of the stream and kAnyStream blocks alternating: the whole run becomes one block,
// whichever block of the stream is visited first. NarrowAnyTo visits the stream's blocks when
// they are fewer than the kAnyStream ones, smallest first: retagging the 8K block's upper
// neighbour merged it through to the 16K block, and the kAnyStream block above that was left.
TEST_F(ArenaTest, NarrowAnyToJoinsAWholeRunOfAlternatingBlocks) {
  Block* b = Grow(kBase, kG, kS);
  std::vector<Block*> a = Carve(b, {8 * kKiB, 8 * kKiB, 16 * kKiB, 8 * kKiB, 8 * kKiB, 8 * kKiB,
                                    8 * kKiB}, kS);
  arena_.AddFree(a[0], kS, 1);
  arena_.AddFree(a[1], kAny, 2);
  arena_.AddFree(a[2], kS, 3);
  arena_.AddFree(a[3], kAny, 4);
  arena_.AddFree(a[5], kAny, 5);  // more kAnyStream blocks than kS ones
  ASSERT_VALID(arena_);
  ASSERT_EQ(Layout(arena_), "F7:8K F*:8K F7:16K F*:8K A:8K F*:8K A:8K U:4032K");
  EXPECT_EQ(arena_.BestFit(kS, 40 * kKiB), nullptr);
  arena_.NarrowAnyTo(kS);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:40K A:8K F*:8K A:8K U:4032K");
  EXPECT_EQ(arena_.BestFit(kS, 40 * kKiB), a[0]);
}

TEST_F(ArenaTest, PendingBlocksDoNotCoalesce) {
  // The pool marks a freed block kPendingFree while other streams' work is outstanding: free
  // neighbours of the same tag do not merge across it until it is added to the cache.
  std::vector<Block*> a = EightBlocks();
  a[1]->state = BlockState::kPendingFree;
  a[1]->pending_events = 2;
  arena_.AddFree(a[0], kS, 1);
  arena_.AddFree(a[2], kS, 2);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:8K P:8K F7:8K A:8K A:8K A:8K A:8K A:8K U:4032K");
  a[1]->pending_events = 0;
  Block* r = arena_.AddFree(a[1], kS, 3);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[0]);
  EXPECT_EQ(Layout(arena_), "F7:24K A:8K A:8K A:8K A:8K A:8K U:4032K");
  // Adjacent pending blocks stay separate blocks.
  a[3]->state = BlockState::kPendingFree;
  a[4]->state = BlockState::kPendingFree;
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:24K P:8K P:8K A:8K A:8K A:8K U:4032K");
}

// --- Retire --------------------------------------------------------------------------------------

TEST_F(ArenaTest, RetireMergesRetiredNeighbours) {
  std::vector<Block*> a = EightBlocks();
  a[1]->stream_uses = {kT};
  a[1]->requested = 100;
  Block* r = arena_.Retire(a[1]);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[1]);
  EXPECT_EQ(r->state, BlockState::kRetired);
  EXPECT_TRUE(r->stream_uses.empty());
  EXPECT_EQ(r->requested, 0u);
  EXPECT_EQ(Layout(arena_), "A:8K R:8K A:8K A:8K A:8K A:8K A:8K A:8K U:4032K");
  r = arena_.Retire(a[2]);  // merges down
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[1]);
  EXPECT_EQ(r->size, 16 * kKiB);
  r = arena_.Retire(a[0]);  // merges up
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[0]);
  EXPECT_EQ(Layout(arena_), "R:24K A:8K A:8K A:8K A:8K A:8K U:4032K");
  arena_.Retire(a[4]);
  r = arena_.Retire(a[3]);  // merges both ways
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[0]);
  EXPECT_EQ(r->size, 40 * kKiB);
  EXPECT_EQ(Layout(arena_), "R:40K A:8K A:8K A:8K U:4032K");
}

TEST_F(ArenaTest, RetireAFreeBlockTakesItOutOfTheCache) {
  std::vector<Block*> a = EightBlocks();
  arena_.Retire(a[0]);
  arena_.AddFree(a[1], kS, 1);
  arena_.AddFree(a[3], kS, 2);
  arena_.Retire(a[4]);
  ASSERT_VALID(arena_);
  ASSERT_EQ(Layout(arena_), "R:8K F7:8K A:8K F7:8K R:8K A:8K A:8K A:8K U:4032K");
  ASSERT_EQ(arena_.free_blocks().count(), 2u);
  Block* r = arena_.Retire(a[1]);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[0]);
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
  EXPECT_EQ(Layout(arena_), "R:16K A:8K F7:8K R:8K A:8K A:8K A:8K U:4032K");
  r = arena_.Retire(a[3]);
  ASSERT_VALID(arena_);
  EXPECT_EQ(r, a[3]);
  EXPECT_EQ(r->size, 16 * kKiB);
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
  EXPECT_EQ(arena_.BestFit(kS, 512), nullptr);
  EXPECT_EQ(Layout(arena_), "R:16K A:8K R:16K A:8K A:8K A:8K U:4032K");
  // Retired blocks never merge with gaps.
  arena_.Retire(a[7]);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "R:16K A:8K R:16K A:8K A:8K R:8K U:4032K");
}

// --- Split ---------------------------------------------------------------------------------------

TEST_F(ArenaTest, SplitAnAllocatedBlock) {
  Block* f = Grow(kBase, kG, kS);
  Alloc(f, kG, kT);
  f->requested = 5;
  Block* upper = arena_.Split(f, kBase + 24 * kKiB);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:24K A:40K U:4032K");
  EXPECT_EQ(f->size, 24 * kKiB);
  EXPECT_EQ(upper->addr, kBase + 24 * kKiB);
  EXPECT_EQ(upper->size, 40 * kKiB);
  EXPECT_EQ(upper->state, BlockState::kAllocated);
  EXPECT_EQ(upper->stream, kT);
  EXPECT_EQ(upper->prev, f);
  EXPECT_EQ(f->next, upper);
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
}

TEST_F(ArenaTest, SplitAFreeBlockKeepsBothPartsCached) {
  // The parts of a split free block stay in the cache with its tag; until one of them changes
  // state they are adjacent equal-tag blocks, which CheckInvariants() reports (the pool splits
  // a free block only to retire or free a part at once, as here).
  Block* f = Grow(kBase, 4 * kG, kS);
  f->free_seq = 42;
  Block* upper = arena_.Split(f, kBase + kG);
  EXPECT_EQ(f->size, kG);
  EXPECT_EQ(upper->size, 3 * kG);
  EXPECT_EQ(upper->state, BlockState::kFree);
  EXPECT_EQ(upper->stream, kS);
  EXPECT_EQ(upper->free_seq, 42u);
  EXPECT_TRUE(arena_.free_blocks().Contains(f));
  EXPECT_TRUE(arena_.free_blocks().Contains(upper));
  EXPECT_TRUE(arena_.free_blocks().Filed(f));
  EXPECT_TRUE(arena_.free_blocks().Filed(upper));
  EXPECT_EQ(arena_.free_blocks().count(), 2u);
  EXPECT_EQ(arena_.BestFit(kS, kG), f);
  EXPECT_EQ(arena_.BestFit(kS, kG + 512), upper);
  EXPECT_THAT(arena_.CheckInvariants(), HasSubstr("uncoalesced free blocks"));
  // Split the upper part again and retire its middle: every part is consistent again.
  Block* top = arena_.Split(upper, kBase + 3 * kG);
  arena_.Retire(upper);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:64K R:128K F7:64K U:3840K");
  EXPECT_EQ(arena_.BestFit(kS, kG), f);
  EXPECT_EQ(top->addr, kBase + 3 * kG);
  // Retired memory goes back to the address space through MakeGap.
  arena_.MakeGap(kBase + kG, 2 * kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:64K U:128K F7:64K U:3840K");
}

// --- ExtendRange -------------------------------------------------------------------------------

// The range lengthened at its end: a gap of its own, which no gap joins across the seam, so that
// no growth plan crosses from one reservation into the next; free blocks may.
TEST_F(ArenaTest, ExtendRangeAddsAGapThatNeverJoinsAcrossTheSeam) {
  const uintptr_t seam = kBase + kArenaSize;
  Grow(kBase, 4 * kG, kS);
  arena_.ExtendRange(2 * kArenaSize);
  ASSERT_VALID(arena_);
  EXPECT_EQ(arena_.size(), 3 * kArenaSize);
  EXPECT_TRUE(arena_.Contains(seam + 2 * kArenaSize - 1));
  EXPECT_FALSE(arena_.Contains(seam + 2 * kArenaSize));
  EXPECT_EQ(Layout(arena_), "F7:256K U:3840K U:8192K");
  // A request larger than either gap has no plan: the two are not one range.
  EXPECT_FALSE(arena_.PlanGrowth(2 * kArenaSize + kG, kS, kG, false).has_value());
  // One that fits the new gap alone (not the old one with its free block) goes there.
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(kArenaSize + kG, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->addr, seam);
  EXPECT_LE(plan->addr + plan->len, plan->gap->end());
  // Memory on both sides of the seam: its free blocks coalesce across it.
  Grow(seam - kG, kG, kS);
  Grow(seam, kG, kS);
  EXPECT_EQ(Layout(arena_), "F7:256K U:3776K F7:128K U:8128K");
  // Given back, the two sides are gaps again, cut at the seam, each joined with its own side.
  arena_.MakeGap(seam - kG, 2 * kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:256K U:3840K U:8192K");
  ASSERT_NE(arena_.BlockContaining(seam), nullptr);
  EXPECT_EQ(arena_.BlockContaining(seam)->addr, seam);
  // Live blocks past the seam are indexed.
  Block* f = Grow(seam + 4 * kG, kG, kT);
  Block* a = Alloc(f, kG, kT);
  arena_.live().Insert(a);
  EXPECT_EQ(arena_.live().Find(seam + 4 * kG), a);
  arena_.live().Erase(a);
  // A second lengthening adds a second seam.
  arena_.ExtendRange(kArenaSize);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:256K U:3840K U:256K A:64K U:7872K U:4096K");
}

// --- MakeGap -------------------------------------------------------------------------------------

TEST_F(ArenaTest, MakeGapInsideAFreeBlock) {
  Grow(kBase, 4 * kG, kS);
  Grow(kBase + 5 * kG, kG, kT);
  ASSERT_EQ(Layout(arena_), "F7:256K U:64K F9:64K U:3712K");
  arena_.MakeGap(kBase + kG, 2 * kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:64K U:128K F7:64K U:64K F9:64K U:3712K");
  EXPECT_EQ(arena_.free_blocks().count(), 3u);
  EXPECT_EQ(arena_.BestFit(kS, kG), arena_.head());  // lower address of two equal sizes
  // A gap next to gaps on both sides: they all merge.
  arena_.MakeGap(kBase + 3 * kG, kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "F7:64K U:256K F9:64K U:3712K");
  // The gap at the start.
  arena_.MakeGap(kBase, kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:320K F9:64K U:3712K");
  arena_.MakeGap(kBase + 5 * kG, kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:4096K");
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
  // The reclaimed range can be grown into again.
  std::optional<Arena::GrowthPlan> plan = arena_.PlanGrowth(kArenaSize, kS, kG, false);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->len, kArenaSize);
}

TEST_F(ArenaTest, MakeGapOverFreeAndRetiredBlocks) {
  std::vector<Block*> a = EightBlocks();
  arena_.AddFree(a[1], kS, 1);
  arena_.Retire(a[2]);
  arena_.AddFree(a[3], kT, 2);
  arena_.AddFree(a[4], kAny, 3);
  arena_.Retire(a[5]);
  ASSERT_EQ(Layout(arena_), "A:8K F7:8K R:8K F9:8K F*:8K R:8K A:8K A:8K U:4032K");
  // Starts and ends inside blocks.
  arena_.MakeGap(kBase + 12 * kKiB, 32 * kKiB);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:8K F7:4K U:32K R:4K A:8K A:8K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 1u);
  EXPECT_EQ(arena_.BestFit(kT, 512), nullptr);
  EXPECT_EQ(arena_.BestFit(kS, 4 * kKiB), a[1]);
  // Exactly one block.
  arena_.MakeGap(kBase + 8 * kKiB, 4 * kKiB);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "A:8K U:36K R:4K A:8K A:8K U:4032K");
  EXPECT_EQ(arena_.free_blocks().count(), 0u);
}

TEST_F(ArenaTest, MakeGapOfARangeEndingAtAGap) {
  Block* f = Grow(kBase + kG, 2 * kG, kS);
  arena_.Retire(f);
  ASSERT_EQ(Layout(arena_), "U:64K R:128K U:3904K");
  arena_.MakeGap(kBase + 2 * kG, kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:64K R:64K U:3968K");
  arena_.MakeGap(kBase + kG, kG);
  ASSERT_VALID(arena_);
  EXPECT_EQ(Layout(arena_), "U:4096K");
  EXPECT_EQ(arena_.head()->next, nullptr);
}

// --- The live index and CheckInvariants ----------------------------------------------------------

TEST_F(ArenaTest, LiveIndexHoldsAllocatedBlocks) {
  std::vector<Block*> a = EightBlocks();
  for (Block* b : a) arena_.live().Insert(b);
  EXPECT_EQ(arena_.live().count(), 8u);
  for (Block* b : a) EXPECT_EQ(arena_.live().Find(b->addr), b);
  EXPECT_EQ(arena_.live().Find(a[0]->addr + 512), nullptr);
  EXPECT_EQ(arena_.live().Find(kBase + kG), nullptr);
  arena_.live().Erase(a[3]);
  arena_.AddFree(a[3], kS, 1);
  EXPECT_EQ(arena_.live().Find(a[3]->addr), nullptr);
  EXPECT_EQ(arena_.live().count(), 7u);
  EXPECT_VALID(arena_);
}

TEST_F(ArenaTest, CheckInvariantsReportsViolations) {
  std::vector<Block*> a = EightBlocks();
  arena_.AddFree(a[2], kS, 1);
  ASSERT_VALID(arena_);
  // A free block whose tag changed while in the set is not where the set files it.
  a[2]->stream = kT;
  EXPECT_THAT(arena_.CheckInvariants(), HasSubstr("not in the bin of its size and tag"));
  a[2]->stream = kS;
  ASSERT_VALID(arena_);
  // A block claiming the wrong state.
  a[5]->state = BlockState::kFree;
  EXPECT_THAT(arena_.CheckInvariants(), HasSubstr("free set disagrees"));
  a[5]->state = BlockState::kUnmapped;
  EXPECT_THAT(arena_.CheckInvariants(), HasSubstr("gap set disagrees"));
  a[5]->state = BlockState::kAllocated;
  ASSERT_VALID(arena_);
  // Sizes that leave a hole.
  a[6]->size -= 512;
  EXPECT_THAT(arena_.CheckInvariants(), HasSubstr("hole or overlap"));
  a[6]->size += 512;
  ASSERT_VALID(arena_);
  // Two adjacent retired blocks.
  a[6]->state = BlockState::kRetired;
  a[7]->state = BlockState::kRetired;
  EXPECT_THAT(arena_.CheckInvariants(), HasSubstr("uncoalesced retired blocks"));
  a[7]->state = BlockState::kAllocated;
  ASSERT_VALID(arena_);
}

// --- Randomized, against a model of 512-byte units -----------------------------------------------

// What one 512-byte unit of the arena belongs to.
struct Unit {
  BlockState state = BlockState::kUnmapped;
  Stream tag = kAnyStream;  // kFree
  int id = 0;               // kAllocated: which allocation
};

struct Span {
  size_t first;  // unit index
  size_t units;
  Unit unit;
};

// The blocks the arena must hold for the given units: maximal runs of units that coalesce
// (free with equal tags, gaps, retired), each allocation on its own.
std::vector<Span> Spans(const std::vector<Unit>& units) {
  std::vector<Span> runs;
  for (size_t i = 0; i < units.size(); ++i) {
    const Unit& u = units[i];
    if (!runs.empty()) {
      const Unit& p = runs.back().unit;
      bool same = p.state == u.state;
      if (same && u.state == BlockState::kFree) same = p.tag == u.tag;
      if (same && u.state == BlockState::kAllocated) same = p.id == u.id;
      if (same) {
        ++runs.back().units;
        continue;
      }
    }
    runs.push_back(Span{i, 1, u});
  }
  return runs;
}

TEST(ArenaRandomTest, RandomOperationsAgainstAUnitModel) {
  constexpr size_t kUnit = 512;
  constexpr size_t kUnits = 512;  // a 256 KiB arena
  constexpr size_t kGranule = 8;  // growth granularity: 4 KiB
  const std::vector<Stream> streams = {0, kS, kT};
  std::mt19937_64 rng(424242);
  Arena arena;
  arena.Init(kBase, kUnits * kUnit, 9);
  std::vector<Unit> model(kUnits);
  std::map<int, Block*> allocations;
  int next_id = 1;
  uint64_t seq = 0;
  auto addr_of = [](size_t unit) { return kBase + unit * kUnit; };
  auto unit_of = [](uintptr_t addr) { return static_cast<size_t>((addr - kBase) / kUnit); };
  auto set_units = [&](uintptr_t addr, size_t size, Unit u) {
    for (size_t i = unit_of(addr); i < unit_of(addr + size); ++i) model[i] = u;
  };
  auto pick_stream = [&]() { return streams[rng() % streams.size()]; };
  auto random_units = [&]() -> size_t { return rng() % 8 == 0 ? rng() % 96 + 1 : rng() % 16 + 1; };

  // The model's best fit, as FreeBlocks documents it.
  auto model_best_fit = [&](Stream s, size_t n) -> std::optional<size_t> {
    std::optional<Span> own, any;
    for (const Span& r : Spans(model)) {
      if (r.unit.state != BlockState::kFree || r.units * kUnit < n) continue;
      std::optional<Span>* slot = r.unit.tag == s            ? &own
                                  : r.unit.tag == kAnyStream ? &any
                                                             : nullptr;
      if (slot == nullptr) continue;
      if (!*slot || r.units < (*slot)->units) *slot = r;  // runs come in address order
    }
    if (s == kAnyStream) return own ? std::optional<size_t>(own->first) : std::nullopt;
    std::optional<Span> best = own;
    if (!own || (any && any->units < own->units)) best = any;
    if (!best) return std::nullopt;
    return best->first;
  };

  // The fewest granules a growth for (n, s) needs, by brute force over every granule-aligned
  // range of every gap.
  auto model_min_growth = [&](Stream s, size_t n) -> std::optional<size_t> {
    std::optional<size_t> best;
    const std::vector<Span> runs = Spans(model);
    for (size_t i = 0; i < runs.size(); ++i) {
      if (runs[i].unit.state != BlockState::kUnmapped) continue;
      auto usable = [&](size_t j) {
        return runs[j].unit.state == BlockState::kFree &&
               (runs[j].unit.tag == s || runs[j].unit.tag == kAnyStream);
      };
      const size_t left = i > 0 && usable(i - 1) ? runs[i - 1].units : 0;
      const size_t right = i + 1 < runs.size() && usable(i + 1) ? runs[i + 1].units : 0;
      const size_t g0 = runs[i].first / kGranule;
      const size_t g1 = (runs[i].first + runs[i].units) / kGranule;
      for (size_t x = g0; x < g1; ++x) {
        for (size_t y = x + 1; y <= g1; ++y) {
          const size_t total = (y - x) * kGranule + (x == g0 ? left : 0) + (y == g1 ? right : 0);
          if (total * kUnit >= n && (!best || y - x < *best)) best = y - x;
        }
      }
    }
    return best;
  };

  auto check = [&](int step, const char* op) {
    ASSERT_EQ(arena.CheckInvariants(), "") << "step " << step << " " << op;
    const std::vector<Span> runs = Spans(model);
    size_t i = 0;
    for (const Block* b = arena.head(); b != nullptr; b = b->next, ++i) {
      ASSERT_LT(i, runs.size()) << "step " << step << " " << op << ": " << Layout(arena);
      const Span& r = runs[i];
      ASSERT_EQ(b->addr, addr_of(r.first)) << "step " << step << " " << op << ": " << Layout(arena);
      ASSERT_EQ(b->size, r.units * kUnit) << "step " << step << " " << op << ": " << Layout(arena);
      ASSERT_EQ(b->state, r.unit.state) << "step " << step << " " << op;
      if (b->state == BlockState::kFree) {
        ASSERT_EQ(b->stream, r.unit.tag) << "step " << step << " " << op << ": " << Layout(arena);
      }
      if (b->state == BlockState::kAllocated) {
        ASSERT_EQ(allocations.at(r.unit.id), b) << "step " << step << " " << op;
      }
    }
    ASSERT_EQ(i, runs.size()) << "step " << step << " " << op;
    ASSERT_EQ(arena.live().count(), allocations.size());
  };

  auto free_blocks = [&]() {
    std::vector<Block*> out;
    arena.free_blocks().ForEach([&](Block* b) { out.push_back(b); });
    std::sort(out.begin(), out.end(), [](Block* a, Block* b) { return a->addr < b->addr; });
    return out;
  };

  for (int step = 0; step < 4000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    const char* name = "";
    if (op < 40) {
      name = "allocate";
      const Stream s = pick_stream();
      const size_t n = random_units() * kUnit;
      Block* b = arena.BestFit(s, n);
      std::optional<size_t> want = model_best_fit(s, n);
      ASSERT_EQ(b != nullptr, want.has_value()) << "step " << step;
      if (b == nullptr) {
        // Grow, as the pool does when nothing fits.
        name = "grow";
        std::optional<Arena::GrowthPlan> plan = arena.PlanGrowth(n, s, kGranule * kUnit, false);
        std::optional<size_t> min_granules = model_min_growth(s, n);
        ASSERT_EQ(plan.has_value(), min_granules.has_value()) << "step " << step;
        if (!plan) continue;
        ASSERT_EQ(plan->len, *min_granules * kGranule * kUnit) << "step " << step;
        ASSERT_EQ(plan->gap->state, BlockState::kUnmapped);
        ASSERT_GE(plan->addr, plan->gap->addr);
        ASSERT_LE(plan->addr + plan->len, plan->gap->end());
        if (rng() % 2 == 0) Arena::Extend(*plan, (rng() % 4) * kGranule * kUnit);
        // The model: the new units, then the usable neighbouring runs take the tag.
        const size_t lo = unit_of(plan->addr);
        const size_t hi = unit_of(plan->addr + plan->len);
        auto usable = [&](size_t u) {
          return model[u].state == BlockState::kFree &&
                 (model[u].tag == s || model[u].tag == kAnyStream);
        };
        if (hi < kUnits && usable(hi)) {
          const Stream old = model[hi].tag;
          for (size_t u = hi;
               u < kUnits && model[u].state == BlockState::kFree && model[u].tag == old; ++u) {
            model[u].tag = s;
          }
        }
        if (lo > 0 && usable(lo - 1)) {
          const Stream old = model[lo - 1].tag;
          for (size_t u = lo;
               u-- > 0 && model[u].state == BlockState::kFree && model[u].tag == old;) {
            model[u].tag = s;
          }
        }
        set_units(plan->addr, plan->len, Unit{BlockState::kFree, s, 0});
        Block* grown = arena.CommitGrowth(*plan, s, false);
        ASSERT_EQ(grown->state, BlockState::kFree);
        ASSERT_LE(grown->addr, plan->addr);
        ASSERT_GE(grown->end(), plan->addr + plan->len);
        ASSERT_NO_FATAL_FAILURE(check(step, name));
        // The growth serves the request.
        b = arena.BestFit(s, n);
        ASSERT_NE(b, nullptr) << "step " << step << ": growth did not make room for " << n;
        want = model_best_fit(s, n);
        ASSERT_TRUE(want.has_value());
        name = "allocate after growth";
      }
      ASSERT_EQ(b->addr, addr_of(*want)) << "step " << step << ": " << Layout(arena);
      arena.Take(b, n, kUnit);
      b->stream = s;
      arena.live().Insert(b);
      allocations[next_id] = b;
      set_units(b->addr, n, Unit{BlockState::kAllocated, s, next_id});
      ++next_id;
    } else if (op < 65) {
      name = "free";
      if (allocations.empty()) continue;
      auto it = allocations.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % allocations.size()));
      Block* b = it->second;
      const uintptr_t addr = b->addr;
      const size_t size = b->size;
      const int r = static_cast<int>(rng() % 4);
      const Stream tag = r < 2 ? b->stream : r == 2 ? kAnyStream : pick_stream();
      arena.live().Erase(b);
      allocations.erase(it);
      Block* merged = arena.AddFree(b, tag, ++seq);
      ASSERT_EQ(merged->state, BlockState::kFree);
      ASSERT_EQ(merged->stream, tag);
      ASSERT_EQ(merged->free_seq, seq);  // the newest free
      ASSERT_LE(merged->addr, addr);
      ASSERT_GE(merged->end(), addr + size);
      set_units(addr, size, Unit{BlockState::kFree, tag, 0});
    } else if (op < 68) {
      name = "retire";
      if (allocations.empty()) continue;
      auto it = allocations.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % allocations.size()));
      Block* b = it->second;
      set_units(b->addr, b->size, Unit{BlockState::kRetired, kAnyStream, 0});
      arena.live().Erase(b);
      allocations.erase(it);
      arena.Retire(b);
    } else if (op < 76) {
      name = "retag";
      std::vector<Block*> cached = free_blocks();
      if (cached.empty()) continue;
      Block* b = cached[rng() % cached.size()];
      const Stream tag = rng() % 3 == 0 ? kAnyStream : pick_stream();
      set_units(b->addr, b->size, Unit{BlockState::kFree, tag, 0});
      Block* r = arena.Retag(b, tag);
      ASSERT_EQ(r->stream, tag);
    } else if (op < 82) {
      name = "narrow";
      const Stream s = pick_stream();
      // Model: each kAnyStream run next to a run of s takes s's tag.
      const std::vector<Span> runs = Spans(model);
      auto is_s = [&](size_t j) {
        return runs[j].unit.state == BlockState::kFree && runs[j].unit.tag == s;
      };
      for (size_t j = 0; j < runs.size(); ++j) {
        if (runs[j].unit.state != BlockState::kFree || runs[j].unit.tag != kAnyStream) continue;
        if ((j > 0 && is_s(j - 1)) || (j + 1 < runs.size() && is_s(j + 1))) {
          for (size_t u = runs[j].first; u < runs[j].first + runs[j].units; ++u) {
            model[u].tag = s;
          }
        }
      }
      arena.NarrowAnyTo(s);
    } else if (op < 95) {
      name = "release chunk";
      // A run of 1-3 granules holding only free or retired memory (some of it mapped), as
      // when the pool releases chunks.
      auto releasable = [&](size_t g) {
        bool mapped = false;
        for (size_t u = g * kGranule; u < (g + 1) * kGranule; ++u) {
          if (model[u].state != BlockState::kFree && model[u].state != BlockState::kRetired &&
              model[u].state != BlockState::kUnmapped) {
            return false;
          }
          mapped |= model[u].state != BlockState::kUnmapped;
        }
        return mapped;
      };
      std::vector<size_t> candidates;
      for (size_t g = 0; g < kUnits / kGranule; ++g) {
        if (releasable(g)) candidates.push_back(g);
      }
      if (candidates.empty()) continue;
      const size_t g = candidates[rng() % candidates.size()];
      size_t granules = 1;
      while (granules < 3 && g + granules < kUnits / kGranule && releasable(g + granules)) {
        ++granules;
      }
      // Each maximal mapped run of the range is one MakeGap (granules are mapped whole, so
      // this is the whole range).
      const size_t end = (g + granules) * kGranule;
      for (size_t u = g * kGranule; u < end;) {
        if (model[u].state == BlockState::kUnmapped) {
          ++u;
          continue;
        }
        size_t v = u;
        while (v < end && model[v].state != BlockState::kUnmapped) ++v;
        arena.MakeGap(addr_of(u), (v - u) * kUnit);
        for (size_t w = u; w < v; ++w) model[w] = Unit{};
        ASSERT_EQ(arena.CheckInvariants(), "") << "step " << step;
        u = v;
      }
    } else {
      name = "retire chunk space";
      // As the pool does when a chunk is exported: the free memory inside it retires.
      const size_t first = (rng() % (kUnits / kGranule)) * kGranule;
      const uintptr_t lo = addr_of(first);
      const uintptr_t hi = addr_of(first + kGranule);
      size_t expected = 0;
      for (size_t u = first; u < first + kGranule; ++u) {
        if (model[u].state != BlockState::kFree) continue;
        model[u] = Unit{BlockState::kRetired, kAnyStream, 0};
        expected += kUnit;
      }
      EXPECT_EQ(arena.RetireFree(lo, hi), expected) << "step " << step;
    }
    ASSERT_NO_FATAL_FAILURE(check(step, name));
    for (const auto& [id, b] : allocations) ASSERT_EQ(arena.live().Find(b->addr), b);
  }
}

}  // namespace
}  // namespace vmm
