// pool.h: the caching device memory pool, one per device.
//
// The pool reserves a virtual address range (lengthened after itself where it fills: ExtendRange)
// and grows into it on demand with physical chunks (Driver::Create + Map, then one SetAccess per
// contiguous range grown, for the pool's device and its `peer_devices`). Freed blocks are cached
// and reused best-fit; a block is split when larger than asked and coalesces with free neighbours,
// also across chunk boundaries since the range is contiguous. Requests up to `small_size` are
// served from a separate small arena so that long-lived small blocks do not pin large regions;
// where the small arena's range is full (a range given in the options, one that does not grow,
// one cut short for address space) while the large arena has room, or where the small arena
// cannot grow for lack of memory but a cached large block holds it, such a request is served
// there instead, as a block of SpillSize() bytes (counted in num_small_spills).
//
// Growth policy (growth_policy.h). A request that no cached block fits grows the pool by the
// fewest new bytes that give a contiguous fit: a free block at the edge of a gap is extended
// rather than a fresh chunk mapped beside it. Without pages (large_page 0) the amount is then
// raised by `growth_fraction` of what is already reserved, capped at `max_growth_extra`, so a
// pool that keeps growing makes few driver calls while the overshoot stays a small fraction of
// its size, and a growth is backed by physical chunks of at most `max_chunk` bytes; with pages
// it is exact, planned in half pages (growth_policy.h PlanUnit; whole pages where half a page
// is not whole granules), in chunks of `large_page` and a last chunk of what is left, which
// may end in half a page (to granularity, the last one shorter, only where no gap of the
// range holds the request in whole half pages), or, until a miss first moves memory (after
// it, for requests of kLargeRequestChunks growth chunks or more) and until a miss first finds
// free memory in such a chunk beside a live block, in chunks of up to `growth_page`
// (pool_options.h). Near a memory limit, a fraction cap or the GPU's capacity
// a growth that the rounding to half pages would take past a memory limit or a fraction cap
// is planned to granularity instead (its moves too), and so is the retry after a growth has
// failed for lack of memory (the GPU's capacity), so the rounding alone fails no request but
// during a CUDA graph capture, when no retry is made. Small-arena growth maps `small_chunk`
// at a time, or takes a free chunk that size from the large arena (below).
//
// Reclaiming free pages (reclaim_policy.h). With `large_page` set (the default for a pool
// made without an export observer, pool_options.h), the large arena grows in chunks of
// that size (of several pages before the first move), and a miss that would grow first takes
// chunks wholly inside free blocks elsewhere: each is unmapped there and mapped where the
// request goes (one SetAccess for the range), so the pool's physical memory grows only by what
// free chunks cannot cover. Memory moves between the arenas too: either arena's growth may take
// the large arena's free chunks, and the small arena's while it holds a surplus
// (SmallArenaSurplus). Never exported, dedicated or spare chunks, never free blocks tagged with
// another stream (their work is not known complete), and the requester's own only after
// synchronising its stream; nothing while the pool keeps its memory or a capture is under way.
// Only on a miss: the cached path is unchanged.
//
// Streams. A block freed on stream S is reusable at once on S. Other streams get it only
// after the work queued on S before the free has completed: when a request misses, the pool
// records an event on each other stream with cached blocks and, once it has completed, retags
// those blocks for every stream (the requesting stream's own blocks keep their tag: it may
// use them already, and they keep coalescing with its later frees). RecordStream(ptr, T)
// makes Free wait (with events) for T's work too. Physical memory is unmapped only after the work that used it has completed.
//
// Returning memory. EmptyCache() synchronises the device and releases every chunk that is
// entirely free (where nothing is free, it returns at once, with no driver call). A failing growth first releases free chunks and retries once; a real
// out-of-memory is ResourceExhausted naming the request and summarising the pool. With a
// release threshold, Free releases completed free chunks while more than that is cached.
// A pool trims only itself: a failing growth never takes memory from another pool. None of
// this happens while the pool keeps its memory (below), and neither the retry nor the
// release threshold while a capture is under way in the process (capture_window.h): the
// growth fails instead, and the threshold applies at the next free after the capture; nor
// EmptyCache then (it releases nothing). A pool must not be destroyed during a capture
// (its teardown synchronises and unmaps): RunOutsideCapture (capture_window.h) defers that.
//
// Export invariant. Exporting a block marks every chunk it spans as exported: the free space
// in those chunks is retired at once, blocks freed there later are retired too, and a chunk is
// released to the driver as soon as nothing in it is allocated, so no later allocation can
// land where an importer sees it. Blocks already live in those chunks stay visible to the
// importer: SharesChunks() says whether a block has such neighbours, and AllocateShareable()
// gives a block chunks of its own.
//
// Reusing exported chunks. Creating, mapping, granting and exporting a chunk costs a small
// send more than everything else (on an H200 about 0.1 ms with fabric handles, 0.6 ms with
// POSIX fds). So an exported chunk whose importers are all known to be gone is kept for the
// next AllocateShareable instead of being released. Export says how the block travels
// (ExportUse): kTracked counts one receiver that will report, through SettleExport, when it
// has unmapped the memory (vmm's sends: send_ledger.h); kUntracked (descriptors, IPC handles)
// means importers nobody counts, and the chunk is released once free, as before; kMark only
// marks. A chunk wholly retired (nothing in it allocated, its streams done) is then
//   - released, if ever exported kUntracked or SettleExport said a receiver gave up counting
//     (forwarded it), or if spare_export_bytes are kept already;
//   - kept *parked* (mapped, retired, counted in reserved) while receivers have not reported;
//   - kept *spare* once all have, under a fresh id at once (ExportObserver::ChunkRenamed: fds
//     re-registered under a new key, so a descriptor of an earlier send fetches nothing from
//     then on): AllocateShareable takes the smallest spare chunk that fits closely before
//     growing, and so does an allocation of the large arena that no free block fits (plain
//     memory then, its rest free); neither makes a driver call, and a later send of the
//     block exports it with the handle already exported. Past twice the most the pool has
//     had allocated (the spare chunks and the request together), such an allocation takes the
//     smallest spare chunk it fits, closely or not, and a send that none fits closely first
//     releases the oldest, so sends of varying sizes do not keep growing the pool (each chunk
//     waiting for a send of its own size made reserved memory grow without bound).
// A chunk that still holds live blocks when its last receiver reports its release (a block
// sent in place with its neighbours: ExportNeighbours::kAllow) loses its mark instead, unless
// the pool isolates sends (PoolOptions::isolate_sends) or the chunk is dedicated: under a fresh
// id, as a spare chunk, its retired space becomes free memory again (for the exporting
// block's stream first, stream-ordered) and later frees in it are cached as usual. So does a
// chunk of the small arena once wholly free and unreported (parked until then): small sends
// go in place there, and a stream of them reuses the same chunks.
// A parked chunk whose send ends unreported (lease, forwarded) is released. Spare and parked
// chunks go back to the driver on EmptyCache and before a growth that fails for lack of
// memory (a parked chunk so released is not reused: its receivers' reports find it gone).
// Only chunks that could become spare or free again are parked: of the large arena
// (AllocateShareable allocates there) and no larger than spare_export_bytes (default: no cap;
// spare chunks are cached memory, as free blocks are), or of the small arena where sends are
// not isolated; others are released once free.
//
// Keeping memory. SetKeepMemory(true) makes the pool keep every chunk it has mapped: nothing goes
// back to the driver (EmptyCache, the retry after a failing growth, the release threshold, a
// memory limit, released exported chunks: ReleaseKeptExports) until SetKeepMemory(false);
// free memory is still reused, and retired exported chunks stay mapped (parked) meanwhile.
// What a private pool whose memory a captured CUDA graph replays into needs: the graph writes
// to its blocks' addresses, allocated or not, whenever it is replayed. Only ~Pool releases such
// a pool's chunks. CheckInvariants fails if a chunk was released while the pool kept its
// memory.
//
// Allocating at an address. AllocateAt(addr, size) hands out exactly [addr, addr + size),
// which must lie in free space the pool has mapped (a CUDA graph tree restoring a checkpoint
// of the blocks a replay leaves allocated): it never grows the pool. Free blocks of the range
// still tagged for other streams or pending frees cost a device synchronisation first; while
// a CUDA graph capture is under way anywhere in the process that is FailedPrecondition
// instead (the synchronisation would invalidate the capture).
//
// Export invariant, continued. The pool knows nothing of handles, fds or descriptors: Export
// marks chunks and lets a visitor see each chunk's physical handle under the pool's lock, and
// the ExportObserver given at creation (export_observer.h; the sharing side) hears when an
// exported chunk goes back to the driver. A MappingListener (SetMappingListener,
// mapping_listener.h) hears of every chunk mapped and unmapped, for the allocation history.
//
// Where the pieces live: chunk_map.h (physical chunks, growth with rollback),
// growth_policy.h (how much a miss maps), reclaim_policy.h (which free pages a miss moves
// instead), stream_reclaim.h (events for stream-ordered reuse),
// arena.h / free_blocks.h / block_index.h (blocks, free bins, live index), pool_introspection.cc
// (stats, snapshot, invariants), pool_options.h (options and their text form).
//
// fork(). A pool belongs to the process that made it: in a forked child, Allocate,
// AllocateShareable and Export fail with FailedPrecondition (fork_guard.h), since parent and
// child would otherwise hand out the same bytes. Free, stats and teardown still work there, on
// the child's copy of the bookkeeping (blocks made before the fork may be freed).
//
// Thread safety: all methods are thread safe (one mutex). The cached path (a fit in the cache)
// makes no driver call and no system call.
#ifndef VMM_ALLOCATOR_POOL_H_
#define VMM_ALLOCATOR_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/arena.h"
#include "allocator/chunk_map.h"
#include "allocator/device_cap.h"
#include "allocator/driver.h"
#include "allocator/export_observer.h"
#include "allocator/fork_guard.h"
#include "allocator/mapping_listener.h"
#include "allocator/mutex.h"
#include "allocator/pool_options.h"
#include "allocator/reclaim_policy.h"
#include "allocator/spare_chunks.h"
#include "allocator/stats.h"
#include "allocator/stream_reclaim.h"

