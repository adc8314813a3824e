// stream_reclaim.h: when memory freed on one stream may be used by others (internal to the
// pool).
//
// Two jobs, both with driver events:
//   - Pending frees. A block that other streams used (record_stream), or that lies in memory
//     about to be unmapped, is freed only once their work queued before the free has
//     completed: RecordUses records one event per stream and ProcessPending hands the block
//     back (to a callback) when all of its events are done. Where no event could be made or
//     recorded for a stream (the driver out of resources, a stream of another device), that
//     stream is synchronised at once; where that fails too (a stream gone or broken), the
//     block waits on a fence instead, which only a synchronisation of the devices completes
//     (ProcessPending with `device_synced`): the block is never handed back before that
//     stream's work is done. Entries are kept per stream; a pass queries a stream's events oldest
//     first and stops at the first not done (events on a stream complete in order), so many
//     frees waiting for one stream that runs behind cost one query a pass and no walk of them.
//   - Reclaiming other streams' cached blocks. A cached block is tagged with the stream that
//     freed it; another stream may take it only after that stream's work queued before the
//     free has completed. Reclaim records one event per such stream and, once it completes,
//     retags that stream's blocks freed before the event for every stream (kAnyStream). The
//     requesting stream's own blocks keep their tag: it may use them already, and they keep
//     coalescing with its later frees.
// A foreign stream (driver.h: one its owner may destroy) is never called on here: Reclaim
// leaves its blocks tagged until a device synchronisation (RetagAll), and a free that must
// wait for it (RecordUses) waits on a fence.
// A stream that is capturing a CUDA graph (Driver::StreamCapturing) takes no event and is not
// synchronised: an event recorded there would join the graph (another thread's capture, in
// thread_local mode), and a synchronisation would end the capture. A block freed with a use
// on such a stream waits until the stream has finished capturing, and its event is recorded
// then (as PyTorch defers a capture's free events); Reclaim leaves such a stream's blocks
// tagged until then. An event that still ended up recorded in a capture (the capture began
// after the check; its query is Unavailable) is left to the graph, and recorded anew in the
// same way. While the framework has any capture under way (capture_window.h; in CUDA's
// global mode an event query by any thread invalidates it) every stream counts as capturing
// and no event is queried; Reclaim and ProcessPending hold a window from opening while they
// record and query (WorkOutsideCapture), so a capture begins only after them.
// Events are reused (a spare list) and destroyed by DestroyEvents at teardown.
//
// Not thread safe: the owning Pool guards it with its mutex. Every event call is counted in
// `driver_event` of the PoolStats passed in.
#ifndef VMM_ALLOCATOR_STREAM_RECLAIM_H_
#define VMM_ALLOCATOR_STREAM_RECLAIM_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/arena.h"
#include "allocator/driver.h"
#include "allocator/stats.h"

namespace vmm {

class StreamReclaim {
 public:
  void Init(Driver* driver, int device) {
    driver_ = driver;
    device_ = device;
  }

  // Records an event on each of `streams` for `block` (kPendingFree), each counted in
  // block->pending_events; a stream that cannot take one is synchronised instead
  // (num_sync_stream). Returns false when that failed too (the stream is gone or broken): the
  // block then waits on a fence for it, and the caller should synchronise the devices and
  // call ProcessPending(.., true).
  bool RecordUses(Block* block, absl::Span<const Stream> streams, PoolStats& stats);
  bool has_pending() const { return pending_count_ > 0; }
  // Fences among the pending entries: only a synchronisation of the devices completes them.
  size_t fences() const { return fences_; }
  // Events and fences still due, summed over pending blocks (for invariant checks).
  size_t pending_events() const { return pending_count_; }
  // Queries the pending events; calls `done(block)` for each block whose last event (or
  // fence) completed. `device_synced`: the device was synchronised since every entry was
  // recorded, so all are complete (no query made; fences complete only so). On a failed
  // query the entries not yet visited stay pending.
  absl::Status ProcessPending(absl::FunctionRef<void(Block*)> done, PoolStats& stats,
                              bool device_synced = false);

  // The reclaim pass over `arenas` for a request on `requester` (kAnyStream: none). Returns
  // false when an event could not be recorded: the caller must synchronise the device and
  // call RetagAll instead.
  absl::StatusOr<bool> Reclaim(absl::Span<Arena* const> arenas, Stream requester,
                               uint64_t free_seq, PoolStats& stats);
  // After a device synchronisation: every cached block becomes usable by every stream.
  void RetagAll(absl::Span<Arena* const> arenas);

  // Destroys every event (teardown; pending blocks are forgotten).
  void DestroyEvents();

 private:
  // Whether `s` is capturing a graph now (a query failing for that reason counts), counted
  // in driver_event.
  bool Capturing(Stream s, PoolStats& stats);
  struct Pending {
    // kFence: no event; complete after a device synchronisation. kDeferred: the stream was
    // capturing a graph; the event is recorded once it has finished.
    Event event;
    Block* block;
    Stream stream;
  };
  static constexpr Event kFence = 0;
  static constexpr Event kDeferred = 1;  // never a driver's event (a pointer)
  struct StreamState {
    Event event = 0;
    uint64_t seq = 0;  // the pool's free counter when the event was recorded
    bool in_flight = false;
  };

  absl::StatusOr<Event> GetEvent();
  // Events a capture took (a graph may record them on replay): never reused, destroyed by
  // DestroyEvents.
  std::vector<Event> captured_events_;
  // The event of a free deferred while `s` captured a graph, recorded now; kDeferred when `s`
  // was synchronised instead, kFence (counted) when that failed too.
  Event RecordDeferred(Stream s, PoolStats& stats);

  Driver* driver_ = nullptr;
  int device_ = 0;
  // Files a pending entry (counted in its block's pending_events).
  void AddPending(Pending p);
  // ProcessPending's pass: the blocks whose last entry completed go to `ready`.
  absl::Status CollectDone(PoolStats& stats, bool device_synced, std::vector<Block*>& ready);
  // Pending entries with an event, per stream in the order recorded (ordered by stream, so a
  // pass hands blocks back in the same order each run).
  absl::btree_map<Stream, std::deque<Pending>> queued_;
  // Entries deferred while their stream captured a graph, per stream: a pass asks once per
  // stream whether it still captures, not once per entry.
  absl::btree_map<Stream, std::vector<Pending>> deferred_;
  // Fences: only a pass with `device_synced` looks at them.
  std::vector<Pending> fenced_;
  size_t pending_count_ = 0;
  size_t fences_ = 0;
  absl::flat_hash_map<Stream, StreamState> streams_;
  std::vector<Event> spare_events_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_STREAM_RECLAIM_H_
