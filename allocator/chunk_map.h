// chunk_map.h: the physical chunks behind a pool's reserved range (internal to the pool).
//
// A chunk is one physical allocation (Driver::Create) mapped at one address. MapRange backs a
// range with chunks of at most `max_chunk` bytes and grants access once for the whole range;
// when any driver call fails it unmaps and releases every piece it made, so a failed growth
// leaves nothing behind. Release unmaps and releases chunks; Move unmaps chunks and maps their
// handles elsewhere. Chunks side by side are whole mappings side by side, which one Unmap call
// takes together (the driver allows it: driver_conformance_test), so both unmap each run of
// adjacent chunks at once, but for a seam (AddSeam: where the pool's range grew, a reservation
// of its own begins), which no run spans. Every driver call is counted in the PoolStats
// passed in.
//
// Export state lives here too: a chunk marked exported is never recycled (the pool's export
// invariant, pool.h); `dedicated` chunks hold one shareable block alone. A MappingListener
// (SetListener, mapping_listener.h) hears of every chunk mapped and unmapped.
//
// Not thread safe: the owning Pool guards it with its mutex.
#ifndef VMM_ALLOCATOR_CHUNK_MAP_H_
#define VMM_ALLOCATOR_CHUNK_MAP_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/block.h"
#include "allocator/device_cap.h"
#include "allocator/driver.h"
#include "allocator/mapping_listener.h"
#include "allocator/stats.h"

namespace vmm {

struct Chunk {
  uint64_t id = 0;  // unique in its pool for the pool's lifetime
  size_t size = 0;
  PhysHandle handle = 0;
  bool exported = false;
  bool dedicated = false;  // holds one shareable block only
  // Sends of this chunk (ExportUse::kTracked) whose receiver has not yet said it released
  // its mapping, and whether it was ever exported in a way whose importers are unknown
  // (ExportUse::kUntracked). A chunk is reused after its export only when neither holds.
  uint32_t importers = 0;
  bool untracked = false;
  bool spare = false;  // kept for the next shareable block (Pool's spare list)
  // The stream of the block whose export marked it: the free space it then retired was not
  // waited for on that stream (Pool::WaitForSpaceBeforeExport), so it returns to service
  // tagged with it (Pool::UnmarkChunk).
  Stream marked_by = kAnyStream;
  // Exported once, and the pool's export observer may still cache its handle: the observer
  // hears of its release even after the mark was taken off (a spare chunk an ordinary
  // allocation took).
  bool observed = false;
};

// Logs a failure of releasing chunks at teardown (chunk_map.cc; a function so that the
// template below needs no logging header).
void LogChunkTeardownError(const absl::Status& status);

class ChunkMap {
 public:
  using Map = absl::btree_map<uintptr_t, Chunk>;

  struct Config {
    Driver* driver = nullptr;
    int device = 0;
    uint32_t handle_bits = 0;     // HandleTypeBit of the pool's handle type
    size_t max_chunk = 0;         // largest physical allocation
    std::vector<int> access;      // devices granted access: the pool's device, then its peers
    // Where the pool's large arena begins: a chunk's bytes and count go to
    // stats.arena[kLargeArena] at or above it, to stats.arena[kSmallArena] below.
    uintptr_t large_base = 0;
  };

  void Init(Config config) { config_ = std::move(config); }
  // `addr` starts a reservation of its own (the pool lengthened its range there, driver.h
  // ReserveAt): no Unmap call spans it.
  void AddSeam(uintptr_t addr) { seams_.insert(addr); }
  // From now on the bytes this map maps and releases also count in `cap` (device_cap.h; it
  // must outlive the map's chunks). The caller adds what is mapped already.
  void ShareCap(DeviceCap* cap) { cap_ = cap; }
  // From now on `listener` (null: none; not owned, it must outlive the map's chunks) hears of
  // every chunk this map maps or unmaps, as `source`'s (mapping_listener.h).
  void SetListener(MappingListener* listener, MappingSource source) {
    listener_ = listener;
    source_ = source;
  }
  // Tells the listener that every chunk is unmapped, then forgets it.
  void DetachListener() {
    for (const auto& [addr, chunk] : chunks_) Tell(addr, chunk.size, /*mapped=*/false);
    listener_ = nullptr;
  }