namespace vmm {

// One physical chunk of an exported block, as Export's visitor sees it.
struct ExportedChunk {
  uint64_t id = 0;  // unique in this pool for its lifetime
  uintptr_t addr = 0;
  size_t size = 0;
  PhysHandle handle = 0;  // only while Export's visitor runs (the pool's lock held); else 0
  // Marked exported by this export (its free space retired now), not by an earlier one.
  bool newly_marked = false;
};

// What Export() returns: the chunks a block spans, in address order, and where it starts.
struct ExportedBlock {
  std::vector<ExportedChunk> chunks;
  size_t offset = 0;  // of the block inside the first chunk
  size_t size = 0;    // bytes the caller asked for
  HandleType handle_type = HandleType::kNone;
};

// How an exported block travels, for reusing its chunks (see the file comment).
enum class ExportUse {
  kUntracked,  // importers nobody counts (descriptors, IPC): chunks released once free
  kTracked,    // one send whose receiver reports its release (SettleExport)
  kMark,       // marked only, nothing exported yet (a send being prepared)
};

// Whether Export accepts a block whose chunks also hold other live blocks (SharesChunks).
enum class ExportNeighbours {
  kAllow,   // exported too: the importer sees their bytes
  kRefuse,  // FailedPrecondition, nothing marked; checked under the lock that marks the chunks
};

// Bytes no device holds: 2^47, the whole user address space of x86-64. Callers that would
// create a pool (reserving its range) to serve a request check it first (CheckRequestSize).
inline constexpr size_t kMaxRequestBytes = size_t{1} << 47;
// InvalidArgument for a request of kMaxRequestBytes or more (freeing memory would never make
// room). A pool's Allocate refuses it too, and counts it in num_ooms as PyTorch would.
absl::Status CheckRequestSize(size_t size);

class Pool {
 public:
  // How many allocations the calling thread has made, in any pool, that mapped memory for
  // themselves (a growth: chunks created or moved to where the request goes). Read before
  // and after an allocation, it tells whether that allocation mapped memory (the PyTorch
  // plugin's segment stacks), at no cost to allocations that map nothing.
  static uint64_t ThreadGrowths();

