// reclaim_policy.h: which free memory a miss takes instead of growing the pool (internal to
// the pool).
//
// When no cached block fits a request, the pool plans the fewest new bytes that give it a
// contiguous fit (Arena::PlanGrowth). Before creating those bytes, it takes physical chunks that
// back free space elsewhere: each such chunk is unmapped where it is and mapped where the request
// goes (Pool::Grow, ChunkMap::Move), so the pool's physical memory does not grow while free memory
// it already holds could serve the request. Memory moves between the two arenas too: a growth of
// either may take the large arena's free chunks, and the small arena's while it holds a surplus
// (Pool::SmallArenaSurplus: cached bytes at least four small chunks and no fewer than its
// allocated bytes), so that a phase of small blocks and a phase of large ones share their memory
// (host replay of 20,000 blocks of 4-256 KiB freed, then 40 of 32-96 MiB, three times: peak
// reserved / peak allocated 1.95 before, 1.0009 after). A small arena in use keeps its cache:
// taking its free chunks whatever it held moved them back and forth (host replay over seeds 0-7:
// 4-17% more driver calls on kv_serving, churn and rl_phases, the peak ratios no better). The
// large arena's growth is made of chunks of `large_page` bytes (pool_options.h), the last one of a
// growth half a page where that is all the request needs (growth_policy.h PlanUnit), so that free
// space there becomes movable page by page; until the pool first moves memory (after it, for
// requests of 1 GiB or more by default) and until a miss first finds free memory pinned in one
// (PinnedBytes), of chunks of up to `growth_page` (several pages), which move whole.
//
// Invariants (each policy must keep them; the pool relies on them):
//   1. Only chunks wholly inside one free (kFree) block are taken: nothing allocated, pending,
//      retired or in use by a kernel is ever moved.
//   2. Never an exported chunk (nor a dedicated or spare one): an importer may map it, and
//      moving it would show the importer another tensor's bytes (export invariant, pool.h).
//      Nor one exported before (Chunk::observed, a spare chunk a plain allocation took): a
//      move gives the chunk a new id, and the export observer keeps its handle under the old.
//   3. Stream order: a chunk is taken only from a block every stream may use (kAnyStream: the
//      work that used it is known complete) or one tagged with the requesting stream; for the
//      latter the pool synchronises that stream before unmapping (`sync_requester`). Blocks
//      tagged with other streams are never taken: their work is not known complete.
//   4. Not from the free blocks the growth plan attaches to (its gap's neighbours): the plan
//      extends them, and taking memory out of them would change the plan.
//   5. Only chunks of a whole number of `page` bytes (the pool passes its granularity: the
//      large arena's pages and half pages, its growth_page chunks and the small arena's
//      chunks alike), each moved
//      whole, laid end to end from the start of the planned range; they add up to no more
//      than it needs (the rest is created fresh), so a chunk larger than what is still
//      needed stays where it is.
//   6. Nothing while the pool keeps its memory (Pool::SetKeepMemory: a captured graph may
//      write to free addresses), nor while a capture is under way anywhere in the process
//      (capture_window.h: the synchronisation a move may need would invalidate it; the pool
//      holds a window from opening until its moves are done), nor for blocks that get chunks
//      of their own (shareable). (6 is checked by the pool before it asks.)
//
// Policy today: from the usable free blocks of the arenas it may take from, smallest first
// (a small hole is the memory least likely to serve a later request as it is; a large free
// block stays whole as long as possible), ties to the lower address; within a block, chunks
// from its upper end down (what stays of the block is one contiguous piece while its chunks
// are single pages), each taken if it still fits what the plan needs. Free blocks that need
// no stream synchronisation (kAnyStream) go before the requester's own. Where chunks of
// several pages were passed over and the choice leaves bytes to create, the same chunks
// taken largest first are tried too, and kept if they leave fewer.
//
// Where the growth goes is chosen with what can move in mind (FindMovable): the pool plans
// the range that leaves the fewest bytes to create once the movable chunks outside its
// neighbours that fit it are taken, plus a share of its length for the pages it moves
// (GrowthCost); ties go to the fewest new bytes. Joining a free neighbour saves mapping its
// bytes but forbids moving its pages, and a range that joins none may then create less.
// A new policy is a new implementation of ChooseReclaim (and FindMovable) in this file.
#ifndef VMM_ALLOCATOR_RECLAIM_POLICY_H_
#define VMM_ALLOCATOR_RECLAIM_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "allocator/arena.h"
#include "allocator/block.h"
#include "allocator/chunk_map.h"

