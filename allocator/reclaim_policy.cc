#include "allocator/reclaim_policy.h"

#include <algorithm>
#include <tuple>

namespace vmm {

ReclaimChoice ChooseReclaim(const ReclaimRequest& r) {
  ReclaimChoice choice;
  if (r.page == 0 || r.needed < r.page) return choice;
  struct Source {
    const Block* block;
    bool needs_sync;
  };
  std::vector<Source> sources;
  for (const Block* b = r.arena->head(); b != nullptr; b = b->next) {
    if (b->state != BlockState::kFree || b->size < r.page) continue;    // invariant 1
    if (b == r.exclude_lo || b == r.exclude_hi) continue;               // invariant 4
    if (b->stream != kAnyStream && b->stream != r.requester) continue;  // invariant 3
    sources.push_back(Source{b, b->stream != kAnyStream});
  }
  std::sort(sources.begin(), sources.end(), [](const Source& a, const Source& b) {
    return std::make_tuple(a.needs_sync, a.block->size, a.block->addr) <
           std::make_tuple(b.needs_sync, b.block->size, b.block->addr);
  });
  for (const Source& s : sources) {
    const Block* b = s.block;
    // The chunks wholly inside the block, from its upper end down.
    auto c = r.chunks->FirstEndingAfter(b->end() - 1);
    if (c == r.chunks->end() || c->first >= b->end()) continue;
    while (true) {
      const Chunk& chunk = c->second;
      if (c->first < b->addr) break;
      const bool inside = c->first + chunk.size <= b->end();
      if (inside && !chunk.exported && !chunk.dedicated && !chunk.spare &&  // invariant 2
          !chunk.observed &&
          chunk.size == r.page && choice.bytes + chunk.size <= r.needed) {  // invariant 5
        choice.chunks.push_back(c->first);
        choice.bytes += chunk.size;
        choice.sync_requester |= s.needs_sync;
        if (choice.bytes == r.needed) return choice;
      }
      if (c == r.chunks->begin()) break;
      --c;
    }
  }
  return choice;
}

}  // namespace vmm