  // Reserves the address range and probes the handle type (handle_probe.h). `observer`, if
  // not null, hears about released exported chunks for the pool's whole life and must outlive
  // it. InvalidArgument for bad options or device; FailedPrecondition when kFabric or kPosixFd
  // is requested and unavailable.
  static absl::StatusOr<std::unique_ptr<Pool>> Create(Driver* driver, const PoolOptions& options,
                                                      ExportObserver* observer = nullptr);

  // Waits for the device, then unmaps and releases all memory. Blocks still allocated are
  // released too (their pointers become invalid).
  ~Pool();

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Returns at least `size` bytes (512-byte aligned) usable on `stream`. ResourceExhausted when
  // the memory cannot be found even after releasing the cache. InvalidArgument, before anything
  // is reclaimed, trimmed or mapped, for a request no state of the pool could serve: more than
  // the whole memory of the device (CheckRequestSize too); ResourceExhausted, as early, for
  // one within the GPU's memory but past what the range of a pool whose range does not
  // grow holds (its large arena, at least small_size: an explicit reserve_size below the
  // GPU's memory, a private pool past its process's budget of address space; PyTorch's
  // allocator would call it out of memory). All count in num_ooms, as PyTorch counts every
  // allocation that found no memory.
  absl::StatusOr<void*> Allocate(size_t size, Stream stream);
  // Like Allocate, in chunks of its own that no other block shares, ready to export.
  // FailedPrecondition when the pool's memory is not exportable.
  absl::StatusOr<void*> AllocateShareable(size_t size, Stream stream);
  // Returns a block to the pool. InvalidArgument if `ptr` is not a live block of this pool.
  // Any other error reports a driver fault met while finishing pending frees; the block is
  // freed all the same (no longer live), and its memory is reused only once the streams that
  // used it are known done (a device synchronisation, if no event could be recorded).
  absl::Status Free(void* ptr);
  // Marks the block as used by `stream` too: Free waits for that stream's work.
  absl::Status RecordStream(void* ptr, Stream stream);
  // Allocates exactly [addr, addr + size) on `stream` (file comment, "Allocating at an
  // address"), with the accounting of Allocate (the requested size is `size`). InvalidArgument
  // for an address or size that is not a positive multiple of 512 bytes, a range outside one
  // arena of the pool, or a size the arena holding `addr` does not serve (up to small_size in
  // the small arena, more in the large one: where Allocate would put it). FailedPrecondition
  // when any byte of the range is not free space backed by the pool's chunks (allocated,
  // retired or unmapped); then nothing changes but what a device synchronisation does (tags,
  // finished pending frees).
  absl::StatusOr<void*> AllocateAt(uintptr_t addr, size_t size, Stream stream);
  // Synchronises the device and releases every entirely free chunk (none while the pool keeps
  // its memory). While a capture is under way in the process (capture_window.h) it does
  // nothing and returns OK (warned once): both would invalidate the capture.
  absl::Status EmptyCache();
  // Sets the most physical bytes the pool may hold (0: no limit).
  void SetMemoryLimit(size_t bytes);
  // From now on this pool's physical bytes also count against `cap`, shared with other pools
  // of the device (device_cap.h): a growth that would take their sum past its limit fails as
  // one past the pool's own limit does. Its allocated bytes go to the cap's joint figure too
  // (DeviceCap::allocated), from what it holds now on. Once per pool.
  void ShareDeviceCap(std::shared_ptr<DeviceCap> cap);
  // From now on `listener` (null: none; not owned, it must outlive the pool) hears of every
  // chunk the pool maps or unmaps, as `source`'s (mapping_listener.h), with the pool's lock
  // held; what is mapped already is not told.
  void SetMappingListener(MappingListener* listener, MappingSource source);
  // Tells the listener that every chunk the pool maps is unmapped and tells it nothing more:
  // the pool leaves the listener's view for good (its owner forgets it; its teardown may
  // come much later, after a capture).
  void DetachMappingListener();
  // Keeps every mapped chunk while `keep` (file comment, "Keeping memory"). Turning it off
  // releases nothing by itself: EmptyCache then gives back what is free.
  void SetKeepMemory(bool keep);
  bool keeps_memory() const;
  // No split (torch.cuda.MemPool(no_split=True)): from now on every block of the pool gets a
  // chunk of its own (the request rounded up to the granularity; one driver allocation up to
  // max_chunk, so a snapshot segment and an exported handle of its own), with an unmapped
  // granule on each side so that it never joins a neighbour. A block is handed out whole (its
  // allocated bytes are its chunk's, as PyTorch counts a no_split segment) and cached for its
  // stream when freed like any block (reused at once by that stream, by others after their
  // work). The smallest cached block that holds a later request serves it whole, never split,
  // if at most an eighth over the request rounded to the granularity; a larger one only in the
  // out-of-memory retry. One sent in place is free memory again once its receivers report.
  // FailedPrecondition once the pool has mapped memory (a setting for a fresh pool).
  absl::Status SetNoSplit();

