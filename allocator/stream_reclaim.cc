#include "allocator/stream_reclaim.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "allocator/capture_window.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {

bool StreamReclaim::Capturing(Stream s, PoolStats& stats) {
  if (s == kAnyStream) return false;
  // A capture under way anywhere in the process (capture_window.h): no event work at all.
  if (CaptureWindowOpen()) return true;
  ++stats.driver_event;
  absl::StatusOr<bool> capturing = driver_->StreamCapturing(s);
  // The legacy stream while another stream captures in global mode answers Unavailable (an
  // implicit synchronisation): nothing may be queued there either.
  return capturing.ok() ? *capturing : absl::IsUnavailable(capturing.status());
}

// The event of a free deferred while its stream captured a graph, recorded now; kDeferred if
// the stream was synchronised instead (no event could be recorded), kFence if that failed too.
Event StreamReclaim::RecordDeferred(Stream s, PoolStats& stats) {
  absl::StatusOr<Event> event = GetEvent();
  absl::Status recorded = event.status();
  if (event.ok()) {
    ++stats.driver_event;
    recorded = driver_->RecordEvent(*event, s);
    if (recorded.ok()) return *event;
    spare_events_.push_back(*event);
  }
  // As RecordUses: wait for the stream itself, else for a device synchronisation.
  ++stats.num_sync_stream;
  if (driver_->SynchronizeStream(s).ok()) return kDeferred;  // done: no event to query
  LogWarningOnce("free-record", absl::StrCat("stream ordering of a free: ", recorded.message(),
                                             "; the block waits for a device synchronisation"));
  ++fences_;
  return kFence;
}

absl::StatusOr<Event> StreamReclaim::GetEvent() {
  if (!spare_events_.empty()) {
    Event e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return driver_->CreateEvent(device_);
}

bool StreamReclaim::RecordUses(Block* block, absl::Span<const Stream> streams,
                               PoolStats& stats) {
  bool all = true;
  for (Stream s : streams) {
    if (IsForeignStream(s)) {
      // Perhaps gone (driver.h): never called on. A fence, which the caller's device
      // synchronisation completes.
      all = false;
      ++fences_;
      pending_.push_back(Pending{kFence, block, s});
      ++block->pending_events;
      continue;
    }
    if (Capturing(s, stats)) {
      // An event recorded there would join the graph, and synchronising the stream would end
      // the capture: recorded once the capture is over (ProcessPending).
      pending_.push_back(Pending{kDeferred, block, s});
      ++block->pending_events;
      continue;
    }
    absl::StatusOr<Event> event = GetEvent();
    absl::Status recorded = event.status();
    if (event.ok()) {
      ++stats.driver_event;
      recorded = driver_->RecordEvent(*event, s);
      if (!recorded.ok()) spare_events_.push_back(*event);
    }
    if (!recorded.ok()) {
      // No event (none could be made, or the stream is of another device, whose streams take
      // only that GPU's events): wait for the stream itself, or, if that fails too (gone
      // or broken), leave a fence.
      ++stats.num_sync_stream;
      if (driver_->SynchronizeStream(s).ok()) continue;
      LogWarningOnce("free-record", absl::StrCat("stream ordering of a free: ", recorded.message(),
                                                 "; the block waits for a device synchronisation"));
      all = false;
      ++fences_;
    }
    pending_.push_back(Pending{recorded.ok() ? *event : kFence, block, s});
    ++block->pending_events;
  }
  return all;
}

absl::Status StreamReclaim::ProcessPending(absl::FunctionRef<void(Block*)> done,
                                           PoolStats& stats, bool device_synced) {
  auto finish = [&](const Pending& p) {
    if (p.event == kFence) {
      --fences_;
    } else if (p.event != kDeferred) {
      spare_events_.push_back(p.event);
    }
    if (--p.block->pending_events == 0) done(p.block);
  };
  // While a graph is captured, querying an event invalidates it (capture_window.h); the
  // queries below hold a window from opening until they are done.
  const WorkOutsideCapture querying(!device_synced);
  if (!device_synced && !querying.entered()) return absl::OkStatus();
  // Streams with an event not done yet in this pass: events complete in the order they were
  // recorded on a stream, and entries are kept in that order (but for deferred ones, recorded
  // in the pass: skipping those is only late), so a later entry of such a stream is not
  // queried. With thousands of frees pending on a stream that runs behind (record_stream on a
  // communication stream), each allocation queried every one of them.
  absl::InlinedVector<Stream, 4> busy;
  auto is_busy = [&](Stream s) { return std::find(busy.begin(), busy.end(), s) != busy.end(); };
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending p = pending_[i];
    if (!device_synced && p.event != kDeferred && p.event != kFence && is_busy(p.stream)) {
      pending_[kept++] = p;
      continue;
    }
    if (p.event == kDeferred) {
      // Freed while its stream captured a graph. Still capturing: nothing to wait for yet.
      // Done: a device synchronisation since covers its work, else its event is recorded now.
      if (Capturing(p.stream, stats)) {
        pending_[kept++] = p;
        continue;
      }
      if (!device_synced) {
        p.event = RecordDeferred(p.stream, stats);
        if (p.event == kDeferred) {  // the stream was synchronised instead
          finish(p);
          continue;
        }
        if (p.event == kFence) {
          pending_[kept++] = p;
          continue;
        }
      }
    }
    absl::StatusOr<bool> complete = device_synced;
    if (!device_synced && p.event != kFence) {
      ++stats.driver_event;
      complete = driver_->EventDone(p.event);
    }
    if (!complete.ok() && absl::IsUnavailable(complete.status())) {
      // Recorded in a stream that was capturing a graph (it began capturing after the
      // check): the event belongs to the graph now, and is left to it (destroyed at teardown);
      // recorded anew later.
      LogWarningOnce("pending-capture", complete.status().message());
      captured_events_.push_back(p.event);
      pending_[kept++] = Pending{kDeferred, p.block, p.stream};
      continue;
    }
    if (!complete.ok()) {
      // Keep the list whole: the entries not yet visited stay pending (this one as it was
      // updated).
      pending_[kept++] = p;
      for (size_t j = i + 1; j < pending_.size(); ++j) pending_[kept++] = pending_[j];
      pending_.resize(kept);
      return complete.status();
    }
    if (!*complete) {
      if (p.event != kFence) busy.push_back(p.stream);  // a fence says nothing of its events
      pending_[kept++] = p;
      continue;
    }
    finish(p);
  }
  pending_.resize(kept);
  return absl::OkStatus();
}

