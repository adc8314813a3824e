// pool.h: the caching device memory pool, one per device.
//
// The pool reserves one virtual address range and grows into it on demand with physical
// chunks (Driver::Create + Map, then one SetAccess per contiguous range grown, for the pool's
// device and its `peer_devices`). Freed blocks
// are cached and reused best-fit; a block is split when larger than asked and coalesces with
// free neighbours, also across chunk boundaries since the range is contiguous. Requests up to
// `small_size` are served from a separate small arena so that long-lived small blocks do not
// pin large regions.
//
// Growth policy. A request that no cached block fits grows the pool by the fewest new bytes
// that give a contiguous fit: a free block at the edge of a gap is extended rather than a
// fresh chunk mapped beside it. The amount is then raised to `growth_quantum(reserved)`
// (`growth_fraction` of what is already reserved, capped at `max_growth_extra`), so a pool
// that keeps growing makes few driver calls while the overshoot stays a small fraction of its
// size; small-arena growth maps `small_chunk` at a time. A growth is backed by physical chunks
// of at most `max_chunk` bytes.
//
// Streams. A block freed on stream S is reusable at once on S. Other streams get it only
// after the work queued on S before the free has completed: when a request misses, the pool
// records an event on each other stream with cached blocks and, once it has completed, retags
// those blocks for every stream (the requesting stream's own blocks keep their tag: it may
// use them already, and they keep coalescing with its later frees). RecordStream(ptr, T) makes Free wait (with events) for T's work too.
// Physical memory is unmapped only after the work that used it has completed.
//
// Returning memory. EmptyCache() synchronises the device and releases every chunk that is
// entirely free. A failing growth first releases free chunks and retries once; a real
// out-of-memory is ResourceExhausted naming the request and summarising the pool. With a
// release threshold, Free releases completed free chunks while more than that is cached.
//
// Export invariant. Exporting a block marks every chunk it spans as exported: the free space
// in those chunks is retired at once, blocks freed there later are retired too, and a chunk is
// released to the driver as soon as nothing in it is allocated, so an importer can never see
// another allocation's data. AllocateShareable() gives a block chunks of its own.
//
// Thread safety: all methods are thread safe (one mutex). The cached path (a fit in the cache)
// makes no driver call and no system call.
#ifndef VMM_ALLOCATOR_POOL_H_
#define VMM_ALLOCATOR_POOL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/arena.h"
#include "allocator/driver.h"
#include "allocator/mutex.h"
#include "allocator/stats.h"

namespace vmm {

// Which handle type the pool's memory is created exportable as.
enum class HandleRequest {
  kAuto,     // fabric if the device allows it (probed), else POSIX fd, else none
  kNone,     // not exportable
  kPosixFd,  // POSIX file descriptors
  kFabric,   // fabric handles; fails when unavailable
};

// "auto", or a handle type name (ParseHandleType); nullopt for any other text.
std::optional<HandleRequest> ParseHandleRequest(absl::string_view name);

struct PoolOptions {
  int device = 0;
  HandleRequest handle_type = HandleRequest::kAuto;
  // Virtual address space to reserve; 0 means twice the device's memory.
  size_t reserve_size = 0;
  // Most physical bytes the pool may hold; 0 means no limit beyond the device's.
  size_t memory_limit = 0;
  // Free bytes the pool keeps cached when it could release memory on Free; SIZE_MAX keeps all.
  size_t release_threshold = SIZE_MAX;
  // Requests up to this many bytes are served by the small arena.
  size_t small_size = size_t{1} << 20;
  // The small arena grows by this much at a time (rounded to granularity).
  size_t small_chunk = size_t{2} << 20;
  // Growth in the large arena is at least this fraction of the bytes already reserved...
  // (On the training trace of SPEC §5, 0.05 and 64 MiB give peak reserved / peak allocated
  // 1.0034 with 98 growths; exact growth (0) gives 1.0000 with 112. See bench/README.md.)
  double growth_fraction = 0.05;
  // ...but never more than this many bytes beyond what the request needs.
  size_t max_growth_extra = size_t{64} << 20;
  // Largest single physical allocation. A growth is one chunk up to this size: fewer chunks
  // make fewer driver calls, and an importer maps and grants access to one allocation much
  // faster than to several (on an H200, SetAccess over 8 GiB took 0.32 ms as one allocation,
  // 0.70 ms as eight of 1 GiB). The cost is that a chunk is released only when all of it is free.
  size_t max_chunk = size_t{64} << 30;
  // Other devices granted read-write access to every range the pool maps: each growth's
  // SetAccess lists the pool's device and these, so every chunk, also those mapped long after
  // the pool was made (and again after EmptyCache), can be used by kernels and copies on them
  // directly. Each must be another device of the driver (Create: InvalidArgument). On CUDA the
  // devices must be able to reach each other (peer capable); where they cannot, the growth's
  // SetAccess fails and so does the allocation that needed it. Driver::HasAccess tells what
  // a chunk (GetSnapshot() lists them) was granted.
  std::vector<int> peer_devices;
};

// One physical chunk of an exported block.
struct ExportedChunk {
  uint64_t id = 0;  // unique in this pool for its lifetime
  uintptr_t addr = 0;
  size_t size = 0;
  FabricHandle fabric{};  // kFabric: the handle bytes
  int fd = -1;  // kPosixFd: held by the pool, valid until the chunk is released (listeners)
};

// What Export() returns: the chunks a block spans, in address order, and where it starts.
struct ExportedBlock {
  std::vector<ExportedChunk> chunks;
  size_t offset = 0;  // of the block inside the first chunk
  size_t size = 0;    // bytes the caller asked for
  HandleType handle_type = HandleType::kNone;
};

class Pool {
 public:
  // Reserves the address range and probes the handle type. InvalidArgument for bad options or
  // device; FailedPrecondition when kFabric is requested and unavailable.
  static absl::StatusOr<std::unique_ptr<Pool>> Create(Driver* driver, const PoolOptions& options);