  // Marks the chunks the live block starting at `ptr` spans as exported (export invariant)
  // and calls `visit` for each, in address order, with the pool's lock held: the visitor may
  // call the driver (e.g. Driver::Export of the chunk's handle) but not this pool, and sets
  // `*called_driver` when it called Driver::Export, also when that failed (counted in the
  // stats' driver_export). A visitor error stops the export and is returned (the chunks stay
  // marked). InvalidArgument for an unknown pointer; FailedPrecondition when the pool's memory
  // is not exportable as `type` (kNone: the pool's type), or, with ExportNeighbours::kRefuse,
  // when the block shares a chunk with another live block (then nothing is marked: the check
  // and the marking are one step, so no allocation can land beside the block in between).
  // The returned chunks' `handle` is 0: a handle is valid only while the visitor runs.
  using ChunkVisitor =
      absl::FunctionRef<absl::Status(const ExportedChunk& chunk, bool* called_driver)>;
  absl::StatusOr<ExportedBlock> Export(void* ptr, HandleType type, ChunkVisitor visit,
                                       ExportNeighbours neighbours = ExportNeighbours::kAllow,
                                       ExportUse use = ExportUse::kUntracked);
  // Export without a visitor: marks the chunks and describes them (no shareable handles).
  absl::StatusOr<ExportedBlock> Export(void* ptr, HandleType type = HandleType::kNone,
                                       ExportNeighbours neighbours = ExportNeighbours::kAllow,
                                       ExportUse use = ExportUse::kUntracked);
  // The receiver of a kTracked export of `chunks` (as Export returned them) reported:
  // `released` true when it has unmapped them, false when it cannot count its importers (it
  // forwarded the memory, or the send ended unreported). A chunk released or reused since
  // (its id changed) is skipped. Chunks left wholly free are then kept or released, and
  // chunks with live blocks and no receiver left lose their mark (file comment); a release
  // error is logged.
  void SettleExport(const std::vector<ExportedChunk>& chunks, bool released);