absl::StatusOr<bool> StreamReclaim::Reclaim(absl::Span<Arena* const> arenas, Stream requester,
                                            uint64_t free_seq, PoolStats& stats) {
  // While a graph is captured no event is recorded or queried, in flight ones included
  // (capture_window.h): every stream keeps its blocks. The events below hold a window from
  // opening until they are done.
  const WorkOutsideCapture events(/*wanted=*/true);
  if (!events.entered()) return true;
  // Streams that have cached blocks only they may use.
  // A foreign stream may be gone (driver.h): no call is made on it, and its blocks stay
  // tagged, as PyTorch's allocator keeps every stream's, until a synchronisation of the
  // device retags them (RetagAll: the retry before out of memory, EmptyCache).
  std::vector<Stream> streams;
  for (const Arena* arena : arenas) {
    arena->free_blocks().ForEachStream([&](Stream s) {
      if (s != kAnyStream && StreamHandle(s) != StreamHandle(requester) &&
          !IsForeignStream(s) && std::find(streams.begin(), streams.end(), s) == streams.end()) {
        streams.push_back(s);
      }
    });
  }
  for (Stream s : streams) {
    StreamState& r = streams_[s];
    // A stream capturing a graph: an event recorded there would join the graph (and could
    // not be queried); its blocks wait until it has finished capturing.
    if (!r.in_flight && Capturing(s, stats)) continue;
    if (!r.in_flight) {
      if (r.event == 0) {
        absl::StatusOr<Event> event = GetEvent();
        if (!event.ok()) {
          LogWarningOnce("reclaim-create", absl::StrCat("stream ordering: ", event.status().message(),
                                                        "; synchronising the device instead"));
          return false;
        }
        r.event = *event;
      }
      ++stats.driver_event;
      absl::Status recorded = driver_->RecordEvent(r.event, s);
      if (!recorded.ok()) {
        LogWarningOnce("reclaim-record", absl::StrCat("stream ordering: ", recorded.message(),
                                                      "; synchronising the device instead"));
        return false;
      }
      r.seq = free_seq;
      r.in_flight = true;
    }
    ++stats.driver_event;
    absl::StatusOr<bool> done = driver_->EventDone(r.event);
    if (!done.ok() && absl::IsUnavailable(done.status())) {
      // Recorded after the stream began capturing: left to the graph (destroyed at teardown);
      // recorded anew later.
      LogWarningOnce("reclaim-capture", done.status().message());
      captured_events_.push_back(r.event);
      r.event = 0;
      r.in_flight = false;
      continue;
    }
    VMM_RETURN_IF_ERROR(done.status());
    if (!*done) continue;
    r.in_flight = false;
    for (Arena* arena : arenas) {
      for (Block* b : arena->free_blocks().BlocksOf(s)) {
        if (b->free_seq <= r.seq && b->state == BlockState::kFree && b->stream == s) {
          arena->Retag(b, kAnyStream);
        }
      }
    }
  }
  // Forget streams with nothing cached (they may be long gone), keeping their events.
  for (auto it = streams_.begin(); it != streams_.end();) {
    const bool cached = it->first == requester ||
                        std::find(streams.begin(), streams.end(), it->first) != streams.end();
    if (!cached && !it->second.in_flight) {
      if (it->second.event != 0) spare_events_.push_back(it->second.event);
      streams_.erase(it++);
    } else {
      ++it;
    }
  }
  return true;
}

void StreamReclaim::RetagAll(absl::Span<Arena* const> arenas) {
  for (Arena* arena : arenas) {
    std::vector<Stream> streams;
    arena->free_blocks().ForEachStream([&](Stream s) {
      if (s != kAnyStream) streams.push_back(s);
    });
    for (Stream s : streams) {
      for (Block* b : arena->free_blocks().BlocksOf(s)) {
        // Earlier retags may have merged `b` away; BlocksOf is re-read per stream, and a
        // merged block keeps its own tag, so only blocks still tagged `s` are touched.
        if (b->state == BlockState::kFree && b->stream == s) arena->Retag(b, kAnyStream);
      }
    }
  }
  for (auto& [stream, r] : streams_) r.in_flight = false;
}

void StreamReclaim::DestroyEvents() {
  for (const Pending& p : pending_) {
    if (p.event != kFence && p.event != kDeferred) spare_events_.push_back(p.event);
  }
  pending_.clear();
  fences_ = 0;
  for (auto& [stream, r] : streams_) {
    if (r.event != 0) spare_events_.push_back(r.event);
  }
  streams_.clear();
  for (Event e : spare_events_) (void)driver_->DestroyEvent(e);
  spare_events_.clear();
  for (Event e : captured_events_) (void)driver_->DestroyEvent(e);
  captured_events_.clear();
}

}  // namespace vmm
