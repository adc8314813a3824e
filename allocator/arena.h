// arena.h: the blocks of one part of a pool's reserved address range.
//
// An Arena owns the Blocks that tile [base, base + size) in address order (block.h): gaps
// with no memory behind them, cached free blocks (kept in a FreeBlocks set), allocated,
// pending and retired blocks. It splits and coalesces blocks and plans where growth should
// map memory, but calls no driver and takes no lock: the owning Pool does both, and guards
// the arena with its mutex.
//
// Coalescing rule: adjacent free blocks merge when their stream tags are equal; adjacent gaps
// merge; adjacent retired blocks merge. New memory is tagged with the stream it is grown for
// and absorbs neighbours that stream may use (narrowing a kAnyStream neighbour to that stream,
// which is never less safe).
#ifndef VMM_ALLOCATOR_ARENA_H_
#define VMM_ALLOCATOR_ARENA_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/btree_set.h"
#include "absl/functional/function_ref.h"
#include "allocator/block.h"
#include "allocator/block_index.h"
#include "allocator/free_blocks.h"

namespace vmm {

class Arena {
 public:
  // Where growth maps memory: [addr, addr + len) inside `gap`. Extending grows away from the
  // free neighbour the plan attaches to.
  struct GrowthPlan {
    Block* gap = nullptr;
    uintptr_t addr = 0;
    size_t len = 0;
    enum class Side { kLeft, kRight, kBoth, kAlone } side = Side::kAlone;
  };

  Arena() = default;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Makes the whole range one gap. Live blocks are indexed in slots of 1 << slot_shift bytes
  // (block_index.h): allocated blocks must start at least that far apart.
  void Init(uintptr_t base, size_t size, int slot_shift);

  uintptr_t base() const { return base_; }
  size_t size() const { return size_; }
  bool Contains(uintptr_t addr) const { return addr >= base_ && addr < base_ + size_; }
  Block* head() const { return head_; }
  const FreeBlocks& free_blocks() const { return free_; }
  // The resets of the cached blocks' statistics (FreeBlocks::block_stat, byte_stat).
  void ResetFreeStatPeaks() { free_.ResetStatPeaks(); }
  void ResetFreeStatAccumulated() { free_.ResetStatAccumulated(); }
  // The allocated blocks by address (the pool inserts and erases them).
  BlockIndex& live() { return live_; }
  const BlockIndex& live() const { return live_; }

  // Best-fit cached block for `n` bytes on `stream`, or nullptr.
  Block* BestFit(Stream stream, size_t n) const { return free_.BestFit(stream, n); }

  // Splits `block` at `at` (strictly inside it). Both parts keep the state and tag; free
  // parts stay in the free set. Returns the upper part.
  Block* Split(Block* block, uintptr_t at);

  // Takes the first `n` bytes of a kFree block out of the cache: it becomes kAllocated (the
  // caller fills it in) and a remainder of at least `min_rest` bytes stays cached.
  void Take(Block* block, size_t n, size_t min_rest);

  // Puts `block` in the cache with tag `stream`, coalescing with free neighbours. Returns the
  // block that now holds its bytes (possibly merged).
  Block* AddFree(Block* block, Stream stream, uint64_t free_seq);
  // Changes a cached block's tag (and coalesces); returns the resulting block.
  Block* Retag(Block* block, Stream stream);

  // Merges cached kAnyStream blocks with neighbouring blocks of `stream`, the merged block
  // taking `stream`'s tag (for a request of `stream` that no single block fits). Every
  // kAnyStream block beside a block of `stream` is retagged: a run of free blocks whose tags
  // alternate between the two becomes one block.
  void NarrowAnyTo(Stream stream);

  // Marks `block` retired (not cached), merging with retired neighbours.
  Block* Retire(Block* block);
  // Takes a cached block out of the cache as kPendingFree (freed; work of its stream may still
  // use it), merged with nothing: the caller makes it wait (Pool::HoldSpaceForItsStreams).
  void Hold(Block* block);
  // Retires every free block inside [lo, hi), splitting those that cross its ends (what an
  // exported chunk's free space becomes). Returns the bytes retired.
  size_t RetireFree(uintptr_t lo, uintptr_t hi);