  // A chunk that a failed MapRange or Move could not unmap: still mapped (access unknown),
  // in the map, where the caller's bookkeeping may have a gap or a free block.
  struct Stranded {
    uintptr_t addr = 0;
    size_t size = 0;
  };
  // Creates, maps and grants access to [addr, addr + len) in chunks, marking them exported and
  // dedicated when `dedicated`. On failure the driver's error is returned and nothing stays
  // mapped or created, but for chunks whose Unmap failed too: those stay in the map (counted
  // as below, neither exported nor dedicated) and are added to `stranded`, for the caller to
  // place. Adds the new chunks' bytes to `stats.reserved_bytes` and their count to
  // `stats.segment`, and to those of the arena they lie in.
  // `chunk_size` (0: max_chunk) is the size of every chunk but the last.
  absl::Status MapRange(uintptr_t addr, size_t len, bool dedicated, PoolStats& stats,
                        size_t chunk_size, std::vector<Stranded>* stranded);

  // A chunk Move took from `from` and mapped at `to`.
  struct Moved {
    uintptr_t from = 0;
    uintptr_t to = 0;
    size_t size = 0;
  };
  // Moves the chunks starting at `froms` (none exported) to `to`, a free stretch of the
  // reserved range, end to end in the order given: unmaps them and maps their handles there
  // (no access granted: the caller calls GrantAccess once for the range it filled). Chunks
  // that lie end to end (in either order) are unmapped by one Unmap call, as whole mappings
  // side by side may be; if that call fails, one by one. Each moved chunk gets a fresh id and
  // is appended to `*moved`; one that lands in the other arena counts in its statistics.
  // On a failure the chunks not moved yet are where they were, mapped and accessible; one
  // that cannot be mapped back is released, forgotten and appended to `*lost` (the caller's
  // bookkeeping must drop it), but for one mapped back whose access could be neither granted
  // nor its mapping undone: that one stays in the map where it was, appended to `*stranded`
  // (access unknown); the chunks in `*moved` stay moved (the caller moves them back). The
  // driver's error is returned.
  absl::Status Move(absl::Span<const uintptr_t> froms, uintptr_t to, PoolStats& stats,
                    std::vector<Moved>* moved, std::vector<Moved>* lost,
                    std::vector<Stranded>* stranded);
  // SetAccess for the pool's devices over [addr, addr + len), which must be mapped.
  absl::Status GrantAccess(uintptr_t addr, size_t len, PoolStats& stats);

  // Unmaps and releases the chunk at `addr` (which must be a chunk's start) and forgets it.
  // An Unmap failure leaves the chunk in place and is returned; a Release failure after a
  // successful Unmap is logged (the range is unmapped either way). Returns the chunk.
  absl::StatusOr<Chunk> Release(uintptr_t addr, PoolStats& stats);
  // The same for the chunks at `addrs`, in order, with one Unmap for each run of them that
  // lie end to end in ascending order (if that call fails, one by one). Appends each released
  // chunk to `*released` with its address; when a chunk's own Unmap fails, it and the chunks
  // after it stay, and the error is returned.
  absl::Status Release(absl::Span<const uintptr_t> addrs, PoolStats& stats,
                       std::vector<std::pair<uintptr_t, Chunk>>* released);

  // Unmaps and releases every chunk (teardown), logging failures; calls `released(chunk)`
  // for each.
  template <typename F>
  void ReleaseAll(F&& released);

  // Marks the chunk at `it` exported; false if it already was.
  bool MarkExported(Map::iterator it, PoolStats& stats);
  // Takes the mark off the exported chunk at `it` (nothing maps it elsewhere any more).
  void UnmarkExported(Map::iterator it, PoolStats& stats);
  // Gives the chunk at `it` a fresh id (what a chunk reused after its export is known by, so
  // that what named it before names nothing); returns it.
  uint64_t Renumber(Map::iterator it) { return it->second.id = next_id_++; }

