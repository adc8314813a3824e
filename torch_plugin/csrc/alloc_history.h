// alloc_history.h: the allocation history PyTorch asks an allocator to keep
// (torch.cuda.memory._record_memory_history): a bounded trace of allocations and frees per
// device, the stack of each live block's allocation and of each growth of the pools, and the
// record_function annotations, for snapshots and the memory viewer.
// Used by vmm_cuda_allocator.cpp (built only against a CUDA build of torch 2.3+).
//
// The stacks come from PyTorch's own context recorder (it takes the GIL itself), called with no
// lock of this class held. The ranges vmm's pools map and unmap, and the segments a MemPool
// over another allocator asks that allocator for and hands back, come with a pool's lock held
// (RecordSegment: this class's lock only, no stack). Off, recording costs one relaxed atomic
// load (on()). Thread safe.
#ifndef VMM_TORCH_PLUGIN_CSRC_ALLOC_HISTORY_H_
#define VMM_TORCH_PLUGIN_CSRC_ALLOC_HISTORY_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>

namespace vmm_torch {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;

// Microseconds since the epoch: what PyTorch's snapshot reports as a trace entry's time_us.
inline time_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A trace entry with torch.compile's context and the user metadata, where this torch's
// TraceEntry carries them (else without them).
template <typename Entry = cda::TraceEntry>
Entry MakeTraceEntry(typename Entry::Action action, c10::DeviceIndex device, size_t addr,
                     size_t size, cudaStream_t stream, c10::cuda::MempoolId_t pool,
                     std::shared_ptr<c10::GatheredContext> context, const std::string& compile,
                     const std::string& metadata) {
  if constexpr (std::is_constructible_v<Entry, typename Entry::Action, c10::DeviceIndex, size_t,
                                        size_t, cudaStream_t, c10::cuda::MempoolId_t, int,
                                        std::shared_ptr<c10::GatheredContext>, std::string,
                                        std::string>) {
    return Entry(action, device, addr, size, stream, pool, /*time=*/0, std::move(context),
                 compile, metadata);
  } else {
    return Entry(action, device, addr, size, stream, pool, /*time=*/0, std::move(context));
  }
}

// The history PyTorch asks for with _record_memory_history: a bounded trace of allocations
// and frees per device, and the stack of each live block's allocation. Thread safe.
class History {
 public:
  // Whether anything is recorded (one relaxed load: the cost while off).
  bool on() const { return on_.load(std::memory_order_relaxed); }

  void Configure(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                 cca::RecordContext when, bool clear,
                 const std::vector<std::string>& skip_actions) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_ = enabled;
    recorder_ = enabled ? recorder : nullptr;
    when_ = enabled ? when : cca::RecordContext::NEVER;
    max_entries_ = std::max<size_t>(max_entries, 1);
    skip_.clear();
    for (const std::string& action : skip_actions) {
      skip_.insert(static_cast<int>(cda::parseTraceEntryAction(action)));
    }
    // The trace goes when recording stops or is cleared; the stacks of live blocks stay (a
    // snapshot taken later still shows where they were made, as PyTorch's blocks keep the
    // context they were given) until the blocks are freed (Forget), and so do those of the
    // growths (until their memory goes). The annotations go at every call, as PyTorch's.
    if (clear || !enabled) {
      traces_.clear();
      pushed_.clear();
    }
    unstacked_.clear();
    annotations_.clear();
    on_.store(enabled || !trackers_.empty(), std::memory_order_relaxed);
  }

  // torch.cuda.memory._set_memory_metadata / _get_memory_metadata: a string that every
  // trace entry of `device` carries from then on, as PyTorch's allocator keeps one per GPU.
  void SetUserMetadata(c10::DeviceIndex device, const std::string& metadata) {
    std::lock_guard<std::mutex> lock(mu_);
    notes_[device].user_metadata = metadata;
  }
  std::string UserMetadata(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = notes_.find(device);
    return it == notes_.end() ? std::string() : it->second.user_metadata;
  }
  // torch.compile's contexts while history is recorded: each trace entry of `device` carries
  // the innermost ("N/A" with none, as PyTorch writes it).
  void PushCompileContext(c10::DeviceIndex device, const std::string& context) {
    std::lock_guard<std::mutex> lock(mu_);
    if (enabled_) notes_[device].compile.push_back(context);
  }
  void PopCompileContext(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = notes_.find(device);
    if (enabled_ && it != notes_.end() && !it->second.compile.empty()) {
      it->second.compile.pop_back();
    }
  }

