#include "allocator/chunk_map.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {

void LogChunkTeardownError(const absl::Status& status) {
  LogError(absl::StrCat("pool teardown: ", status.message()));
}

absl::Status ChunkMap::MapRange(uintptr_t addr, size_t len, bool dedicated, PoolStats& stats,
                               size_t chunk_size, std::vector<Stranded>* stranded) {
  Driver& driver = *config_.driver;
  const size_t piece_size = chunk_size != 0 ? chunk_size : config_.max_chunk;
  struct Piece {
    uintptr_t addr;
    size_t size;
    PhysHandle handle;
    bool mapped;
  };
  std::vector<Piece> pieces;
  // Counts a chunk's bytes as mapped: the pool's, its arena's and the device cap's.
  auto count = [&](uintptr_t at, size_t bytes, int64_t chunks) {
    stats.reserved_bytes.Increase(static_cast<int64_t>(bytes));
    if (cap_ != nullptr) cap_->AddMapped(static_cast<int64_t>(bytes));
    stats.segment.Increase(chunks);
    ArenaStats& split = ArenaStatsOf(at, stats);
    split.reserved_bytes.Increase(static_cast<int64_t>(bytes));
    split.segment.Increase(chunks);
  };
  auto rollback = [&](absl::Status cause) {
    for (const Piece& p : pieces) {
      if (p.mapped) {
        ++stats.driver_unmap;
        if (absl::Status unmapped = driver.Unmap(p.addr, p.size); !unmapped.ok()) {
          // Still mapped, so still memory: a chunk of the map, for the caller to place,
          // rather than a mapping the pool no longer knows in what it takes for a gap.
          LogError(absl::StrCat("undoing a growth: ", unmapped.message()));
          Chunk& chunk = chunks_[p.addr];
          chunk.id = next_id_++;
          chunk.size = p.size;
          chunk.handle = p.handle;
          count(p.addr, p.size, 1);
          Tell(p.addr, p.size, /*mapped=*/true);
          stranded->push_back(Stranded{p.addr, p.size});
          continue;
        }
      }
      ++stats.driver_release;
      (void)driver.Release(p.handle);
    }
    return cause;
  };
  for (uintptr_t a = addr; a < addr + len;) {
    const size_t size = std::min(piece_size, addr + len - a);
    ++stats.driver_create;
    absl::StatusOr<PhysHandle> handle = driver.Create(config_.device, size, config_.handle_bits);
    if (!handle.ok()) return rollback(handle.status());
    pieces.push_back(Piece{a, size, *handle, false});
    ++stats.driver_map;
    absl::Status mapped = driver.Map(a, size, *handle);
    if (!mapped.ok()) return rollback(mapped);
    pieces.back().mapped = true;
    a += size;
  }
  ++stats.driver_set_access;
  absl::Status access = driver.SetAccess(addr, len, config_.access);
  if (!access.ok()) return rollback(access);
  for (const Piece& p : pieces) {
    Chunk& chunk = chunks_[p.addr];
    chunk.id = next_id_++;
    chunk.size = p.size;
    chunk.handle = p.handle;
    chunk.dedicated = dedicated;
    if (dedicated) MarkExported(chunks_.find(p.addr), stats);
  }
  count(addr, len, static_cast<int64_t>(pieces.size()));
  // Chunk by chunk, as they are unmapped: a range told mapped is never part of one told
  // unmapped (mapping_listener.h).
  for (const Piece& p : pieces) Tell(p.addr, p.size, /*mapped=*/true);
  return absl::OkStatus();
}