  // The chunk whose range holds `addr`, or end().
  Map::iterator Containing(uintptr_t addr);
  Map::const_iterator Containing(uintptr_t addr) const;
  // The first chunk that ends after `addr` (the one holding it, or the next), or end().
  Map::const_iterator FirstEndingAfter(uintptr_t addr) const;
  // Whether an exported chunk overlaps [addr, end). Inline and one compare while no chunk is
  // exported (the cached Free path asks it).
  bool OverlapsExported(uintptr_t addr, uintptr_t end) const {
    return exported_ != 0 && AnyExportedIn(addr, end);
  }

  Map::iterator begin() { return chunks_.begin(); }
  Map::iterator end() { return chunks_.end(); }
  Map::const_iterator begin() const { return chunks_.begin(); }
  Map::const_iterator end() const { return chunks_.end(); }
  Map::iterator find(uintptr_t addr) { return chunks_.find(addr); }
  Map::const_iterator find(uintptr_t addr) const { return chunks_.find(addr); }
  Map::const_iterator lower_bound(uintptr_t addr) const { return chunks_.lower_bound(addr); }
  size_t size() const { return chunks_.size(); }
  // Chunks marked exported.
  int64_t exported_count() const { return exported_; }

 private:
  void Forget(Map::iterator it, PoolStats& stats);
  // Tells the listener, if any, that [addr, addr + size) was mapped or unmapped.
  void Tell(uintptr_t addr, size_t size, bool mapped) {
    if (listener_ != nullptr) listener_->RangeMapped(source_, addr, size, mapped);
  }
  // The statistics of the arena `addr` lies in (Config::large_base).
  ArenaStats& ArenaStatsOf(uintptr_t addr, PoolStats& stats) const {
    return stats.arena[ArenaKindAt(addr, config_.large_base)];
  }
  // Unmaps the chunks from addrs[i] on that lie end to end (above addrs[i], or also below it when
  // `either_order`; never across a seam) with one Unmap call; if it fails, the chunks of that run
  // one by one (`*singles_until` remembers where the run ended). Returns the index past what it
  // unmapped, or the error of a single chunk's Unmap.
  absl::StatusOr<size_t> UnmapRun(absl::Span<const uintptr_t> addrs, size_t i, bool either_order,
                                  size_t* singles_until, PoolStats& stats);
  // Unmaps `addrs` run by run (UnmapRun) and calls `unmapped(i, j)` after each run [i, j);
  // stops at the first error, of an Unmap or of `unmapped`, and returns it.
  template <typename F>
  absl::Status UnmapRuns(absl::Span<const uintptr_t> addrs, bool either_order, PoolStats& stats,
                         F&& unmapped);
  bool AnyExportedIn(uintptr_t addr, uintptr_t end) const;

  Config config_;
  DeviceCap* cap_ = nullptr;  // ShareCap's (not owned)
  MappingListener* listener_ = nullptr;  // SetListener's (not owned)
  MappingSource source_;
  Map chunks_;
  absl::btree_set<uintptr_t> seams_;  // AddSeam's
  uint64_t next_id_ = 1;
  int64_t exported_ = 0;
};

template <typename F>
void ChunkMap::ReleaseAll(F&& released) {
  for (auto& [addr, chunk] : chunks_) {
    absl::Status s = config_.driver->Unmap(addr, chunk.size);
    const bool unmapped = s.ok();
    if (unmapped) s = config_.driver->Release(chunk.handle);
    if (!s.ok()) LogChunkTeardownError(s);
    if (cap_ != nullptr) cap_->AddMapped(-static_cast<int64_t>(chunk.size));
    if (unmapped) Tell(addr, chunk.size, /*mapped=*/false);
    released(chunk);
  }
  chunks_.clear();
  exported_ = 0;
}

}  // namespace vmm

#endif  // VMM_ALLOCATOR_CHUNK_MAP_H_