  // Whether any live block has a stack (one relaxed load): while recording is off, a free
  // asks this before Forget.
  bool holds_contexts() const { return holds_contexts_.load(std::memory_order_relaxed); }

  // A block at `addr` was freed while nothing was recorded: its stack goes.
  void Forget(size_t addr) {
    std::lock_guard<std::mutex> lock(mu_);
    if (contexts_.erase(addr) != 0) NoteContexts();
  }

  void AddTracker(cca::AllocatorTraceTracker tracker) {
    std::lock_guard<std::mutex> lock(mu_);
    trackers_.push_back(std::move(tracker));
    on_.store(true, std::memory_order_relaxed);
  }

  // A record_function region's START or END (`metadata`: {"name", ...}, {"stage", ...}), as
  // PyTorch's hooks give it to the allocator while history is recorded: kept, as many as the
  // trace's entries, for the snapshot's "external_annotations"; dropped at every Configure.
  struct Annotation {
    c10::DeviceIndex device;
    time_t time_us;
    std::vector<std::pair<std::string, std::string>> metadata;
  };
  void Annotate(c10::DeviceIndex device,
                const std::vector<std::pair<std::string, std::string>>& metadata) {
    Annotation annotation{device, NowMicros(), metadata};
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) return;
    annotations_.push_back(std::move(annotation));
    while (annotations_.size() > max_entries_) annotations_.pop_front();
  }
  std::vector<Annotation> Annotations() {
    std::lock_guard<std::mutex> lock(mu_);
    return {annotations_.begin(), annotations_.end()};
  }

  // Records `action` on `addr`/`size` (for OOM, `addr` is the GPU's free bytes). The
  // stack is gathered outside the lock (the recorder takes the GIL). `grew`: the allocation
  // made the pools grow; its stack is then also the one of the memory it mapped (GrowthOf).
  void Record(cda::TraceEntry::Action action, c10::DeviceIndex device, size_t addr,
              size_t size, cudaStream_t stream, c10::cuda::MempoolId_t pool,
              bool grew = false) {
    cca::CreateContextFn recorder = nullptr;
    cca::RecordContext when = cca::RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> lock(mu_);
      recorder = recorder_;
      when = when_;
    }
    const bool is_alloc = action == cda::TraceEntry::ALLOC;
    const bool wants_stack =
        recorder != nullptr &&
        ((is_alloc && when >= cca::RecordContext::STATE) ||
         (action == cda::TraceEntry::FREE_REQUESTED && when == cca::RecordContext::ALL) ||
         (action == cda::TraceEntry::OOM && when >= cca::RecordContext::ALLOC));
    std::shared_ptr<c10::GatheredContext> context = wants_stack ? recorder() : nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    if (auto mine = unstacked_.find(std::this_thread::get_id()); mine != unstacked_.end()) {
      // The mappings this thread's allocation made get its stack and stream, as PyTorch's
      // segment_map entries have the allocation's; any other action ends the wait, and so
      // does an allocation that mapped nothing (the mappings were another call's: a send's
      // block of its own, made in libvmm).
      if (is_alloc && grew) {
        for (const auto& [at, serial] : mine->second) {
          if (cda::TraceEntry* e = EntryOf(at, serial); e != nullptr) {
            e->context_ = when_ >= cca::RecordContext::ALLOC ? context : nullptr;
            if (e->action_ == cda::TraceEntry::SEGMENT_MAP) e->stream_ = stream;
          }
        }
      }
      unstacked_.erase(mine);
    }
    if (is_alloc && context != nullptr) contexts_[addr] = context;
    if (is_alloc && grew) NoteGrowth(addr, context);  // a growth without a stack: none shown
    if (action == cda::TraceEntry::FREE_COMPLETED) contexts_.erase(addr);
    NoteContexts();
    // The trace is kept while history is on, whatever `when` says of stacks (as PyTorch's
    // allocator does: context=None still records the events, without stacks).
    const bool traced = enabled_ && skip_.count(action) == 0;
    if (!traced && trackers_.empty()) return;
    const DeviceNotes& notes = notes_[device];
    cda::TraceEntry entry = MakeTraceEntry(
        action, device, addr, size, stream, pool,
        when_ >= cca::RecordContext::ALLOC ? context : nullptr,
        notes.compile.empty() ? "N/A" : notes.compile.back(), notes.user_metadata);
    entry.time_.t_ = NowMicros();
    for (const cca::AllocatorTraceTracker& tracker : trackers_) tracker(entry);
    if (traced) Push(device, std::move(entry));
  }

  // A segment entry, with the lock of the pool that made it held, so in the order the pools
  // made them: a range vmm's pools mapped or unmapped (SEGMENT_MAP / SEGMENT_UNMAP, told by
  // vmm_set_mapping_callback, as PyTorch's expandable segments record theirs), or a segment a
  // MemPool over another allocator got from it or gave back (SEGMENT_ALLOC / SEGMENT_FREE, as
  // PyTorch's allocator records its segments). Takes only this class's lock and gathers no
  // stack: a mapped or allocated segment gets the stack (and, for a mapping, the stream) of
  // the allocation that made it when this thread records that allocation (Record, `grew`).
  void RecordSegment(cda::TraceEntry::Action action, c10::DeviceIndex device, size_t addr,
                     size_t size, cudaStream_t stream, c10::cuda::MempoolId_t pool) {
    std::lock_guard<std::mutex> lock(mu_);
    const bool traced = enabled_ && skip_.count(static_cast<int>(action)) == 0;
    if (!traced && trackers_.empty()) return;
    // A segment handed back carries the stack of the allocation that got it (as PyTorch's,
    // where no stack of the call that frees it is gathered): the lowest growth in it.
    std::shared_ptr<c10::GatheredContext> context;
    if (action == cda::TraceEntry::SEGMENT_FREE && when_ >= cca::RecordContext::ALLOC) {
      auto growth = growths_.lower_bound(addr);
      if (growth != growths_.end() && growth->first - addr < size) {
        context = growth->second.context;
      }
    }
    const DeviceNotes& notes = notes_[device];
    cda::TraceEntry entry = MakeTraceEntry(
        action, device, addr, size, stream, pool, std::move(context),
        notes.compile.empty() ? "N/A" : notes.compile.back(), notes.user_metadata);
    entry.time_.t_ = NowMicros();
    for (const cca::AllocatorTraceTracker& tracker : trackers_) tracker(entry);
    if (!traced || device < 0) return;  // a negative device: in no device's trace (Push)
    ++segment_serial_;
    const uint64_t serial = Push(device, std::move(entry));
    if (action == cda::TraceEntry::SEGMENT_MAP || action == cda::TraceEntry::SEGMENT_ALLOC) {
      // A thread that maps without recording an allocation (a send's block of its own, made
      // in libvmm) keeps only the entries still in the trace.
      auto& mine = unstacked_[std::this_thread::get_id()];
      mine.erase(std::remove_if(mine.begin(), mine.end(),
                                [&](const std::pair<c10::DeviceIndex, uint64_t>& m) {
                                  return EntryOf(m.first, m.second) == nullptr;
                                }),
                 mine.end());
      mine.emplace_back(device, serial);
    }
  }

  // The stack of the live block at `addr`, or null.
  std::shared_ptr<c10::GatheredContext> ContextOf(size_t addr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(addr);
    return it == contexts_.end() ? nullptr : it->second;
  }

  // The stack of the growth recorded lowest in [begin, begin + size) (a snapshot segment:
  // where vmm maps memory in runs of chunks, the allocation that mapped the lowest part still
  // mapped), or null. Ranges here and below are compared by differences, not by their ends,
  // so that none near the top of the address space wraps.
  std::shared_ptr<c10::GatheredContext> GrowthOf(size_t begin, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = growths_.lower_bound(begin);
    return it == growths_.end() || it->first - begin >= size ? nullptr : it->second.context;
  }
  // The mark of the growths recorded so far (for KeepGrowthsIn), taken before the segments
  // it is given are read.
  uint64_t GrowthMark() {
    std::lock_guard<std::mutex> lock(mu_);
    return growth_serial_;
  }
  // Drops the growths up to `mark` outside every range of `kept` (address and size, sorted by
  // address: the segments of every pool, read after the mark), whose memory has gone back; a
  // growth recorded since may lie in a segment read before it, and stays. The ranges may
  // overlap (another allocator's segment may lie in vmm's memory): merged first.
  void KeepGrowthsIn(const std::vector<std::pair<size_t, size_t>>& kept, uint64_t mark) {
    std::vector<std::pair<size_t, size_t>> merged;  // begin, end (at most SIZE_MAX)
    for (const auto& [begin, size] : kept) {
      const size_t end = size > SIZE_MAX - begin ? SIZE_MAX : begin + size;
      if (!merged.empty() && begin <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, end);
      } else {
        merged.emplace_back(begin, end);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = growths_.begin(); it != growths_.end();) {
      auto range =
          std::upper_bound(merged.begin(), merged.end(), std::make_pair(it->first, SIZE_MAX));
      if (it->second.serial > mark ||
          (range != merged.begin() && it->first < std::prev(range)->second)) {
        ++it;
      } else {
        growth_order_.erase(it->second.serial);
        it = growths_.erase(it);
      }
    }
  }

  // The trace of each device (at least `devices` of them). `*segment_serial`, if given: how
  // many segment entries the trace had taken by then (SegmentSerial).
  std::vector<std::vector<cda::TraceEntry>> Traces(size_t devices,
                                                   uint64_t* segment_serial = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::vector<cda::TraceEntry>> out(std::max(devices, traces_.size()));
    for (size_t d = 0; d < traces_.size(); ++d) {
      out[d].assign(traces_[d].begin(), traces_[d].end());
    }
    if (segment_serial != nullptr) *segment_serial = segment_serial_;
    return out;
  }
  // How many segment entries (RecordSegment) the trace has taken: a snapshot reads it before
  // its segments, and again with the trace (Traces), to know whether the two agree.
  uint64_t SegmentSerial() {
    std::lock_guard<std::mutex> lock(mu_);
    return segment_serial_;
  }

 private:
  void NoteContexts() { holds_contexts_.store(!contexts_.empty(), std::memory_order_relaxed); }
  // Appends `entry` to `device`'s trace, dropping the oldest past max_entries_; returns its
  // serial on that device (EntryOf). An entry of no device (negative: none a trace is kept
  // for) is dropped, its serial one EntryOf never finds.
  uint64_t Push(c10::DeviceIndex device, cda::TraceEntry entry) {
    if (device < 0) return 0;
    if (static_cast<size_t>(device) >= traces_.size()) {
      traces_.resize(device + 1);
      pushed_.resize(device + 1);
    }
    std::deque<cda::TraceEntry>& trace = traces_[device];
    trace.push_back(std::move(entry));
    while (trace.size() > max_entries_) trace.pop_front();
    return pushed_[device]++;
  }
  // The entry of `device`'s trace Push gave `serial`, or null once it has been dropped.
  cda::TraceEntry* EntryOf(c10::DeviceIndex device, uint64_t serial) {
    if (static_cast<size_t>(device) >= traces_.size()) return nullptr;
    std::deque<cda::TraceEntry>& trace = traces_[device];
    const uint64_t first = pushed_[device] - trace.size();
    if (serial < first || serial >= pushed_[device]) return nullptr;
    return &trace[serial - first];
  }
  // Growths are dropped at snapshots once their memory has gone (KeepGrowthsIn) and, past
  // kMaxGrowths, oldest first, so that a program that records without snapshots keeps a
  // bounded number. Not the trace's length: a segment keeps its stack for its life, as
  // PyTorch's do, whatever the trace keeps (max_entries=1 with context="state").
  static constexpr size_t kMaxGrowths = 1 << 16;
  void NoteGrowth(size_t addr, std::shared_ptr<c10::GatheredContext> context) {
    auto [it, fresh] = growths_.try_emplace(addr);
    if (!fresh) growth_order_.erase(it->second.serial);
    it->second = Growth{std::move(context), ++growth_serial_};
    growth_order_.emplace(growth_serial_, addr);
    while (growths_.size() > kMaxGrowths) {
      growths_.erase(growth_order_.begin()->second);
      growth_order_.erase(growth_order_.begin());
    }
  }

  std::atomic<bool> on_{false};
  std::atomic<bool> holds_contexts_{false};  // !contexts_.empty()
  std::mutex mu_;
  bool enabled_ = false;  // _record_memory_history is on (the trace is kept)
  cca::CreateContextFn recorder_ = nullptr;
  cca::RecordContext when_ = cca::RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::unordered_set<int> skip_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::vector<std::deque<cda::TraceEntry>> traces_;
  std::vector<uint64_t> pushed_;  // entries ever pushed to each device's trace (Push)
  uint64_t segment_serial_ = 0;   // segment entries ever traced (SegmentSerial)
  // The SEGMENT_MAP and SEGMENT_ALLOC entries (device, serial) each thread traced since it
  // last recorded an action: its next ALLOC that grew gives them its stack (and a map its
  // stream; Record).
  std::unordered_map<std::thread::id, std::vector<std::pair<c10::DeviceIndex, uint64_t>>>
      unstacked_;
  std::unordered_map<size_t, std::shared_ptr<c10::GatheredContext>> contexts_;
  std::deque<Annotation> annotations_;
  struct Growth {
    std::shared_ptr<c10::GatheredContext> context;
    uint64_t serial = 0;  // its key in growth_order_
  };
  std::map<size_t, Growth> growths_;            // by the address of the block that grew
  std::map<uint64_t, size_t> growth_order_;     // growths_' keys by serial: oldest first
  uint64_t growth_serial_ = 0;
  struct DeviceNotes {
    std::string user_metadata;
    std::vector<std::string> compile;  // a stack
  };
  std::unordered_map<c10::DeviceIndex, DeviceNotes> notes_;
};

