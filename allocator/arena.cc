#include "allocator/arena.h"

#include <algorithm>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace vmm {
namespace {

size_t RoundUp(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

Arena::~Arena() {
  for (Block* b = head_; b != nullptr;) {
    Block* next = b->next;
    delete b;
    b = next;
  }
  for (Block* b : spare_) delete b;
}

void Arena::Init(uintptr_t base, size_t size, int slot_shift) {
  base_ = base;
  size_ = size;
  live_.Init(base, size, slot_shift);
  head_ = NewBlock();
  head_->addr = base;
  head_->size = size;
  head_->state = BlockState::kUnmapped;
  gaps_.insert(head_);
}

void Arena::EraseGap(Block* gap) { gaps_.erase(gap); }

Block* Arena::Split(Block* block, uintptr_t at) {
  const bool cached = block->state == BlockState::kFree;
  const bool gap = block->state == BlockState::kUnmapped;
  if (cached) free_.Remove(block);
  Block* upper = CutAt(block, at);
  if (cached) {
    free_.Insert(block);
    free_.Insert(upper);
  }
  if (gap) gaps_.insert(upper);
  return upper;
}

Block* Arena::Retag(Block* block, Stream stream) {
  free_.Remove(block);
  block->stream = stream;
  return CoalesceFree(block);
}

void Arena::NarrowAnyTo(Stream stream) {
  if (stream == kAnyStream) return;
  auto free_of = [](const Block* b, Stream tag) {
    return b != nullptr && b->state == BlockState::kFree && b->stream == tag;
  };
  // From the smaller side (each a miss: with many free blocks for every stream and few of
  // `stream`'s, visiting every one of the former cost each miss a pass over them). Free blocks
  // of one tag are never neighbours (they merge), so the kAnyStream blocks retagged are those
  // beside a block of `stream` either way. A block merged away meanwhile (deleted: size 0, or
  // retagged) is passed over.
  if (free_.CountOf(stream) < free_.CountOf(kAnyStream)) {
    for (Block* b : free_.BlocksOf(stream)) {
      if (b->size == 0 || !free_of(b, stream)) continue;
      // Until no kAnyStream block borders it: a retagged neighbour also merges with the block
      // of `stream` beyond it ([s][*][s][*]: the first retag joins the first three), whose
      // other neighbour may be another kAnyStream block of the same run. Each retag merges
      // the neighbour and `b` into one block, so the loops end.
      while (free_of(b->next, kAnyStream)) b = Retag(b->next, stream);
      while (free_of(b->prev, kAnyStream)) b = Retag(b->prev, stream);
    }
    return;
  }
  for (Block* b : free_.BlocksOf(kAnyStream)) {
    if (b->size == 0 || !free_of(b, kAnyStream)) continue;
    if (free_of(b->next, stream) || free_of(b->prev, stream)) Retag(b, stream);
  }
}

Block* Arena::Retire(Block* block) {
  if (block->state == BlockState::kFree) free_.Remove(block);
  block->state = BlockState::kRetired;
  block->requested = 0;
  block->stream_uses.clear();
  if (block->next != nullptr && CanMerge(block, block->next)) block = Join(block, block->next);
  if (block->prev != nullptr && CanMerge(block->prev, block)) block = Join(block->prev, block);
  return block;
}

void Arena::Hold(Block* block) {
  free_.Remove(block);
  block->state = BlockState::kPendingFree;
}

size_t Arena::RetireFree(uintptr_t lo, uintptr_t hi) {
  size_t retired = 0;
  Block* b = BlockContaining(lo);
  while (b != nullptr && b->addr < hi) {
    Block* next = b->next;
    if (b->state == BlockState::kFree) {
      if (b->addr < lo) {
        b = Split(b, lo);
        next = b->next;
      }
      if (b->end() > hi) {
        Split(b, hi);
        next = nullptr;
      }
      retired += b->size;
      Retire(b);
    }
    b = next;
  }
  return retired;
}

std::optional<Arena::GrowthPlan> Arena::PlanGrowth(size_t n, Stream stream, size_t granularity,
                                                   bool alone) const {
  return PlanGrowth(n, stream, granularity, alone, [](const GrowthPlan& p) { return p.len; });
}

template <typename F>
bool Arena::ForEachGrowthPlan(size_t n, Stream stream, size_t granularity, bool alone,
                              F&& f) const {
  auto usable = [&](const Block* b) { return !alone && UsableBy(b, stream); };
  // None of no length: a free neighbour that holds the request already is the cache's, not a
  // growth's.
  auto offer = [&](Block* gap, uintptr_t addr, size_t len, GrowthPlan::Side side) {
    return len != 0 && len <= gap->size && f(GrowthPlan{gap, addr, len, side});
  };
  for (Block* gap : gaps_) {
    const size_t left = usable(gap->prev) ? gap->prev->size : 0;
    const size_t right = usable(gap->next) ? gap->next->size : 0;
    if (offer(gap, gap->addr, RoundUp(n - std::min(n, left), granularity),
              left > 0 ? GrowthPlan::Side::kLeft : GrowthPlan::Side::kAlone)) {
      return true;
    }
    if (right > 0) {
      const size_t len = RoundUp(n - std::min(n, right), granularity);
      if (len <= gap->size && offer(gap, gap->end() - len, len, GrowthPlan::Side::kRight)) {
        return true;
      }
    }
    if (left > 0 && right > 0 && left + gap->size + right >= n &&
        offer(gap, gap->addr, gap->size, GrowthPlan::Side::kBoth)) {
      return true;
    }
  }
  return false;
}

std::optional<Arena::GrowthPlan> Arena::PlanGrowth(
    size_t n, Stream stream, size_t granularity, bool alone,
    absl::FunctionRef<size_t(const GrowthPlan&)> cost) const {
  std::optional<GrowthPlan> best;
  size_t best_cost = 0;
  ForEachGrowthPlan(n, stream, granularity, alone, [&](const GrowthPlan& plan) {
    const size_t c = cost(plan);
    if (!best || std::make_tuple(c, plan.len, plan.addr) <
                     std::make_tuple(best_cost, best->len, best->addr)) {
      best = plan;
      best_cost = c;
    }
    return false;  // every candidate
  });
  return best;
}

bool Arena::HasGrowthRoomFor(size_t n, Stream stream, size_t granularity) const {
  return ForEachGrowthPlan(n, stream, granularity, /*alone=*/false,
                           [](const GrowthPlan&) { return true; });  // the first will do
}

void Arena::Extend(GrowthPlan& plan, size_t extra) {
  const Block* gap = plan.gap;
  switch (plan.side) {
    case GrowthPlan::Side::kBoth:
      return;
    case GrowthPlan::Side::kRight: {
      const size_t room = plan.addr - gap->addr;
      const size_t add = std::min(extra, room);
      plan.addr -= add;
      plan.len += add;
      return;
    }
    case GrowthPlan::Side::kLeft:
    case GrowthPlan::Side::kAlone: {
      const size_t room = gap->end() - (plan.addr + plan.len);
      plan.len += std::min(extra, room);
      return;
    }
  }
}

bool Arena::UsableBy(const Block* block, Stream stream) {
  return block != nullptr && block->state == BlockState::kFree &&
         (block->stream == stream || block->stream == kAnyStream);
}

Block* Arena::CommitGrowth(const GrowthPlan& plan, Stream stream, bool alone) {
  Block* block = plan.gap;
  if (plan.addr > block->addr) block = Split(block, plan.addr);
  if (block->end() > plan.addr + plan.len) Split(block, plan.addr + plan.len);
  gaps_.erase(block);
  block->state = BlockState::kFree;
  block->stream = stream;
  block->free_seq = 0;
  if (!alone) {
    // Neighbours the stream may use join the new memory (a kAnyStream one takes its tag).
    if (UsableBy(block->next, stream)) {
      free_.Remove(block->next);
      block = Join(block, block->next);
    }
    if (UsableBy(block->prev, stream)) {
      free_.Remove(block->prev);
      block = Join(block->prev, block);
    }
    // A narrowed neighbour may now match the tag of the block beyond it.
    return CoalesceFree(block);
  }
  free_.Insert(block);
  return block;
}

Block* Arena::Reopen(uintptr_t lo, uintptr_t hi, Stream stream) {
  Block* block = BlockContaining(lo);
  if (block == nullptr || block->state != BlockState::kRetired || block->end() < hi) {
    return nullptr;
  }
  if (block->addr < lo) block = Split(block, lo);
  if (block->end() > hi) Split(block, hi);
  block->state = BlockState::kFree;
  block->stream = stream;
  block->free_seq = 0;
  free_.Insert(block);
  return block;
}

void Arena::MakeGap(uintptr_t addr, size_t len) {
  Block* block = BlockContaining(addr);
  if (block->addr < addr) block = Split(block, addr);
  const uintptr_t end = addr + len;
  Block* last = block;
  while (last->end() < end) last = last->next;
  if (last->end() > end) Split(last, end);
  // Now [addr, end) is exactly block..last.
  for (Block* b = block;; b = b->next) {
    if (b->state == BlockState::kFree) free_.Remove(b);
    b->state = BlockState::kUnmapped;
    b->stream = kAnyStream;
    if (b == last) break;
  }
  while (block->next != nullptr && block->end() < end) {
    Block* b = block->next;
    block->size += b->size;
    block->next = b->next;
    if (b->next != nullptr) b->next->prev = block;
    DeleteBlock(b);
  }
  gaps_.insert(block);
  // A gap never spans a seam (ExtendRange): cut it at those inside it, and join neighbours only
  // across addresses that are none.
  for (auto seam = seams_.upper_bound(block->addr); seam != seams_.end() && *seam < end;
       ++seam) {
    block = Split(block, *seam);
  }
  while (block->prev != nullptr && block->prev->addr >= addr) block = block->prev;
  Block* last_gap = block;
  while (last_gap->end() < end) last_gap = last_gap->next;
  if (last_gap->next != nullptr && last_gap->next->state == BlockState::kUnmapped &&
      !seams_.contains(last_gap->end())) {
    Join(last_gap, last_gap->next);
  }
  if (block->prev != nullptr && block->prev->state == BlockState::kUnmapped &&
      !seams_.contains(block->addr)) {
    Join(block->prev, block);
  }
}

void Arena::ExtendRange(size_t more) {
  if (more == 0 || more % 512 != 0) return;  // nothing a block could take
  const uintptr_t at = base_ + size_;
  Block* last = BlockContaining(at - 1);
  size_ += more;
  live_.Resize(size_);
  Block* gap = NewBlock();
  gap->addr = at;
  gap->size = more;
  gap->state = BlockState::kUnmapped;
  gap->stream = kAnyStream;
  gap->prev = last;
  last->next = gap;
  gaps_.insert(gap);
  seams_.insert(at);
}

Block* Arena::BlockContaining(uintptr_t addr) const {
  if (head_ == nullptr || !Contains(addr)) return nullptr;
  auto distance = [addr](const Block* b) {
    return b->addr > addr ? b->addr - addr : addr - b->addr;
  };
  Block* b = head_;
  uintptr_t best = distance(b);
  for (Block* candidate : near_) {
    if (candidate != nullptr && candidate->size != 0 && distance(candidate) < best) {
      b = candidate;
      best = distance(candidate);
    }
  }
  // Blocks tile the arena in address order.
  while (b != nullptr && addr < b->addr) b = b->prev;
  while (b != nullptr && addr >= b->end()) b = b->next;
  if (b == nullptr || addr < b->addr) return nullptr;
  near_[(addr >> 21) & ((1 << kNearBits) - 1)] = b;
  return b;
}

std::string Arena::CheckInvariants() const {
  if (head_ == nullptr) return size_ == 0 ? "" : "arena has no blocks";
  if (head_->addr != base_ || head_->prev != nullptr) return "first block is not at the base";
  size_t free_count = 0;
  size_t gap_count = 0;
  uintptr_t expect = base_;
  for (const Block* b = head_; b != nullptr; b = b->next) {
    if (b->addr != expect) return absl::StrCat("hole or overlap at 0x", absl::Hex(expect));
    if (b->size == 0) return absl::StrCat("empty block at 0x", absl::Hex(b->addr));
    if (b->addr % 512 != 0) return absl::StrCat("misaligned block at 0x", absl::Hex(b->addr));
    if (b->next != nullptr && b->next->prev != b) return "broken prev link";
    if (b->next != nullptr && CanMerge(b, b->next) &&
        !(b->state == BlockState::kUnmapped && seams_.contains(b->next->addr))) {
      return absl::StrCat("uncoalesced ", BlockStateName(b->state), " blocks at 0x",
                          absl::Hex(b->addr));
    }
    const bool in_free = free_.Contains(b);
    if ((b->state == BlockState::kFree) != in_free) {
      return absl::StrCat("free set disagrees with block at 0x", absl::Hex(b->addr));
    }
    if (in_free && !free_.Filed(b)) {
      return absl::StrCat("free block at 0x", absl::Hex(b->addr), " is not in the bin of its ",
                          "size and tag");
    }
    if (b->state == BlockState::kUnmapped) {
      auto seam = seams_.upper_bound(b->addr);
      if (seam != seams_.end() && *seam < b->end()) {
        return absl::StrCat("gap at 0x", absl::Hex(b->addr), " spans the seam at 0x",
                            absl::Hex(*seam));
      }
    }
    const bool in_gaps = gaps_.count(const_cast<Block*>(b)) != 0;
    if ((b->state == BlockState::kUnmapped) != in_gaps) {
      return absl::StrCat("gap set disagrees with block at 0x", absl::Hex(b->addr));
    }
    free_count += in_free;
    gap_count += in_gaps;
    expect = b->end();
  }
  if (expect != base_ + size_) return "blocks do not reach the end of the arena";
  if (free_count != free_.count()) return "free set holds blocks not in the arena";
  if (gap_count != gaps_.size()) return "gap set holds blocks not in the arena";
  return "";
}

}  // namespace vmm
