// The memory of a private pool whose allocator is not vmm's: torch.cuda.MemPool(allocator)
// over a CUDAPluggableAllocator (NCCL's ncclMemAlloc, vLLM's cuMem allocator, a program's
// own), while vmm is PyTorch's CUDA allocator.
//
// PyTorch's own allocator serves such a pool from segments it asks the MemPool's allocator
// for, splits them into blocks, caches the blocks when tensors die, and hands a segment back
// only when it frees its cache. A program written for that (it counts on its allocator being
// called per segment, not per tensor, and on its memory staying until empty_cache; NCCL
// registers the segments) must see the same with vmm, so ForeignSegments does the same, with
// PyTorch's sizes:
//   - requests up to 1 MiB are small: they share 2 MiB segments; larger ones get a 20 MiB
//     segment below 10 MiB, else the request rounded up to 2 MiB; blocks are 512-byte
//     multiples, split off a free block when what is left is at least 512 bytes (small) or
//     more than 1 MiB (large), merged with free neighbours when freed;
//   - with no_split (MemPool's no_split, NCCL's symmetric memory) the segments are the same
//     but never split: a block is a whole segment, reused by any request it fits;
//   - a segment serves the stream it was asked for; a free block is reused at once by that
//     stream's allocations (stream order), and a block other streams used (record_stream) only
//     once events recorded on them at its free have completed; an event that cannot be
//     recorded yet (its stream captures a CUDA graph) is recorded at a later call, and its
//     block waits until then;
//   - an allocation the source cannot serve fails (null) without handing anything back: the
//     pool is in use, and PyTorch's allocator frees no cache while a pool is routed to;
//   - segments go back (Source::Release) only at ReleaseCached, after a device
//     synchronisation, and only those that hold no allocated or pending block.
// Failures: Allocate returns null when the source returns null (counted in num_ooms; the
// caller reports the out of memory); Free and RecordStream return false for a pointer the
// pool did not hand out; a failed device synchronisation frees no pending block. The Source is
// called with the pool's lock held, which is recursive (as PyTorch's allocator's): its
// allocator may call back into the pool (a Python allocator that frees or allocates tensors);
// segments leave the pool before they are handed back.
//
// Thread safety: every member takes the pool's mutex. Pure C++ (no CUDA, no PyTorch): the
// plugin gives it a Source over the MemPool's allocator and CUDA events (foreign_source.h);
// tests give it host memory (tests/foreign_segments_test.cc).
#ifndef VMM_TORCH_PLUGIN_CSRC_FOREIGN_SEGMENTS_H_
#define VMM_TORCH_PLUGIN_CSRC_FOREIGN_SEGMENTS_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator/stat.h"

namespace vmm_torch {

// Where a foreign pool's segments come from, and the events that order its frees.
class ForeignSource {
 public:
  virtual ~ForeignSource() = default;
  // A segment of `size` bytes for `stream`; null when out of memory.
  virtual void* Allocate(size_t size, uintptr_t stream) = 0;
  // Gives back a segment Allocate returned, of the `size` and for the `stream` it was asked
  // for.
  virtual void Release(void* segment, size_t size, uintptr_t stream) = 0;
  // An event after the work queued so far on `stream`; 0 if it cannot be recorded now (the
  // stream captures a CUDA graph), to be asked again later.
  virtual uintptr_t RecordEvent(uintptr_t stream) = 0;
  virtual bool EventDone(uintptr_t event) = 0;
  virtual void DestroyEvent(uintptr_t event) = 0;
  // Waits for every stream of the device (before segments go back); false if it failed.
  virtual bool SynchronizeDevice() = 0;
  // Told, with the pool's lock held, each change of the bytes of its allocated blocks (a
  // block's size as it is handed out, minus it as it is freed): the GPU's joint allocated
  // figure, whose peak is max_memory_allocated (vmm_device_hold_allocated). By default nothing.
  virtual void CountAllocated(int64_t /*delta*/) {}
};

// PyTorch's statistic: current, peak, and the totals added and removed (the pool's own).
using ForeignStat = vmm::Stat;

// A pool's figures, by PyTorch's stat types: [0] all, [1] small pool, [2] large pool.
struct ForeignStats {
  using Group = std::array<ForeignStat, 3>;
  Group allocation, segment, active, inactive_split;
  Group allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  int64_t num_device_alloc = 0, num_device_free = 0, num_ooms = 0;