// Leaves out of `trace` the segment entries (segment_map, segment_unmap; segment_alloc,
// segment_free of a MemPool over another allocator) that PyTorch's memory
// viewer could not walk back past with the snapshot's blocks `blocks` (address, size; sorted
// by address, disjoint). The viewer starts from the snapshot's segments and blocks and walks
// the trace back: a block stays drawn until it meets an alloc entry at its address, and must
// lie in a segment all that time. A block whose allocation is not in the trace after the
// entries that map or unmap its memory (made before recording began; a send's block of its
// own, which libvmm makes; or an allocation whose thread has not recorded it yet, waiting for
// the GIL the snapshot's caller holds, as PyTorch records under its lock) would be drawn in
// no segment before those entries: they are left out, so its memory is older than the trace,
// as the block is.
template <typename Entry>
void KeepWhatTheViewerCanWalk(const std::vector<std::pair<size_t, size_t>>& blocks,
                              std::vector<Entry>* trace) {
  if (blocks.empty()) return;
  // The index of the last alloc entry at each block's address (-1: none).
  std::vector<int64_t> last_alloc(blocks.size(), -1);
  for (size_t i = 0; i < trace->size(); ++i) {
    const Entry& e = (*trace)[i];
    if (e.action_ != Entry::ALLOC) continue;
    auto b = std::lower_bound(blocks.begin(), blocks.end(), std::make_pair(e.addr_, size_t{0}));
    if (b != blocks.end() && b->first == e.addr_) {
      last_alloc[static_cast<size_t>(b - blocks.begin())] = static_cast<int64_t>(i);
    }
  }
  size_t kept = 0;
  for (size_t i = 0; i < trace->size(); ++i) {
    Entry& e = (*trace)[i];
    bool keep = true;
    if (e.action_ == Entry::SEGMENT_MAP || e.action_ == Entry::SEGMENT_UNMAP ||
        e.action_ == Entry::SEGMENT_ALLOC || e.action_ == Entry::SEGMENT_FREE) {
      // The blocks overlapping [addr_, addr_ + size_): from the last one starting at or
      // before addr_. Differences, not sums, so that no range near the top of the address
      // space wraps.
      auto b = std::upper_bound(blocks.begin(), blocks.end(),
                                std::make_pair(e.addr_, SIZE_MAX));
      if (b != blocks.begin()) --b;
      for (; keep && b != blocks.end() && (b->first < e.addr_ || b->first - e.addr_ < e.size_);
           ++b) {
        const bool overlaps = b->first > e.addr_ || b->second > e.addr_ - b->first;
        if (overlaps && last_alloc[static_cast<size_t>(b - blocks.begin())] <
                            static_cast<int64_t>(i)) {
          keep = false;
        }
      }
    }
    if (!keep) continue;
    if (kept != i) (*trace)[kept] = std::move(e);
    ++kept;
  }
  trace->erase(trace->begin() + static_cast<std::ptrdiff_t>(kept), trace->end());
}