absl::StatusOr<size_t> ChunkMap::UnmapRun(absl::Span<const uintptr_t> addrs, size_t i,
                                          bool either_order, size_t* singles_until,
                                          PoolStats& stats) {
  while (true) {
    // The run: chunks [i, j) that lie end to end, spanning [lo, hi).
    auto first = chunks_.find(addrs[i]);
    if (first == chunks_.end()) {
      return absl::InternalError(absl::StrCat("no chunk starts at ", absl::Hex(addrs[i])));
    }
    uintptr_t lo = addrs[i];
    uintptr_t hi = lo + first->second.size;
    size_t j = i + 1;
    for (; j < addrs.size() && j >= *singles_until; ++j) {
      auto c = chunks_.find(addrs[j]);
      if (c == chunks_.end()) break;
      if (c->first == hi && !seams_.contains(hi)) {
        hi += c->second.size;
      } else if (either_order && c->first + c->second.size == lo && !seams_.contains(lo)) {
        lo = c->first;
      } else {
        break;
      }
    }
    ++stats.driver_unmap;
    absl::Status unmapped = config_.driver->Unmap(lo, hi - lo);
    if (unmapped.ok()) return j;
    if (j - i == 1) return unmapped;
    *singles_until = j;  // the run's chunks one by one: one that fails holds back no other
  }
}

template <typename F>
absl::Status ChunkMap::UnmapRuns(absl::Span<const uintptr_t> addrs, bool either_order,
                                 PoolStats& stats, F&& unmapped) {
  size_t singles_until = 0;
  for (size_t i = 0, j = 0; i < addrs.size(); i = j) {
    VMM_ASSIGN_OR_RETURN(j, UnmapRun(addrs, i, either_order, &singles_until, stats));
    VMM_RETURN_IF_ERROR(unmapped(i, j));
  }
  return absl::OkStatus();
}

absl::Status ChunkMap::Move(absl::Span<const uintptr_t> froms, uintptr_t to, PoolStats& stats,
                            std::vector<Moved>* moved, std::vector<Moved>* lost,
                            std::vector<Stranded>* stranded) {
  Driver& driver = *config_.driver;
  return UnmapRuns(froms, /*either_order=*/true, stats, [&](size_t i, size_t j) {
    for (size_t k = i; k < j; ++k) {
      auto it = chunks_.find(froms[k]);
      Chunk chunk = it->second;
      ++stats.driver_map;
      absl::Status mapped = driver.Map(to, chunk.size, chunk.handle);
      if (!mapped.ok()) {
        // The rest of the run back where it was, with its access, so that the caller's
        // bookkeeping still holds.
        for (size_t r = k; r < j; ++r) {
          auto back_it = chunks_.find(froms[r]);
          const Chunk& c = back_it->second;
          ++stats.driver_map;
          absl::Status back = driver.Map(froms[r], c.size, c.handle);
          if (back.ok()) {
            ++stats.driver_set_access;
            back = driver.SetAccess(froms[r], c.size, config_.access);
            if (!back.ok()) {
              ++stats.driver_unmap;
              if (absl::Status unmapped = driver.Unmap(froms[r], c.size); !unmapped.ok()) {
                // Still mapped where it was: kept, for the caller to place.
                LogError(absl::StrCat("moving a free chunk back: ", back.message(), "; ",
                                      unmapped.message()));
                stranded->push_back(Stranded{froms[r], c.size});
                continue;
              }
            }
          }
          if (back.ok()) continue;
          LogError(absl::StrCat("moving a free chunk back: ", back.message()));
          ++stats.driver_release;
          (void)driver.Release(c.handle);
          lost->push_back(Moved{froms[r], froms[r], c.size});
          Forget(back_it, stats);
        }
        return mapped;
      }
      chunks_.erase(it);
      chunk.id = next_id_++;
      // A chunk that changes arena (reclaim_policy.h: memory moves between the two) is freed
      // in one arena's statistics and allocated in the other's, and the pool's count it too
      // (freed, then allocated: current and peak stay), so that the arenas' figures still add
      // up to the pool's (stats.h); within one arena they stay (Pool::CheckInvariants
      // recounts them by address).
      if (ArenaStats& from = ArenaStatsOf(froms[k], stats), &into = ArenaStatsOf(to, stats);
          &from != &into) {
        const auto bytes = static_cast<int64_t>(chunk.size);
        for (auto [reserved, segment] : {std::pair{&from.reserved_bytes, &from.segment},
                                         std::pair{&stats.reserved_bytes, &stats.segment}}) {
          reserved->Decrease(bytes);
          segment->Decrease(1);
        }
        for (auto [reserved, segment] : {std::pair{&stats.reserved_bytes, &stats.segment},
                                         std::pair{&into.reserved_bytes, &into.segment}}) {
          reserved->Increase(bytes);
          segment->Increase(1);
        }
      }
      chunks_[to] = chunk;
      Tell(froms[k], chunk.size, /*mapped=*/false);
      Tell(to, chunk.size, /*mapped=*/true);
      moved->push_back(Moved{froms[k], to, chunk.size});
      to += chunk.size;
    }
    return absl::OkStatus();
  });
}