  // Where to map memory so that a block of `n` bytes fits for `stream` with the fewest new
  // bytes (multiples of `granularity`). nullopt when no gap is large enough. `alone` plans a
  // range that takes nothing from free neighbours (for blocks that get chunks of their own);
  // the range may still border them (see CommitGrowth).
  std::optional<GrowthPlan> PlanGrowth(size_t n, Stream stream, size_t granularity,
                                       bool alone) const;
  // Whether PlanGrowth(n, stream, granularity, alone = false) would find a plan: stops at the
  // first gap that holds one (a pool's check that its small arena's range is full).
  bool HasGrowthRoomFor(size_t n, Stream stream, size_t granularity) const;
  // The same, but of the candidate ranges picks the one for which `cost` is least (the pool's
  // GrowthCost, reclaim_policy.h: what a plan would create once pages are moved to it, and a
  // share for the moves); ties go to the fewest new bytes, then the lower address.
  std::optional<GrowthPlan> PlanGrowth(size_t n, Stream stream, size_t granularity, bool alone,
                                       absl::FunctionRef<size_t(const GrowthPlan&)> cost) const;
  // Grows `plan` by up to `extra` bytes (within its gap, away from its free neighbour).
  static void Extend(GrowthPlan& plan, size_t extra);
  // Turns the planned range into a free block tagged `stream`, merged with the free
  // neighbours `stream` may use unless `alone`. Returns the block. With `alone` the block may
  // border a free block of the same tag without merging, which CheckInvariants reports as
  // uncoalesced: the caller must Take the block at once and Retire whatever Take left of it
  // (Pool::AllocateLocked does both for shareable blocks under its lock, so the pool never
  // shows that state).
  Block* CommitGrowth(const GrowthPlan& plan, Stream stream, bool alone);

  // Turns the retired range [lo, hi) (inside one retired block) into a free block tagged
  // `stream`, not merged with free neighbours, as CommitGrowth(alone) does: the caller takes it
  // at once. nullptr if [lo, hi) is not inside a retired block.
  Block* Reopen(uintptr_t lo, uintptr_t hi, Stream stream);

  // Turns [addr, addr + len), which must hold only free or retired blocks, into a gap: one
  // for each side of any seam inside it (ExtendRange), each joined with the gaps beside it on
  // its own side.
  void MakeGap(uintptr_t addr, size_t len);

  // Lengthens the arena by `more` bytes (nonzero, a multiple of 512) at its end (the pool reserved
  // them after its range): they become a gap of their own. The address where they start is a seam:
  // gaps never span one, so that a growth, which maps and grants access inside one gap, never
  // crosses from one reservation into the next (driver.h ReserveAt). Free and allocated blocks may.
  void ExtendRange(size_t more);

  // The block containing `addr`, or nullptr. A walk of the block list from the nearest of the
  // blocks it found before (near_), or from the first: for slow paths (exports, releases,
  // moves), where a walk from the first block cost a send milliseconds with 100,000 blocks.
  Block* BlockContaining(uintptr_t addr) const;

  // Checks the arena's own invariants; returns a description of the first violation, or "".
  std::string CheckInvariants() const;

 private:
  // Offers `f` each candidate plan of PlanGrowth (per gap: joining the free neighbour before
  // it or none, joining the one after it, mapping the gap whole between both); stops and
  // returns true once `f` does.
  template <typename F>
  bool ForEachGrowthPlan(size_t n, Stream stream, size_t granularity, bool alone, F&& f) const;
  static bool CanMerge(const Block* a, const Block* b);
  // Whether `block` is cached and may be taken by `stream`.
  static bool UsableBy(const Block* block, Stream stream);
  Block* NewBlock();
  void DeleteBlock(Block* block);
  // Cuts `block` at `at` (strictly inside it): a new Block with the same state, tag and
  // free_seq takes [at, end), linked after it. Touches neither the free nor the gap set.
  Block* CutAt(Block* block, uintptr_t at);
  void EraseGap(Block* gap);
  // Merges `b` into `a` (a->next == b) and returns a. `b` may not be in the free set; `a` may
  // if its tag does not change (the caller then calls free_.Resized(a)).
  Block* Join(Block* a, Block* b);
  // Merges a kFree block that is not in the free set with its neighbours, then adds it.
  Block* CoalesceFree(Block* block);