  // Whether any physical chunk the live block at `ptr` spans also holds another live block,
  // so that exporting it would show an importer that block's bytes. A block freed while other
  // streams still use it (record_stream) counts as live until they are done; free and retired
  // space does not count. A block from AllocateShareable never shares. Callers that must not
  // expose other blocks move such a block into chunks of its own (AllocateShareable, copy)
  // before exporting it. Walks only the neighbouring blocks inside the block's first and last
  // chunk; no driver call. InvalidArgument if `ptr` is not the start of a live block.
  absl::StatusOr<bool> SharesChunks(const void* ptr);
  // The bytes asked for when the live block at `ptr` was allocated (what Export describes as
  // the buffer's size; the block itself is rounded up to 512 bytes). InvalidArgument if `ptr`
  // is not the start of a live block.
  absl::StatusOr<size_t> BlockSize(const void* ptr);

  // Bytes of the exported chunks that sends hold now (walks the chunks; for tests and
  // introspection): blocks moved for a send or being sent, chunks parked for their receivers;
  // not spare chunks, nor chunks exported kUntracked.
  size_t SendBytesInUse() const;

  // The live blocks (allocated, or freed while streams still use them: kPendingFree) in
  // address order. Walks every block of the pool.
  std::vector<BlockInfo> LiveBlocks() const;

  PoolStats GetStats() const;
  // The figures of a pool about to be destroyed, fixed: GetStats returns them from now on
  // (what its owner keeps of them once it is gone, and what readers still holding it see, are
  // then the same; a sweep's EmptyCache on it meanwhile changes neither). Once only: later
  // calls return the same figures.
  PoolStats FreezeStats();
  void ResetPeakStats();
  void ResetAccumulatedStats();
  Snapshot GetSnapshot() const;
  // Checks every invariant of the pool's bookkeeping (tests call it); Internal on a violation.
  absl::Status CheckInvariants() const;

  // Whether `ptr` lies in the small arena (requests up to small_size; no lock taken).
  bool InSmallArena(const void* ptr) const {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    return p >= base_ && p < large_base_;
  }
  // The start of this pool's reserved range (no lock taken).
  uintptr_t base() const { return base_; }
  // The bytes of address space the pool holds, as lengthened so far (no lock taken).
  size_t reserved_range() const { return range_end_.load(std::memory_order_acquire) - base_; }
  // Whether `ptr` lies in this pool's reserved range, as lengthened so far (no lock taken).
  bool Contains(const void* ptr) const {
    auto p = reinterpret_cast<uintptr_t>(ptr);
    return p >= base_ && p < range_end_.load(std::memory_order_acquire);
  }
  // Unique among the pools of this process.
  uint64_t id() const { return id_; }
  // Whether this process is a fork() child of the one that made the pool (no lock taken).
  bool made_before_fork() const { return ForkGeneration() != fork_generation_; }
  int device() const { return options_.device; }
  Driver* driver() const { return driver_; }
  ExportObserver* observer() const { return observer_; }
  HandleType handle_type() const { return handle_type_; }
  size_t granularity() const { return granularity_; }
  // The options in force: kAutoSize fields decided, sizes rounded to granularity (set by
  // Create, constant afterwards).
  const PoolOptions& options() const { return options_; }
  // The pages the large arena grows in now: options().large_page, or pressure_page once a
  // pool without pages has switched to them (pool_options.h); 0: single chunks.
  size_t page() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& device_uuid() const { return device_uuid_; }