  // Waits for the device, then unmaps and releases all memory. Blocks still allocated are
  // released too (their pointers become invalid).
  ~Pool();

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Returns at least `size` bytes (512-byte aligned) usable on `stream`. ResourceExhausted when
  // the memory cannot be found even after releasing the cache.
  absl::StatusOr<void*> Allocate(size_t size, Stream stream);
  // Like Allocate, in chunks of its own that no other block shares, ready to export.
  absl::StatusOr<void*> AllocateShareable(size_t size, Stream stream);
  // Returns a block to the pool. InvalidArgument if `ptr` is not a live block of this pool.
  absl::Status Free(void* ptr);
  // Marks the block as used by `stream` too: Free waits for that stream's work.
  absl::Status RecordStream(void* ptr, Stream stream);
  // Synchronises the device and releases every entirely free chunk.
  absl::Status EmptyCache();
  // Sets the most physical bytes the pool may hold (0: no limit).
  void SetMemoryLimit(size_t bytes);

  // Exports the live block starting at `ptr` as handles of `type` (the pool's type when kNone)
  // and marks its chunks exported. InvalidArgument for an unknown pointer; FailedPrecondition
  // when the pool's memory is not exportable as `type`.
  absl::StatusOr<ExportedBlock> Export(void* ptr, HandleType type = HandleType::kNone);
  // Calls `listener(chunk_id)` whenever an exported chunk is released to the driver (also when
  // the pool is destroyed). Listeners run with the pool's lock held and must not call it.
  void AddChunkReleaseListener(std::function<void(uint64_t chunk_id)> listener);

  PoolStats GetStats() const;
  void ResetPeakStats();
  void ResetAccumulatedStats();
  Snapshot GetSnapshot() const;
  // Checks every invariant of the pool's bookkeeping (tests call it); Internal on a violation.
  absl::Status CheckInvariants() const;

  // Whether `ptr` lies in this pool's reserved range (no lock taken).
  bool Contains(const void* ptr) const {
    auto p = reinterpret_cast<uintptr_t>(ptr);
    return p >= base_ && p < base_ + reserve_size_;
  }
  // Unique among the pools of this process.
  uint64_t id() const { return id_; }
  int device() const { return options_.device; }
  Driver* driver() const { return driver_; }
  HandleType handle_type() const { return handle_type_; }
  size_t granularity() const { return granularity_; }
  const std::string& device_uuid() const { return device_uuid_; }

 private:
  struct Chunk {
    uint64_t id = 0;
    size_t size = 0;
    PhysHandle handle = 0;
    bool exported = false;
    bool dedicated = false;  // AllocateShareable: holds one block only
    std::unique_ptr<ShareableHandle> shared;  // cached export
  };
  // Work that waits for events: a freed block still used by streams.
  struct Pending {
    Event event;
    Block* block;
  };
  struct StreamReclaim {
    Event event = 0;
    uint64_t seq = 0;        // free counter value when the event was recorded
    bool in_flight = false;
  };

  Pool(Driver* driver, const PoolOptions& options);
  absl::Status Init();