  uintptr_t base_ = 0;
  size_t size_ = 0;
  Block* head_ = nullptr;
  FreeBlocks free_;
  BlockIndex live_;
  struct ByAddr {
    bool operator()(const Block* a, const Block* b) const { return a->addr < b->addr; }
  };
  absl::btree_set<Block*, ByAddr> gaps_;
  absl::btree_set<uintptr_t> seams_;  // where ExtendRange lengthened the arena
  std::vector<Block*> spare_;  // recycled Block objects
  // BlockContaining's starting points: the blocks it found, by 2 MiB region of the address
  // asked for. Block objects live as long as the arena; a deleted one (in spare_) has size 0
  // and is passed over, and any other is in the list, so a walk may start from it.
  static constexpr int kNearBits = 6;
  mutable std::array<Block*, 1 << kNearBits> near_{};
};

// The operations of the pool's cached path are inline.

inline Block* Arena::NewBlock() {
  if (spare_.empty()) return new Block();
  Block* b = spare_.back();
  spare_.pop_back();
  return b;
}

inline void Arena::DeleteBlock(Block* block) {
  block->prev = block->next = nullptr;
  block->size = 0;  // passed over as a starting point (near_)
  block->stream_uses.clear();
  block->pending_events = 0;
  block->requested = 0;
  spare_.push_back(block);
}

inline Block* Arena::CutAt(Block* block, uintptr_t at) {
  Block* upper = NewBlock();
  upper->addr = at;
  upper->size = block->end() - at;
  upper->state = block->state;
  upper->stream = block->stream;
  upper->free_seq = block->free_seq;
  upper->prev = block;
  upper->next = block->next;
  if (block->next != nullptr) block->next->prev = upper;
  block->next = upper;
  block->size = at - block->addr;
  return upper;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void Arena::Take(Block* block, size_t n, size_t min_rest) {
  if (block->size - n >= min_rest) {
    Block* rest = CutAt(block, block->addr + n);
    free_.Replace(block, rest, rest->size);
  } else {
    free_.Remove(block);
  }
  block->state = BlockState::kAllocated;
}

inline bool Arena::CanMerge(const Block* a, const Block* b) {
  if (a->state != b->state) return false;
  switch (a->state) {
    case BlockState::kFree:
      return a->stream == b->stream;
    case BlockState::kUnmapped:
    case BlockState::kRetired:
      return true;
    default:
      return false;
  }
}

inline Block* Arena::Join(Block* a, Block* b) {
  if (a->state == BlockState::kFree) {
    if (a->stream == kAnyStream) a->stream = b->stream;
    a->free_seq = std::max(a->free_seq, b->free_seq);
  }
  if (b->state == BlockState::kUnmapped) EraseGap(b);
  a->size += b->size;
  a->next = b->next;
  if (b->next != nullptr) b->next->prev = a;
  DeleteBlock(b);
  return a;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline Block* Arena::CoalesceFree(Block* block) {
  Block* next = block->next != nullptr && CanMerge(block, block->next) ? block->next : nullptr;
  if (block->prev != nullptr && CanMerge(block->prev, block)) {
    // The cached block below absorbs this one (and the one above), keeping its bin if it can.
    Block* prev = block->prev;
    if (next != nullptr) {
      free_.Remove(next);
      Join(block, next);
    }
    Join(prev, block);
    free_.Resized(prev);
    return prev;
  }
  if (next != nullptr) {
    // This block absorbs the cached one above and takes its place in the set.
    free_.Replace(next, block, block->size + next->size);
    return Join(block, next);
  }
  free_.Insert(block);
  return block;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline Block* Arena::AddFree(Block* block, Stream stream,
                                                           uint64_t free_seq) {
  block->state = BlockState::kFree;
  block->stream = stream;
  block->free_seq = free_seq;
  block->requested = 0;
  block->stream_uses.clear();
  return CoalesceFree(block);
}

}  // namespace vmm

#endif  // VMM_ALLOCATOR_ARENA_H_