 private:
  Pool(Driver* driver, const PoolOptions& options, ExportObserver* observer);
  absl::Status Init();
  // The reserved range for a basis of `basis` bytes (reserve_size, or twice the memory of
  // the pool's GPU) and `extra` more for the large arena: the small arena's share (an eighth
  // of the basis, or `small_floor` if more; the large arena keeps the rest of basis + extra)
  // and the whole size, rounded to granularity; InvalidArgument where small_chunk or
  // small_size leave an arena unable to serve what it is sent (judged by the basis alone).
  struct RangeLayout {
    size_t small = 0;
    size_t size = 0;
  };
  absl::StatusOr<RangeLayout> LayOutRange(size_t basis, size_t extra, size_t small_floor) const;
  // Lengthens the range for a large-arena request of `n` bytes that no gap holds: reserves
  // the next range_step_ bytes (at least `n`, in whole pages) right after it (driver.h
  // ReserveAt) and gives them to the large arena as a gap of their own (Arena::ExtendRange).
  // ResourceExhausted when the driver refuses that address space (taken, or none left) or
  // the range would pass kMaxOptionBytes; nothing changes then.
  absl::Status ExtendRange(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<void*> AllocateLocked(size_t size, Stream stream, bool shareable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Arena& ArenaFor(size_t rounded) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The size of a block of up to small_size served by the large arena (a spill): the large
  // arena's least block, just past small_size, so that its blocks still start at least
  // 2^large_shift apart (Init).
  size_t SpillSize() const;
  Arena& ArenaOf(uintptr_t addr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AllocateAt's argument checks (InvalidArgument).
  absl::Status CheckAllocateAtRange(uintptr_t addr, size_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The allocated block starting at `ptr`, or nullptr.
  Block* LiveBlock(const void* ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LiveBlock, or InvalidArgument naming `what` (the caller's operation) when there is none.
  absl::StatusOr<Block*> LiveBlockFor(const void* ptr, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SharesChunks for a live block; Internal when the block is not backed by chunks.
  absl::StatusOr<bool> SharesChunksLocked(const Block* block) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands out `n` bytes of `block` (kFree), splitting off the rest.
  void TakeBlock(Arena& arena, Block* block, size_t n, size_t requested, Stream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the small arena holds more free memory than it keeps for itself: cached bytes of
  // at least kSmallSurplusChunks small chunks, and no fewer than it has allocated. Then any of
  // its wholly free chunks may move to where a growth goes (reclaim_policy.h); a later growth
  // of the small arena takes free chunks of its size back from the large arena.
  bool SmallArenaSurplus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr int64_t kSmallSurplusChunks = 4;
  // Maps new memory so that `arena` can fit `n` bytes for `stream`; returns the free block.
  // `to_granularity`: plan it in granules, not half pages (the retry after a growth failed
  // for lack of memory, where the rounding may be what did not fit).
  absl::StatusOr<Block*> Grow(Arena& arena, size_t n, Stream stream, bool dedicated,
                              bool to_granularity = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The largest chunk a paged growth of `fresh` new bytes for a request of `n`, planned in plan
  // units (`in_units`; else to granularity), creates: large_page; or, until the pool first
  // moves memory (after it, for `n` of kLargeRequestChunks growth chunks or more) and unless
  // it ran short of it or found free memory pinned in such a chunk (pinned_in_chunks_), and
  // while it holds at most half of what it may, the largest
  // power-of-two number of pages
  // within `n` and growth_page (pool_options.h; the growth's last chunk is what is left).
  // Asks the driver how much of the GPU's memory is free only where the chunk could be several
  // pages and the memory limit and memory fraction leave the answer open.
  size_t GrowthChunk(size_t n, bool in_units, size_t fresh) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the pool, grown by `fresh` bytes, would hold more than half of what it may: its
  // memory limit, its share of a memory fraction, what the GPU has free. Asks the driver the
  // last (the one figure that costs a call) only where the others leave the answer open; a
  // failed ask counts as no bound.
  bool PastHalfOfAllowed(size_t fresh) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Turns pages on (page_ = pressure_page) in a pool without them, once a growth of `n` more
  // bytes would take it past half of what it may hold or one has failed for lack of memory
  // (pool_options.h pressure_page); counted in num_page_switches.
  void SwitchToPagesUnderPressure(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the chosen free chunks (reclaim_policy.h) end to end from `to`, granting access
  // once; synchronises `stream` first when the choice says so. On failure the chunks are
  // moved back (or released, their places made gaps) and the error returned.
  absl::Status MoveChunks(const ReclaimChoice& reclaim, uintptr_t to, Stream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps and releases chunks, telling the observer of those it heard of (exported once);
  // ChunkMap::Release says how many Unmap calls and what a failure leaves.
  absl::Status ReleaseChunks(absl::Span<const uintptr_t> addrs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReleaseChunk(uintptr_t addr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uintptr_t addrs[] = {addr};
    return ReleaseChunks(addrs);
  }
  // Makes [addr, addr + size), a chunk still mapped and granted inside a gap (a rollback whose
  // release failed), a free block, so that the arena and the chunk map agree again.
  void AdoptStranded(uintptr_t addr, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A chunk a failed growth or move could not unmap (ChunkMap::Stranded: still mapped, in the
  // chunk map, access unknown): granted access and kept as free memory where it lies (adopted
  // if the arena has a gap there); if access cannot be granted either, logged, and the arena
  // keeps no free block over it.
  void PlaceStranded(const ChunkMap::Stranded& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // Before the chunks of [addr, end) not yet exported are exported by a block of stream
  // `exporter`: waits for the streams other than `exporter` that freed blocks in them (free,
  // or pending on other streams' events), since those retire with the chunk and go (released
  // or reused as spare) once the exported block is freed, with no event recorded on their own
  // stream. The exporter's own work is waited for at that free (FreeInUse). A stream that
  // cannot be synchronised (gone) makes it wait for the devices (SynchronizeDevices).
  // While a capture is under way, where a synchronisation would invalidate it, the space
  // waits instead (HoldSpaceForItsStreams).
  absl::Status WaitForSpaceBeforeExport(uintptr_t addr, uintptr_t end, Stream exporter)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The free space in the chunks of [addr, end) not yet exported that streams other than
  // `exporter` freed (and blocks freed while other streams used them) becomes pending frees
  // that wait for their own stream too (stream_reclaim.h: an event recorded once the capture
  // is over), so it retires only once that stream's work is done, rather than with the chunk.
  void HoldSpaceForItsStreams(uintptr_t addr, uintptr_t end, Stream exporter)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the exported chunks around [addr, end) that nothing uses any more, or keeps
  // them parked or spare (file comment, "Reusing exported chunks"); `release_parked` releases
  // parked ones too, giving up their reuse (EmptyCache, a failing growth).
  absl::Status ReleaseRetiredChunks(uintptr_t addr, uintptr_t end, bool release_parked = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The smallest spare chunk of at least `n` bytes and at most `n + max_slack` made a free
  // block (not cached: the caller takes it at once), or nullptr if none. For a send it stays
  // marked exported; otherwise the mark comes off (plain memory again).
  Block* TakeSpareChunk(size_t n, size_t max_slack, Stream stream, bool for_send)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the export mark off chunk `c`, which no receiver maps any more (it still holds live
  // blocks, or it is of the small arena): a fresh id (the observer hears of it), and its
  // retired space becomes free memory tagged with the stream whose export marked it (the
  // space retired then was not waited for on that stream; what retired later was recycled
  // only after its streams' work), so other streams reuse it only after that stream's work
  // (the pool's stream-ordered reuse).
  void UnmarkChunk(ChunkMap::Map::iterator c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether exported `chunk` may lose its mark: every receiver vmm counts has reported its
  // release, none it cannot count ever mapped it, and the pool does not isolate sends.
  bool NoReceiverLeft(const Chunk& chunk) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases spare chunks, the oldest first, until `target` bytes went (SIZE_MAX: all).
  absl::Status ReleaseSpareChunks(size_t target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives up reuse where memory is asked back (EmptyCache, a failing growth): releases the
  // spare chunks and the parked ones (their receivers' reports will find them gone).
  absl::Status ReleaseKeptExports() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes the frees whose streams are done (StreamReclaim::ProcessPending + Recycle);
  // `device_synced`: all are, the device was just synchronised.
  absl::Status ProcessPending(bool device_synced = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes cached blocks of finished streams reusable by every stream (not `requester`'s).
  absl::Status ReclaimOtherStreams(Stream requester = kAnyStream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the device, finishes pending frees, and makes every cached block reusable.
  absl::Status SynchronizeAndRetag() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SynchronizeAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Synchronises the pool's device and its peer_devices: the devices whose streams can reach
  // the pool's memory.
  absl::Status SynchronizeDevices() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Summary() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateDerivedStats(PoolStats& stats) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks freed by callers while streams still use them (kPendingFree), of the pool or of
  // one arena: their bytes and count, those at the last ResetAccumulatedStats, and the highest
  // active (allocated + pending) reached while some were pending.
  struct Pending {
    int64_t bytes = 0;
    int64_t blocks = 0;
    int64_t bytes_at_reset = 0;
    int64_t blocks_at_reset = 0;
    int64_t active_bytes_peak = 0;
    int64_t active_peak = 0;
    // Free space made pending without being allocated (HoldSpaceForItsStreams), cumulative:
    // active rises by it as if allocated, so it counts as allocated and later freed there.
    int64_t held_bytes = 0;
    int64_t held_blocks = 0;
    int64_t held_bytes_at_reset = 0;
    int64_t held_blocks_at_reset = 0;
  };
  // The arena `addr` lies in (stats_.arena and arena_pending_ are indexed by it).
  ArenaKind ArenaKindOf(uintptr_t addr) const { return ArenaKindAt(addr, large_base_); }
  // `block` enters (+1) or leaves (-1) kPendingFree.
  void CountPending(const Block* block, int sign) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `block`, free space, enters kPendingFree without being allocated (CountPending, and the
  // active statistics' allocated and peak).
  void CountHeld(const Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After an allocation while blocks are pending: active may have reached a new high.
  void NoteActivePeak() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Driver* const driver_;
  ExportObserver* const observer_;
  const uint64_t id_;
  const uint64_t fork_generation_;  // ForkGeneration() when the pool was made
  PoolOptions options_;
  size_t granularity_ = 0;
  HandleType handle_type_ = HandleType::kNone;
  std::string device_uuid_;
  // The reserved range: [base_, base_ + reserve_size_), one reservation from Init and any
  // ExtendRange added after it (reservations_, each given back whole by the destructor).
  // base_ is set once by Init; Contains reads range_end_ without the lock.
  uintptr_t base_ = 0;
  size_t reserve_size_ ABSL_GUARDED_BY(mu_) = 0;
  // SetNoSplit; beside reserve_size_, which the cached path reads with it.
  bool no_split_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uintptr_t> range_end_{0};
  std::vector<std::pair<uintptr_t, size_t>> reservations_ ABSL_GUARDED_BY(mu_);
  // Whether a full range lengthens (PoolOptions::range_grows), by how much at least (the
  // large arena's first size), and the driver's refusal of the address after it, which
  // stands until EmptyCache (OK: none).
  bool range_grows_ ABSL_GUARDED_BY(mu_) = false;
  size_t range_step_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status range_refused_ ABSL_GUARDED_BY(mu_);
  // The largest request the pool could ever serve: the smaller of the whole memory of the device
  // and what its range holds (its large arena, at least small_size), or the most it may grow
  // to where it grows (set by Init); and whether the range bounds it below the GPU's
  // memory (a request past it but within the device is then out of memory in this pool).
  size_t max_request_ = 0;
  bool range_bounds_requests_ = false;
  size_t device_total_ = 0;  // all the memory of the pool's GPU (set by Init)

  mutable Mutex mu_;
  Arena small_ ABSL_GUARDED_BY(mu_);
  Arena large_ ABSL_GUARDED_BY(mu_);
  // {&small_, &large_}, and where large_ begins (set once by Init), for ArenaFor/ArenaOf.
  Arena* const arenas_[2] = {&small_, &large_};  // the arenas they point to: under mu_
  uintptr_t large_base_ = 0;
  // Physical chunks by address; together they back exactly the non-gap blocks.
  ChunkMap chunks_ ABSL_GUARDED_BY(mu_);
  StreamReclaim reclaim_ ABSL_GUARDED_BY(mu_);
  uint64_t free_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes of retired blocks (free space inside exported chunks).
  int64_t retired_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Spare chunks (exported, wholly retired, no importer left), by size and by age.
  SpareChunks spare_ ABSL_GUARDED_BY(mu_);
  size_t memory_limit_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<DeviceCap> device_cap_ ABSL_GUARDED_BY(mu_);  // ShareDeviceCap's
  // SetKeepMemory: no chunk goes back to the driver while set; chunks released anyway while it
  // was set (a path that forgot to ask), for CheckInvariants.
  bool keep_memory_ ABSL_GUARDED_BY(mu_) = false;
  // Set once a miss has moved memory, and once a growth failed for lack of memory: from
  // then on paged growth is in single pages (GrowthChunk; pool_options.h growth_page), after
  // a move except for requests of kLargeRequestChunks growth chunks or more. Never reset.
  bool moved_memory_ ABSL_GUARDED_BY(mu_) = false;
  // The pages the large arena grows in: options_.large_page (0: single chunks), until a pool
  // without them switches to pressure_page (SwitchToPagesUnderPressure). Never switched back.
  size_t page_ ABSL_GUARDED_BY(mu_) = 0;
  bool short_of_memory_ ABSL_GUARDED_BY(mu_) = false;
  // Whether a growth has made chunks of several pages (GrowthChunk), and whether memory
  // pinned in one has been found since (reclaim_policy.h PinnedBytes: summed by a miss's
  // FindMovable over the free blocks it may take from, and checked for a block taken from a
  // growth): from then on paged growth is in single pages whatever the request. Blocks that
  // do not fill such chunks, or that reuse part of what an earlier block freed in them, keep
  // the rest of each chunk from moving (a prefill's temporaries of several GiB freed, then
  // every layer's K and V cache carved out of them). Never reset.
  bool made_several_pages_ ABSL_GUARDED_BY(mu_) = false;
  bool pinned_in_chunks_ ABSL_GUARDED_BY(mu_) = false;
  // The most bytes ever allocated at once (a high that ResetPeakStats does not lower: a
  // program that resets its peaks every step must not keep the pool from settling), and the
  // bytes misses moved since it last rose: past kSettleMoves times what the pool holds,
  // misses below the high settle (reclaim_policy.h GrowthCost).
  int64_t allocated_high_ ABSL_GUARDED_BY(mu_) = 0;
  size_t moved_since_high_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t released_while_kept_ ABSL_GUARDED_BY(mu_) = 0;
  // The statistics, of the pool and of each arena (stats_.arena). Active bytes and blocks
  // are not kept there (the cached path would pay for them) but derived when read
  // (UpdateDerivedStats) from allocated and the Pending figures, of the pool (pending_) and
  // of each arena (arena_pending_).
  PoolStats stats_ ABSL_GUARDED_BY(mu_);
  std::optional<PoolStats> frozen_stats_ ABSL_GUARDED_BY(mu_);  // FreezeStats
  Pending pending_ ABSL_GUARDED_BY(mu_);
  Pending arena_pending_[kNumArenas] ABSL_GUARDED_BY(mu_);
  // mu_ held across fork() (fork_guard.h, ForkLevel::kPool), so that a forked child that frees
  // blocks its parent made here never finds it held for good. Last: unregistered first.
  ForkRegistration fork_registration_{ForkLevel::kPool, ForkHandlers::Lock(&mu_)};
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_POOL_H_