  absl::StatusOr<void*> AllocateLocked(size_t size, Stream stream, bool shareable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Arena& ArenaFor(size_t rounded) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Arena& ArenaOf(uintptr_t addr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The allocated block starting at `ptr`, or nullptr.
  Block* LiveBlock(const void* ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands out `n` bytes of `block` (kFree), splitting off the rest.
  void TakeBlock(Arena& arena, Block* block, size_t n, size_t requested, Stream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Maps new memory so that `arena` can fit `n` bytes for `stream`; returns the free block.
  absl::StatusOr<Block*> Grow(Arena& arena, size_t n, Stream stream, bool dedicated)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates, maps and grants access to [addr, addr+len) in chunks; rolls back on failure.
  absl::Status MapRange(uintptr_t addr, size_t len, bool dedicated)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps and releases one chunk.
  absl::Status ReleaseChunk(uintptr_t addr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases chunks covered by free blocks; `any_stream` also takes blocks whose streams
  // may still be running (callers synchronise first). Stops once `target` bytes are released.
  absl::Status ReleaseFreeChunks(bool any_stream, size_t target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts a block whose streams are done back in the cache (or retires it).
  void Recycle(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free's slow parts: the error for a pointer that is not live; a block other streams used
  // or inside an exported chunk (events, then Recycle); trimming to the release threshold.
  ABSL_ATTRIBUTE_COLD absl::Status NotLive(uintptr_t addr) const;
  ABSL_ATTRIBUTE_NOINLINE absl::Status FreeInUse(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ABSL_ATTRIBUTE_NOINLINE absl::Status ApplyReleaseThreshold() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recycle's common case: caches a block outside exported chunks, coalescing it.
  void Cache(Arena& arena, Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retires the free blocks inside the exported chunk at `chunk_addr`.
  void RetireChunkSpace(uintptr_t chunk_addr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the exported chunks around [addr, end) that nothing uses any more.
  absl::Status ReleaseRetiredChunks(uintptr_t addr, uintptr_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool OverlapsExported(uintptr_t addr, uintptr_t end) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queries outstanding events and finishes the frees whose streams are done.
  absl::Status ProcessPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records events on streams with cached blocks and retags the blocks of finished streams
  // for every stream, except those of `requester` (it may use them already; retagging them
  // would only keep them from coalescing with its later frees).
  absl::Status ReclaimOtherStreams(Stream requester = kAnyStream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes every cached block reusable by every stream (after a device synchronisation).
  void RetagAllFree() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SynchronizeAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Event> GetEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Summary() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateDerivedStats(PoolStats& stats) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets fd_anchor_ up on the first POSIX-fd export; a failure is logged and leaves exports
  // as they were (slower), never failing one.
  void AnchorFdExports() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Driver* const driver_;
  const uint64_t id_;
  PoolOptions options_;
  size_t granularity_ = 0;
  HandleType handle_type_ = HandleType::kNone;
  std::string device_uuid_;
  std::vector<int> access_devices_;  // the device, then its peers
  uintptr_t base_ = 0;               // the reserved range
  size_t reserve_size_ = 0;

  mutable Mutex mu_;
  Arena small_ ABSL_GUARDED_BY(mu_);
  Arena large_ ABSL_GUARDED_BY(mu_);
  // {&small_, &large_}, and where large_ begins (set once by Init), for ArenaFor/ArenaOf.
  Arena* const arenas_[2] = {&small_, &large_};
  uintptr_t large_base_ = 0;
  // Physical chunks by address; together they back exactly the non-gap blocks.
  absl::btree_map<uintptr_t, Chunk> chunks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_chunk_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Stream, StreamReclaim> reclaim_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> spare_events_ ABSL_GUARDED_BY(mu_);
  // From the pool's first POSIX-fd export until it is destroyed: one smallest allocation,
  // exported as an fd that stays open. The CUDA driver (580) sets fd export up whenever no
  // exported fd is open in the process and tears it down with the last one: a chunk's export
  // then costs 0.6-0.9 ms, against 45-80 us while another exported fd is open
  // (bench/import_bench --keep_exported_fd). Without it every share of a fresh chunk would
  // pay the set-up. Not a chunk: outside the reserved range and the stats.
  struct FdExportAnchor {
    PhysHandle handle = 0;
    ShareableHandle fd;
  };
  std::optional<FdExportAnchor> fd_anchor_ ABSL_GUARDED_BY(mu_);
  bool fd_anchor_tried_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t free_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Chunks marked exported, and the bytes of retired blocks in them.
  int64_t exported_chunks_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t retired_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t memory_limit_ ABSL_GUARDED_BY(mu_) = 0;
  // The statistics. Active bytes and blocks are not kept here (the cached path would pay for
  // them) but derived when read (UpdateDerivedStats) from allocated and the pending figures:
  // bytes and blocks freed by callers while streams still use them, their values at the
  // last ResetAccumulatedStats, and the highest active reached while some were pending.
  PoolStats stats_ ABSL_GUARDED_BY(mu_);
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_bytes_at_reset_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_blocks_at_reset_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t active_bytes_peak_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t active_peak_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::function<void(uint64_t)>> release_listeners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_POOL_H_
