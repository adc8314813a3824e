#include "allocator/reclaim_policy.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "allocator/free_blocks.h"

namespace vmm {

namespace {

// Invariants 1 and 3: a block the requester may take from (4, the plan's neighbours, is
// ChooseReclaim's: FindMovable looks before there is a plan).
bool IsSource(const ReclaimRequest& r, const Block* b) {
  if (b->state != BlockState::kFree || b->size < r.page) return false;  // 1
  return b->stream == kAnyStream || b->stream == r.requester;           // 3
}

// Calls `f(block)` for each block the requester may take from (IsSource): the free blocks of
// a page or more tagged kAnyStream or with the requester's stream, in the large arena and
// (where the request names it) the small one, found through the arenas' free bins rather than
// by walking all their blocks (a miss in an arena of many live blocks would otherwise cost a
// walk of them all), in no particular order: callers sort or sum.
template <typename F>
void ForEachSource(const ReclaimRequest& r, F&& f) {
  auto visit = [&](Block* b) {
    if (IsSource(r, b)) f(b);
  };
  for (const Arena* arena : {r.arena, r.small_arena}) {
    if (arena == nullptr) continue;
    const FreeBlocks& free = arena->free_blocks();
    free.ForEachAtLeast(kAnyStream, r.page, visit);
    if (r.requester != kAnyStream) free.ForEachAtLeast(r.requester, r.page, visit);
  }
}

// Calls `take(addr, chunk)` for the chunks of `b` that may move (invariants 2 and 5), from
// the block's upper end down, until it returns false.
template <typename F>
void ForEachMovableChunk(const ReclaimRequest& r, const Block* b, F&& take) {
  auto c = r.chunks->FirstEndingAfter(b->end() - 1);
  if (c == r.chunks->end() || c->first >= b->end()) return;
  while (true) {
    const Chunk& chunk = c->second;
    if (c->first < b->addr) return;
    const bool inside = c->first + chunk.size <= b->end();
    if (inside && !chunk.exported && !chunk.dedicated && !chunk.spare && !chunk.observed &&
        chunk.size % r.page == 0) {
      if (!take(c->first, chunk)) return;
    }
    if (c == r.chunks->begin()) return;
    --c;
  }
}

}  // namespace

ReclaimChoice ChooseReclaim(const ReclaimRequest& r, const MovableMemory& movable) {
  ReclaimChoice choice;
  if (r.page == 0 || r.needed < r.page) return choice;
  struct Source {
    const MovableMemory::BlockChunks* block;
    bool needs_sync;
  };
  std::vector<Source> sources;
  for (const MovableMemory::BlockChunks& b : movable.blocks) {
    if (b.block == r.exclude_lo || b.block == r.exclude_hi) continue;  // invariant 4
    sources.push_back(Source{&b, b.block->stream != kAnyStream});
  }
  std::sort(sources.begin(), sources.end(), [](const Source& a, const Source& b) {
    return std::make_tuple(a.needs_sync, a.block->block->size, a.block->block->addr) <
           std::make_tuple(b.needs_sync, b.block->block->size, b.block->block->addr);
  });
  bool passed_over = false;  // a chunk that did not fit what was still needed
  for (const Source& s : sources) {
    for (const auto& [addr, size] : s.block->chunks) {
      if (choice.bytes + size > r.needed) {
        passed_over = true;
        continue;
      }
      choice.chunks.push_back(addr);
      choice.bytes += size;
      choice.sync_requester |= s.needs_sync;
    }
    if (choice.bytes == r.needed) return choice;
  }
  if (!passed_over) return choice;
  // Chunks of several pages were passed over and bytes remain to create: the same chunks
  // taken largest first (stable: in the first pass's order among equals) may leave fewer.
  struct Candidate {
    uintptr_t addr;
    size_t size;
    bool needs_sync;
  };
  std::vector<Candidate> candidates;
  for (const Source& s : sources) {
    for (const auto& [addr, size] : s.block->chunks) {
      candidates.push_back(Candidate{addr, size, s.needs_sync});
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.size > b.size; });
  ReclaimChoice largest;
  for (const Candidate& c : candidates) {
    if (largest.bytes + c.size > r.needed) continue;
    largest.chunks.push_back(c.addr);
    largest.bytes += c.size;
    largest.sync_requester |= c.needs_sync;
    if (largest.bytes == r.needed) break;
  }
  return largest.bytes > choice.bytes ? largest : choice;
}

namespace {

// Adds `count` chunks of `size` to `counts`, keeping it largest first.
void AddTo(ChunkCounts& counts, size_t size, size_t count) {
  auto it = std::find_if(counts.begin(), counts.end(),
                         [&](const std::pair<size_t, size_t>& c) { return c.first <= size; });
  if (it != counts.end() && it->first == size) {
    it->second += count;
  } else {
    counts.insert(it, {size, count});
  }
}

}  // namespace

void MovableMemory::Add(const Block* block, size_t size, size_t count) {
  AddTo(total, size, count);
  AddTo(by_block[block], size, count);
}

size_t MovableMemory::Fit(size_t needed, const Block* except_a, const Block* except_b) const {
  // The excepted blocks' chunks are not taken (looked up once; one block excepted twice counts
  // once).
  const ChunkCounts* excepted[2] = {nullptr, nullptr};
  int n_excepted = 0;
  for (const Block* except : {except_a, except_b == except_a ? nullptr : except_b}) {
    if (except == nullptr) continue;
    if (auto it = by_block.find(except); it != by_block.end()) excepted[n_excepted++] = &it->second;
  }
  size_t taken = 0;
  for (const auto& [size, count] : total) {  // largest first
    size_t kept = 0;
    for (int i = 0; i < n_excepted; ++i) {
      for (const auto& [s, c] : *excepted[i]) {
        if (s == size) kept += c;
      }
    }
    const size_t usable = count - std::min(count, kept);
    taken += std::min(usable, (needed - taken) / size) * size;
  }
  return taken;
}

MovableMemory FindMovable(const ReclaimRequest& r) {
  MovableMemory movable;
  if (r.page == 0) return movable;
  ForEachSource(r, [&](const Block* b) {
    // The large arena's blocks only: the small arena's chunks are shared by many blocks by
    // design, whatever their size.
    if (r.count_pinned_above != 0 && r.arena->Contains(b->addr)) {
      movable.pinned += PinnedBytes(*r.chunks, b, r.count_pinned_above);
    }
    MovableMemory::BlockChunks found{b, {}};
    ChunkCounts counts;  // this block's, counted first: a few sizes, one Add each
    ForEachMovableChunk(r, b, [&](uintptr_t addr, const Chunk& chunk) {
      found.chunks.emplace_back(addr, chunk.size);
      AddTo(counts, chunk.size, 1);
      return true;
    });
    if (found.chunks.empty()) return;
    for (const auto& [size, count] : counts) movable.Add(b, size, count);
    movable.blocks.push_back(std::move(found));
  });
  return movable;
}

size_t GrowthCost(const MovableMemory& movable, const Arena::GrowthPlan& plan, bool settle,
                  size_t room) {
  // The neighbours the plan joins keep their pages (invariant 4).
  const size_t created = plan.len - movable.Fit(plan.len, plan.gap->prev, plan.gap->next);
  // Pages moved cost driver calls, and a range away from the free neighbours leaves gaps
  // among live blocks: a plan may move up to 64 bytes elsewhere to create one fewer. The
  // same below the allocated high as at a new one: a cached pool keeps what it creates, so
  // a byte created below the high raises peak reserved as much (a half there let long runs
  // creep, docs/DESIGN.md §2b). Until the pool has moved kSettleMoves times what it holds
  // since that high: then two, so that a working set that keeps missing below its high
  // creates what it lacks once and stops moving pages.
  // A settling pool creates only within its room; a plan past it would fail: after every plan
  // within it.
  if (created > room) return kPastRoom + created;
  return created + (settle ? plan.len / 2 : plan.len / 64);
}

size_t PinnedBytes(const ChunkMap& chunks, const Block* block, size_t page) {
  auto of_several_pages = [&](const Chunk& c) {
    return c.size > page && !c.exported && !c.dedicated && !c.spare && !c.observed;
  };
  auto first = chunks.FirstEndingAfter(block->addr);
  if (first == chunks.end() || first->first >= block->end()) return 0;
  size_t pinned = 0;
  const uintptr_t first_end = first->first + first->second.size;
  if (of_several_pages(first->second) &&
      (first->first < block->addr || first_end > block->end())) {
    pinned += std::min(first_end, block->end()) - block->addr;
    if (first_end >= block->end()) return pinned;  // one chunk holds the whole block
  }
  auto last = chunks.FirstEndingAfter(block->end() - 1);
  if (last != chunks.end() && last != first && of_several_pages(last->second) &&
      last->first + last->second.size > block->end()) {
    pinned += block->end() - last->first;
  }
  return pinned;
}

}  // namespace vmm
