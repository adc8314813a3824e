#include "allocator/stream_reclaim.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
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
      AddPending(Pending{kFence, block, s});
      continue;
    }
    if (Capturing(s, stats)) {
      // An event recorded there would join the graph, and synchronising the stream would end
      // the capture: recorded once the capture is over (ProcessPending).
      AddPending(Pending{kDeferred, block, s});
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
    AddPending(Pending{recorded.ok() ? *event : kFence, block, s});
  }
  return all;
}

void StreamReclaim::AddPending(Pending p) {
  ++pending_count_;
  ++p.block->pending_events;
  if (p.event == kFence) {
    fenced_.push_back(p);
  } else if (p.event == kDeferred) {
    deferred_[p.stream].push_back(p);
  } else {
    queued_[p.stream].push_back(p);
  }
}

absl::Status StreamReclaim::ProcessPending(absl::FunctionRef<void(Block*)> done,
                                           PoolStats& stats, bool device_synced) {
  // While a graph is captured, querying an event invalidates it (capture_window.h); the
  // queries below hold a window from opening until they are done.
  const WorkOutsideCapture querying(!device_synced);
  if (!device_synced && !querying.entered()) return absl::OkStatus();
  // Blocks whose last event completed, handed back once the lists are settled.
  std::vector<Block*> ready;
  absl::Status status = CollectDone(stats, device_synced, ready);
  for (Block* block : ready) done(block);
  return status;
}

absl::Status StreamReclaim::CollectDone(PoolStats& stats, bool device_synced,
                                        std::vector<Block*>& ready) {
  auto finish = [&](const Pending& p) {
    --pending_count_;
    if (p.event == kFence) {
      --fences_;
    } else if (p.event != kDeferred) {
      spare_events_.push_back(p.event);
    }
    if (--p.block->pending_events == 0) ready.push_back(p.block);
  };
  // Fences complete only with a device synchronisation.
  if (device_synced) {
    for (const Pending& p : fenced_) finish(p);
    fenced_.clear();
  }
  // Frees deferred while their stream captured a graph: nothing to wait for while it still
  // captures (asked once per stream); once done, a device synchronisation since covers its
  // work, else each event is recorded now and queried with the stream's others.
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    if (Capturing(it->first, stats)) {
      ++it;
      continue;
    }
    const std::vector<Pending> entries = std::move(it->second);
    it = deferred_.erase(it);
    for (Pending p : entries) {
      if (device_synced) {
        finish(p);
        continue;
      }
      p.event = RecordDeferred(p.stream, stats);
      if (p.event == kDeferred) {  // the stream was synchronised instead
        finish(p);
      } else if (p.event == kFence) {
        fenced_.push_back(p);
      } else {
        queued_[p.stream].push_back(p);  // recorded after every event queued there
      }
    }
  }
  // Each stream's events, oldest first, up to the first not done: events on a stream
  // complete in the order they were recorded, so the rest are not queried. With thousands of
  // frees pending on a stream that runs behind (record_stream on a communication stream),
  // a pass over all of them cost each allocation 23 µs with 10,000.
  for (auto it = queued_.begin(); it != queued_.end();) {
    std::deque<Pending>& queue = it->second;
    while (!queue.empty()) {
      const Pending p = queue.front();
      absl::StatusOr<bool> complete = device_synced;
      if (!device_synced) {
        ++stats.driver_event;
        complete = driver_->EventDone(p.event);
      }
      if (!complete.ok() && absl::IsUnavailable(complete.status())) {
        // Recorded in a stream that was capturing a graph (it began capturing after the
        // check): the event belongs to the graph now, and is left to it (destroyed at
        // teardown); recorded anew later.
        LogWarningOnce("pending-capture", complete.status().message());
        captured_events_.push_back(p.event);
        queue.pop_front();
        deferred_[p.stream].push_back(Pending{kDeferred, p.block, p.stream});
        continue;
      }
      // On a failed query every entry not yet done stays pending, this one included.
      VMM_RETURN_IF_ERROR(complete.status());
      if (!*complete) break;
      queue.pop_front();
      finish(p);
    }
    if (queue.empty()) {
      it = queued_.erase(it);
    } else {
      ++it;
    }
  }
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
  absl::flat_hash_set<Stream> cached;  // every stream with cached blocks, the requester's too
  for (const Arena* arena : arenas) {
    arena->free_blocks().ForEachStream([&](Stream s) {
      if (!cached.insert(s).second) return;
      if (s != kAnyStream && StreamHandle(s) != StreamHandle(requester) &&
          !IsForeignStream(s)) {
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
    const bool keep = it->first == requester || cached.contains(it->first);
    if (!keep && !it->second.in_flight) {
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
  for (auto& [stream, queue] : queued_) {
    for (const Pending& p : queue) spare_events_.push_back(p.event);
  }
  queued_.clear();
  deferred_.clear();
  fenced_.clear();
  pending_count_ = 0;
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
