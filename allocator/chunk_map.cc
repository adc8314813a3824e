#include "allocator/chunk_map.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {

void LogChunkTeardownError(const absl::Status& status) {
  LogError(absl::StrCat("pool teardown: ", status.message()));
}

absl::Status ChunkMap::MapRange(uintptr_t addr, size_t len, bool dedicated, PoolStats& stats,
                               size_t chunk_size) {
  Driver& driver = *config_.driver;
  const size_t piece_size = chunk_size != 0 ? chunk_size : config_.max_chunk;
  struct Piece {
    uintptr_t addr;
    size_t size;
    PhysHandle handle;
    bool mapped;
  };
  std::vector<Piece> pieces;
  auto rollback = [&](absl::Status cause) {
    for (const Piece& p : pieces) {
      if (p.mapped) {
        ++stats.driver_unmap;
        (void)driver.Unmap(p.addr, p.size);
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
  stats.reserved_bytes.Increase(static_cast<int64_t>(len));
  if (cap_ != nullptr) cap_->Add(static_cast<int64_t>(len));
  stats.segment.Increase(static_cast<int64_t>(pieces.size()));
  return absl::OkStatus();
}

absl::Status ChunkMap::Move(uintptr_t from, uintptr_t to, PoolStats& stats, bool* lost) {
  *lost = false;
  auto it = chunks_.find(from);
  if (it == chunks_.end()) {
    return absl::InternalError(absl::StrCat("no chunk starts at ", absl::Hex(from)));
  }
  Driver& driver = *config_.driver;
  Chunk chunk = it->second;
  ++stats.driver_unmap;
  VMM_RETURN_IF_ERROR(driver.Unmap(from, chunk.size));
  ++stats.driver_map;
  absl::Status mapped = driver.Map(to, chunk.size, chunk.handle);
  if (!mapped.ok()) {
    // Back where it was, with its access, so that the caller's bookkeeping still holds.
    ++stats.driver_map;
    absl::Status back = driver.Map(from, chunk.size, chunk.handle);
    if (back.ok()) {
      ++stats.driver_set_access;
      back = driver.SetAccess(from, chunk.size, config_.access);
      if (!back.ok()) {
        ++stats.driver_unmap;
        (void)driver.Unmap(from, chunk.size);
      }
    }
    if (!back.ok()) {
      LogError(absl::StrCat("moving a free chunk back: ", back.message()));
      ++stats.driver_release;
      (void)driver.Release(chunk.handle);
      Forget(it, stats);
      *lost = true;
    }
    return mapped;
  }
  chunks_.erase(it);
  chunk.id = next_id_++;
  chunks_[to] = chunk;
  return absl::OkStatus();
}

absl::Status ChunkMap::GrantAccess(uintptr_t addr, size_t len, PoolStats& stats) {
  ++stats.driver_set_access;
  return config_.driver->SetAccess(addr, len, config_.access);
}

absl::StatusOr<Chunk> ChunkMap::Release(uintptr_t addr, PoolStats& stats) {
  auto it = chunks_.find(addr);
  if (it == chunks_.end()) {
    return absl::InternalError(absl::StrCat("no chunk starts at ", absl::Hex(addr)));
  }
  const Chunk chunk = it->second;
  ++stats.driver_unmap;
  VMM_RETURN_IF_ERROR(config_.driver->Unmap(addr, chunk.size));
  ++stats.driver_release;
  absl::Status released = config_.driver->Release(chunk.handle);
  if (!released.ok()) LogError(absl::StrCat("releasing a chunk: ", released.message()));
  Forget(it, stats);
  return chunk;
}

void ChunkMap::Forget(Map::iterator it, PoolStats& stats) {
  const auto size = static_cast<int64_t>(it->second.size);
  stats.reserved_bytes.Decrease(size);
  if (cap_ != nullptr) cap_->Add(-size);
  stats.segment.Decrease(1);
  if (it->second.exported) {
    --exported_;
    stats.exported_bytes.Decrease(size);
    stats.exported_chunks.Decrease(1);
  }
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