  // The groups, in the order of PyTorch's DeviceStats (a caller pairs them by index).
  static constexpr Group ForeignStats::*kGroups[] = {
      &ForeignStats::allocation,      &ForeignStats::segment,
      &ForeignStats::active,          &ForeignStats::inactive_split,
      &ForeignStats::allocated_bytes, &ForeignStats::reserved_bytes,
      &ForeignStats::active_bytes,    &ForeignStats::inactive_split_bytes,
      &ForeignStats::requested_bytes};

  template <typename F>
  void ForEachGroup(F&& f) {
    for (Group ForeignStats::*g : kGroups) f(this->*g);
  }
};

struct ForeignBlockInfo {
  size_t size = 0, requested = 0;
  bool allocated = false, active = false;  // active: allocated, or freed and pending
};
struct ForeignSegmentInfo {
  uintptr_t address = 0, stream = 0;
  size_t size = 0;
  bool small = false;
  std::vector<ForeignBlockInfo> blocks;  // in address order
};

class ForeignSegments {
 public:
  static constexpr size_t kSmallRequest = size_t{1} << 20;  // 1 MiB
  static constexpr size_t kSmallSegment = size_t{2} << 20;
  static constexpr size_t kMidSegment = size_t{20} << 20;
  static constexpr size_t kMidRequest = size_t{10} << 20;
  static constexpr size_t kRound = size_t{2} << 20;
  static constexpr size_t kMinBlock = 512;
  // The largest request served: past it the rounding to kRound would wrap around (a segment of
  // 0 bytes, a block smaller than asked). No GPU holds 2^63 bytes.
  static constexpr size_t kMaxRequest = ~size_t{0} >> 1;

  ForeignSegments(std::unique_ptr<ForeignSource> source, bool no_split)
      : source_(std::move(source)), no_split_(no_split) {}
  ForeignSegments(const ForeignSegments&) = delete;
  ForeignSegments& operator=(const ForeignSegments&) = delete;
  // Segments still held are not handed back here (a pool is dropped only when it holds none;
  // the process's end reclaims the rest).
  ~ForeignSegments() {
    for (auto& [base, seg] : segments_) {
      for (Block* b = seg->head; b != nullptr;) {
        for (const auto& [stream, event] : b->events) {
          if (event != 0) source_->DestroyEvent(event);
        }
        Block* next = b->next;
        delete b;
        b = next;
      }
    }
  }

  void set_no_split(bool no_split) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    no_split_ = no_split;
  }