namespace vmm {

struct ReclaimRequest {
  const Arena* arena = nullptr;        // the large arena
  const Arena* small_arena = nullptr;  // the small arena, where it may give chunks; else null
  const ChunkMap* chunks = nullptr;
  // The free blocks the growth plan attaches to (invariant 4); may be null.
  const Block* exclude_lo = nullptr;
  const Block* exclude_hi = nullptr;
  Stream requester = kAnyStream;
  size_t page = 0;    // chunks of whole multiples of it may be taken (invariant 5), from
                      // free blocks at least that large
  size_t needed = 0;  // bytes the plan must map
  // Where set, FindMovable also sums MovableMemory::pinned: the bytes of its large-arena
  // blocks in chunks larger than this (the large arena's page) that reach past them
  // (PinnedBytes).
  size_t count_pinned_above = 0;
};

struct ReclaimChoice {
  // Chunk addresses to move, in order; their sizes add up to at most `needed`.
  std::vector<uintptr_t> chunks;
  size_t bytes = 0;  // their total size
  // Whether a chosen chunk lies in a block tagged with the requesting stream (invariant 3).
  bool sync_requester = false;
};

// Movable chunks by size, largest first: {size, count} (a few sizes: mostly a page, half a
// page, a power of two of pages, a small-arena chunk).
using ChunkCounts = absl::InlinedVector<std::pair<size_t, size_t>, 2>;

// What ChooseReclaim could take for `request`'s requester from each free block of its arenas,
// ignoring `exclude_*` and `needed`: the pool compares growth plans by it (a plan's
// neighbours are excluded, invariant 4, so where a plan goes changes what it can move).
struct MovableMemory {
  ChunkCounts total;
  absl::flat_hash_map<const Block*, ChunkCounts> by_block;
  // The movable chunks themselves, {address, size}, of each block that has any, from the
  // block's upper end down: what ChooseReclaim picks from, so that a miss looks the chunks
  // up once.
  struct BlockChunks {
    const Block* block;
    std::vector<std::pair<uintptr_t, size_t>> chunks;
  };
  std::vector<BlockChunks> blocks;
  // With ReclaimRequest::count_pinned_above: what PinnedBytes gives for the blocks looked at.
  size_t pinned = 0;
  // Adds `count` chunks of `size` bytes in `block` to the counts.
  void Add(const Block* block, size_t size, size_t count);
  // The most bytes, up to `needed`, that the chunks outside `except_a` and `except_b` (may
  // be null) give, taken largest first (invariant 5: a chunk moves whole).
  size_t Fit(size_t needed, const Block* except_a, const Block* except_b) const;
};
MovableMemory FindMovable(const ReclaimRequest& request);

// The chunks to move for `request` (the policy above), from `movable`, which FindMovable
// gave for the same requester, page and arena, unchanged since.
ReclaimChoice ChooseReclaim(const ReclaimRequest& request, const MovableMemory& movable);

// The bytes of `block` in chunks of several pages (larger than `page`, made by a growth: not
// one of an exported block) that reach past it, into memory outside the block (a live block,
// a free one of another tag, a block waiting for a stream): nonzero when the block shares
// such a chunk. For a free block, memory no miss can take while the chunk is shared, since a
// chunk moves whole (invariant 5); for a block just taken from a growth, a chunk it does not
// fill, whose rest is pinned from the start. Only the chunks at a block's two ends can reach
// past it. The pool stops making such chunks once it sees any (pool.h pinned_in_chunks_).
size_t PinnedBytes(const ChunkMap& chunks, const Block* block, size_t page);

// What growing at `plan` costs, in bytes, for the pool to compare plans by (Arena::PlanGrowth
// takes the least): the bytes left to create once the movable chunks outside the plan's
// neighbours that fit it are taken, plus a share of its length for the pages moved: a
// sixty-fourth, or a half once the pool `settle`s: when a miss below the allocated high
// comes after misses have moved kSettleMoves times what the pool holds since that high was
// reached (a working set that keeps missing below its high would otherwise move pages at
// every pass; creating a little instead lets it settle). A plan that creates more than
// `room`, what the pool may still create under its memory limit or its GPU's memory
// fraction (SIZE_MAX: no limit), would fail: it costs kPastRoom more, after every plan
// within the room (a settling pool near its limit moves rather than fail and release its
// cache).
inline constexpr size_t kSettleMoves = 4;
inline constexpr size_t kPastRoom = SIZE_MAX / 2;
size_t GrowthCost(const MovableMemory& movable, const Arena::GrowthPlan& plan, bool settle,
                  size_t room);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_RECLAIM_POLICY_H_