// Whether this torch's snapshot carries record_function annotations (external_annotations)
// as the AnnotationEntry this file fills (a device and a time to construct it with, a time_
// whose t_ is the time in microseconds, a metadata_ map). Checked rather than assumed, as
// each allocator feature of this file: a torch whose entry differs builds without them.
template <typename Entry, typename = void>
struct FillableAnnotation : std::false_type {};
template <typename Entry>
struct FillableAnnotation<
    Entry, std::void_t<decltype(Entry(std::declval<c10::DeviceIndex>(), 0)),
                       decltype(std::declval<Entry&>().time_.t_ = time_t{}),
                       decltype(std::declval<Entry&>().metadata_[std::string()] = std::string())>>
    : std::true_type {};
template <typename Info, typename = void>
struct HasAnnotations : std::false_type {};
template <typename Info>
struct HasAnnotations<Info, std::void_t<decltype(std::declval<Info&>().external_annotations)>>
    : FillableAnnotation<
          typename decltype(std::declval<Info&>().external_annotations)::value_type> {};

// Adds `annotations` to the snapshot `out` as PyTorch's AnnotationEntry (device, time in
// microseconds since the epoch, as the trace's entries, and the metadata), where this torch's
// snapshot has them; elsewhere nothing.
template <typename Info>
void AddAnnotations(const std::vector<History::Annotation>& annotations, Info* out) {
  if constexpr (HasAnnotations<Info>::value) {
    using Entry = typename decltype(out->external_annotations)::value_type;
    for (const History::Annotation& a : annotations) {
      Entry entry(a.device, 0);
      for (const auto& [key, value] : a.metadata) entry.metadata_[key] = value;
      entry.time_.t_ = a.time_us;
      out->external_annotations.push_back(std::move(entry));
    }
  }
}