  // A block of at least `size` bytes (size > 0) on `stream`, or null (see the file comment).
  // With `may_grow` false only a cached block serves (PyTorch's last resort of use_on_oom).
  // A size past kMaxRequest is out of memory (null, counted in num_ooms), the source not asked.
  void* Allocate(size_t size, uintptr_t stream, bool may_grow = true) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (size > kMaxRequest) {
      ++stats_.num_ooms;
      return nullptr;
    }
    CollectPendingLocked();
    const bool small = size <= kSmallRequest;
    const size_t rounded = RoundUp(size, kMinBlock);
    Block* block = FindFreeLocked(rounded, stream, small);
    if (block == nullptr) {
      if (!may_grow) return nullptr;
      const size_t segment = SegmentSize(rounded);
      void* base = source_->Allocate(segment, stream);
      if (base == nullptr) {
        ++stats_.num_ooms;
        return nullptr;
      }
      block = NewSegmentLocked(static_cast<char*>(base), segment, stream, small);
    }
    SplitLocked(block, rounded);
    block->allocated = true;
    block->requested = size;
    live_[block->ptr] = block;
    Count(block->seg->small, [&](int t) {
      stats_.allocation[t].Increase(1);
      stats_.active[t].Increase(1);
      stats_.allocated_bytes[t].Increase(static_cast<int64_t>(block->size));
      stats_.active_bytes[t].Increase(static_cast<int64_t>(block->size));
      stats_.requested_bytes[t].Increase(static_cast<int64_t>(size));
    });
    source_->CountAllocated(static_cast<int64_t>(block->size));
    return block->ptr;
  }

  // Frees a block this pool handed out: reusable at once by its stream, or once the events of
  // the other streams that used it complete. False if `ptr` is not one.
  bool Free(void* ptr) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto it = live_.find(static_cast<char*>(ptr));
    if (it == live_.end() || !it->second->allocated) return false;
    Block* block = it->second;
    block->allocated = false;
    Count(block->seg->small, [&](int t) {
      stats_.allocation[t].Decrease(1);
      stats_.allocated_bytes[t].Decrease(static_cast<int64_t>(block->size));
      stats_.requested_bytes[t].Decrease(static_cast<int64_t>(block->requested));
    });
    source_->CountAllocated(-static_cast<int64_t>(block->size));
    for (uintptr_t s : block->uses) block->events.emplace_back(s, source_->RecordEvent(s));
    block->uses.clear();
    if (block->events.empty()) {
      live_.erase(it);
      FreeLocked(block);
    } else {
      pending_.push_back(block);  // stays in live_ until its events complete
    }
    return true;
  }

  // The size the pool counts allocated block `ptr` at (its request rounded to 512 bytes, or
  // the whole of a segment it was not split off); 0 if `ptr` is not one.
  size_t AllocatedSize(void* ptr) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto it = live_.find(static_cast<char*>(ptr));
    return it == live_.end() || !it->second->allocated ? 0 : it->second->size;
  }

  // Notes that `stream` uses allocated block `ptr` (torch.Tensor.record_stream); false if
  // `ptr` is not an allocated block of this pool.
  bool RecordStream(void* ptr, uintptr_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto it = live_.find(static_cast<char*>(ptr));
    if (it == live_.end() || !it->second->allocated) return false;
    if (stream != it->second->seg->stream) it->second->uses.insert(stream);
    return true;
  }

  // Hands back every segment that holds no allocated or pending block, after a device
  // synchronisation (which completes the pending blocks whose events ran on this GPU); the number
  // handed back.
  size_t ReleaseCached() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    bool any = !pending_.empty();
    for (const auto& [base, seg] : segments_) any = any || IsWholeAndFree(seg.get());
    if (!any) return 0;
    CollectPendingLocked();  // records events deferred by a capture
    if (!source_->SynchronizeDevice()) return 0;  // nothing is known complete
    CollectPendingLocked();
    // Every segment to go leaves the pool before the source is called: its allocator may
    // call back into the pool (allocate, free, or release again) and must find none of them.
    std::vector<std::tuple<char*, size_t, uintptr_t>> going;
    for (auto it = segments_.begin(); it != segments_.end();) {
      Segment* seg = it->second.get();
      if (!IsWholeAndFree(seg)) {
        ++it;
        continue;
      }
      going.emplace_back(seg->base, seg->size, seg->stream);
      UnfileLocked(seg->head);
      delete seg->head;
      ++stats_.num_device_free;
      Count(seg->small, [&](int t) {
        stats_.segment[t].Decrease(1);
        stats_.reserved_bytes[t].Decrease(static_cast<int64_t>(seg->size));
      });
      it = segments_.erase(it);
    }
    for (const auto& [base, size, stream] : going) source_->Release(base, size, stream);
    return going.size();
  }

  // True when the pool holds no segment (it may be dropped).
  bool Empty() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return segments_.empty();
  }

  // The pool's figures. inactive_split(_bytes), as PyTorch counts them, are the free blocks
  // that are part of a split segment (not a whole cached segment); their peaks are the
  // largest seen by these calls.
  ForeignStats Stats() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    for (int t = 0; t < 3; ++t) {
      stats_.inactive_split[t].current = 0;
      stats_.inactive_split_bytes[t].current = 0;
    }
    for (const auto& entry : free_blocks_) {
      const Block* b = entry.second;
      if (b->prev == nullptr && b->next == nullptr) continue;
      Count(b->seg->small, [&](int t) {
        ++stats_.inactive_split[t].current;
        stats_.inactive_split_bytes[t].current += static_cast<int64_t>(b->size);
      });
    }
    for (int t = 0; t < 3; ++t) {
      for (ForeignStat* s : {&stats_.inactive_split[t], &stats_.inactive_split_bytes[t]}) {
        s->peak = std::max(s->peak, s->current);
      }
    }
    return stats_;
  }

  void ResetPeaks() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    stats_.ForEachGroup([](ForeignStats::Group& g) {
      for (ForeignStat& s : g) s.peak = s.current;
    });
  }

  void ResetAccumulated() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    stats_.ForEachGroup([](ForeignStats::Group& g) {
      for (ForeignStat& s : g) s.allocated = s.freed = 0;
    });
    stats_.num_device_alloc = stats_.num_device_free = stats_.num_ooms = 0;
  }

  std::vector<ForeignSegmentInfo> Snapshot() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    std::vector<ForeignSegmentInfo> out;
    for (const auto& [base, seg] : segments_) {
      ForeignSegmentInfo info;
      info.address = reinterpret_cast<uintptr_t>(base);
      info.stream = seg->stream;
      info.size = seg->size;
      info.small = seg->small;
      for (const Block* b = seg->head; b != nullptr; b = b->next) {
        ForeignBlockInfo block;
        block.size = b->size;
        block.requested = b->allocated ? b->requested : 0;
        block.allocated = b->allocated;
        block.active = b->allocated || !b->events.empty();
        info.blocks.push_back(block);
      }
      out.push_back(std::move(info));
    }
    return out;
  }

  static size_t SegmentSize(size_t rounded) {
    if (rounded <= kSmallRequest) return kSmallSegment;
    if (rounded < kMidRequest) return kMidSegment;
    return RoundUp(rounded, kRound);
  }

 private:
  struct Segment;
  struct Block {
    char* ptr = nullptr;
    size_t size = 0, requested = 0;
    bool allocated = false;
    Segment* seg = nullptr;
    Block* prev = nullptr;  // neighbours in the segment, by address
    Block* next = nullptr;
    std::set<uintptr_t> uses;  // other streams, while allocated
    // While pending (freed, other streams maybe not done): {stream, event} (event 0: not
    // recorded yet).
    std::vector<std::pair<uintptr_t, uintptr_t>> events;
  };
  struct Segment {
    char* base = nullptr;
    size_t size = 0;
    uintptr_t stream = 0;
    bool small = false;
    Block* head = nullptr;
  };
  // Free blocks, best fit first: (small, stream, size, address).
  using FreeKey = std::tuple<bool, uintptr_t, size_t, char*>;

  static size_t RoundUp(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

  template <typename F>
  static void Count(bool small, F&& f) {
    f(0);
    f(small ? 1 : 2);
  }

  static FreeKey KeyOf(const Block* b) {
    return FreeKey{b->seg->small, b->seg->stream, b->size, b->ptr};
  }

  Block* FindFreeLocked(size_t rounded, uintptr_t stream, bool small) {
    auto it = free_.lower_bound(FreeKey{small, stream, rounded, nullptr});
    if (it == free_.end() || std::get<0>(*it) != small || std::get<1>(*it) != stream) {
      return nullptr;
    }
    Block* block = free_blocks_.at(std::get<3>(*it));
    UnfileLocked(block);
    return block;
  }

  Block* NewSegmentLocked(char* base, size_t size, uintptr_t stream, bool small) {
    auto seg = std::make_unique<Segment>();
    seg->base = base;
    seg->size = size;
    seg->stream = stream;
    seg->small = small;
    auto block = std::make_unique<Block>();
    block->ptr = base;
    block->size = size;
    block->seg = seg.get();
    seg->head = block.get();
    Block* out = block.release();
    segments_[base] = std::move(seg);
    ++stats_.num_device_alloc;
    Count(small, [&](int t) {
      stats_.segment[t].Increase(1);
      stats_.reserved_bytes[t].Increase(static_cast<int64_t>(size));
    });
    return out;
  }

  // Cuts `block` (not filed) to `rounded` bytes, filing the rest when it is worth a block.
  void SplitLocked(Block* block, size_t rounded) {
    const size_t rest = block->size - rounded;
    const bool split =
        !no_split_ && (block->seg->small ? rest >= kMinBlock : rest > kSmallRequest);
    if (!split) return;
    auto tail = std::make_unique<Block>();
    tail->ptr = block->ptr + rounded;
    tail->size = rest;
    tail->seg = block->seg;
    tail->prev = block;
    tail->next = block->next;
    if (block->next != nullptr) block->next->prev = tail.get();
    block->next = tail.get();
    block->size = rounded;
    FileLocked(tail.release());
  }

  // A block no longer in use: merged with its free neighbours and filed.
  void FreeLocked(Block* block) {
    Count(block->seg->small, [&](int t) {
      stats_.active[t].Decrease(1);
      stats_.active_bytes[t].Decrease(static_cast<int64_t>(block->size));
    });
    for (Block* n : {block->prev, block->next}) {
      if (n == nullptr || !IsFiled(n)) continue;  // filed: free, not pending
      UnfileLocked(n);
      if (n == block->prev) {
        n->size += block->size;
        n->next = block->next;
        if (block->next != nullptr) block->next->prev = n;
        delete block;
        block = n;
      } else {
        block->size += n->size;
        block->next = n->next;
        if (n->next != nullptr) n->next->prev = block;
        delete n;
      }
    }
    FileLocked(block);
  }

  bool IsFiled(const Block* b) const { return free_blocks_.count(b->ptr) != 0; }

  void FileLocked(Block* b) {
    free_.insert(KeyOf(b));
    free_blocks_[b->ptr] = b;
  }

  void UnfileLocked(Block* b) {
    free_.erase(KeyOf(b));
    free_blocks_.erase(b->ptr);
  }

  // Records the events a capture deferred, and frees the pending blocks whose events are all
  // recorded and done (queried also after a device synchronisation: another GPU may run them).
  void CollectPendingLocked() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      Block* block = *it;
      bool done = true;
      for (auto& [stream, event] : block->events) {
        if (event == 0) event = source_->RecordEvent(stream);
        // After a device synchronisation too: an event on another GPU's stream (a
        // record_stream there) may still run.
        done = done && event != 0 && source_->EventDone(event);
      }
      if (!done) {
        ++it;
        continue;
      }
      for (const auto& [stream, event] : block->events) source_->DestroyEvent(event);
      block->events.clear();
      live_.erase(block->ptr);
      it = pending_.erase(it);
      FreeLocked(block);
    }
  }

  bool IsWholeAndFree(const Segment* seg) const {
    return seg->head->next == nullptr && IsFiled(seg->head);
  }

  // Recursive, as PyTorch's allocator's: the source's allocator may free or allocate tensors
  // of this pool, or release its cache, while it is called (the lock held).
  std::recursive_mutex mu_;
  std::unique_ptr<ForeignSource> source_;
  bool no_split_;
  std::map<char*, std::unique_ptr<Segment>> segments_;
  std::unordered_map<char*, Block*> live_;         // allocated and pending blocks
  std::vector<Block*> pending_;                    // freed blocks waiting for their events
  std::set<FreeKey> free_;                         // free blocks, best fit first
  std::unordered_map<char*, Block*> free_blocks_;  // the same, by address
  ForeignStats stats_;
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_FOREIGN_SEGMENTS_H_