absl::Status ChunkMap::GrantAccess(uintptr_t addr, size_t len, PoolStats& stats) {
  ++stats.driver_set_access;
  return config_.driver->SetAccess(addr, len, config_.access);
}

absl::StatusOr<Chunk> ChunkMap::Release(uintptr_t addr, PoolStats& stats) {
  std::vector<std::pair<uintptr_t, Chunk>> released;
  const uintptr_t addrs[] = {addr};
  VMM_RETURN_IF_ERROR(Release(addrs, stats, &released));
  return released.front().second;
}

absl::Status ChunkMap::Release(absl::Span<const uintptr_t> addrs, PoolStats& stats,
                               std::vector<std::pair<uintptr_t, Chunk>>* released) {
  Driver& driver = *config_.driver;
  return UnmapRuns(addrs, /*either_order=*/false, stats, [&](size_t i, size_t j) {
    for (size_t k = i; k < j; ++k) {
      auto it = chunks_.find(addrs[k]);
      released->emplace_back(addrs[k], it->second);
      ++stats.driver_release;
      absl::Status freed = driver.Release(it->second.handle);
      if (!freed.ok()) LogError(absl::StrCat("releasing a chunk: ", freed.message()));
      Forget(it, stats);
    }
    return absl::OkStatus();
  });
}

void ChunkMap::Forget(Map::iterator it, PoolStats& stats) {
  const auto size = static_cast<int64_t>(it->second.size);
  stats.reserved_bytes.Decrease(size);
  if (cap_ != nullptr) cap_->AddMapped(-size);
  stats.segment.Decrease(1);
  ArenaStats& split = ArenaStatsOf(it->first, stats);
  split.reserved_bytes.Decrease(size);
  split.segment.Decrease(1);
  if (it->second.exported) {
    --exported_;
    stats.exported_bytes.Decrease(size);
    stats.exported_chunks.Decrease(1);
  }
  Tell(it->first, it->second.size, /*mapped=*/false);
  chunks_.erase(it);
}

bool ChunkMap::MarkExported(Map::iterator it, PoolStats& stats) {
  if (it->second.exported) return false;
  it->second.exported = true;
  it->second.observed = true;
  ++exported_;
  stats.exported_bytes.Increase(static_cast<int64_t>(it->second.size));
  stats.exported_chunks.Increase(1);
  return true;
}

void ChunkMap::UnmarkExported(Map::iterator it, PoolStats& stats) {
  if (!it->second.exported) return;
  it->second.exported = false;
  --exported_;
  stats.exported_bytes.Decrease(static_cast<int64_t>(it->second.size));
  stats.exported_chunks.Decrease(1);
}

ChunkMap::Map::iterator ChunkMap::Containing(uintptr_t addr) {
  auto c = chunks_.upper_bound(addr);
  if (c == chunks_.begin()) return chunks_.end();
  --c;
  return c->first + c->second.size > addr ? c : chunks_.end();
}

ChunkMap::Map::const_iterator ChunkMap::Containing(uintptr_t addr) const {
  return const_cast<ChunkMap*>(this)->Containing(addr);
}

ChunkMap::Map::const_iterator ChunkMap::FirstEndingAfter(uintptr_t addr) const {
  auto c = chunks_.upper_bound(addr);
  if (c != chunks_.begin() && std::prev(c)->first + std::prev(c)->second.size > addr) --c;
  return c;
}

bool ChunkMap::AnyExportedIn(uintptr_t addr, uintptr_t end) const {
  for (auto c = FirstEndingAfter(addr); c != chunks_.end() && c->first < end; ++c) {
    if (c->second.exported) return true;
  }
  return false;
}

}  // namespace vmm