// Sets a snapshot segment's stack (its "frames"), where this torch's segments have one.
template <typename Segment, typename = void>
struct HasSegmentContext : std::false_type {};
template <typename Segment>
struct HasSegmentContext<Segment,
                         std::void_t<decltype(std::declval<Segment&>().context_when_allocated =
                                                  std::shared_ptr<c10::GatheredContext>())>>
    : std::true_type {};
template <typename Segment>
void SetSegmentContext(std::shared_ptr<c10::GatheredContext> context, Segment* segment) {
  if constexpr (HasSegmentContext<Segment>::value) {
    segment->context_when_allocated = std::move(context);
  }
}

// Gives each of `segments` (PyTorch's SegmentInfo: an address, a total_size and blocks
// tiling it, each with a size, whether it is active and a context_when_allocated) the stacks
// `history` holds, as PyTorch's snapshot carries them: the segment the stack of the lowest
// growth in it (its "frames", where this torch's segments have them), each active block its
// allocation's.
template <typename Segment>
void AddStacks(History& history, std::vector<Segment>* segments) {
  const bool blocks_have_stacks = history.holds_contexts();
  for (Segment& segment : *segments) {
    SetSegmentContext(history.GrowthOf(segment.address, segment.total_size),
                      &segment);
    if (!blocks_have_stacks) continue;
    size_t addr = segment.address;
    for (auto& block : segment.blocks) {
      if (block.active) block.context_when_allocated = history.ContextOf(addr);
      addr += block.size;
    }
  }
}

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_ALLOC_HISTORY_H_
