// The memory of a private pool whose allocator is not vmm's: torch.cuda.MemPool(allocator)
// over a CUDAPluggableAllocator (NCCL's ncclMemAlloc, vLLM's cuMem allocator, a program's
// own), while vmm is PyTorch's CUDA allocator.
//
// PyTorch's own allocator serves such a pool from segments it asks the MemPool's allocator
// for, splits them into blocks, caches the blocks when tensors die, and hands a segment back
// only when it frees its cache. A program written for that (it counts on its allocator being
// called per segment, not per tensor, and on its memory staying until empty_cache) must see
// the same with vmm, so ForeignSegments does the same, with PyTorch's sizes:
//   - requests up to 1 MiB are small: they share 2 MiB segments; larger ones get a 20 MiB
//     segment below 10 MiB, else the request rounded up to 2 MiB; blocks are 512-byte
//     multiples, split off a free block when what is left is at least 512 bytes (small) or
//     more than 1 MiB (large), merged with free neighbours when freed;
//   - with no_split (MemPool's no_split, NCCL's symmetric memory), each request is a segment
//     of its own, reused whole by a later request that fits it;
//   - a segment serves the stream it was asked for; a free block is reused at once by that
//     stream's allocations (stream order), and a block other streams used (record_stream) only
//     once events recorded on them at its free have completed;
//   - segments go back (Source::Release) only when they hold no allocated or pending block, at
//     ReleaseCached, after a device synchronisation.
// Failures: Allocate returns null when the source returns null even after the pool's own
// cached segments went back (the caller reports the out of memory); Free and RecordStream
// return false for a pointer the pool did not hand out. The Source is called with the pool's
// lock held: it must not call back into the pool.
//
// Thread safety: every member takes the pool's mutex. Pure C++ (no CUDA, no PyTorch): the
// plugin gives it a Source over the MemPool's allocator and CUDA events; tests give it host
// memory (tests/foreign_segments_test.cc).
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

namespace vmm_torch {

// Where a foreign pool's segments come from, and the events that order its frees.
class ForeignSource {
 public:
  virtual ~ForeignSource() = default;
  // A segment of `size` bytes for `stream`; null when out of memory.
  virtual void* Allocate(size_t size, uintptr_t stream) = 0;
  virtual void Release(void* segment) = 0;
  // An event after the work queued so far on `stream`.
  virtual uintptr_t RecordEvent(uintptr_t stream) = 0;
  virtual bool EventDone(uintptr_t event) = 0;
  virtual void DestroyEvent(uintptr_t event) = 0;
  // Waits for every stream of the device (before segments go back).
  virtual void SynchronizeDevice() = 0;
};

// PyTorch's statistic: current, peak, and the totals added and removed.
struct ForeignStat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void Add(int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void Sub(int64_t n) {
    current -= n;
    freed += n;
  }
};

// A pool's figures, by PyTorch's stat types: [0] all, [1] small pool, [2] large pool.
struct ForeignStats {
  std::array<ForeignStat, 3> allocation, segment, active, inactive_split;
  std::array<ForeignStat, 3> allocated_bytes, reserved_bytes, active_bytes,
      inactive_split_bytes, requested_bytes;
  int64_t num_device_alloc = 0, num_device_free = 0, num_alloc_retries = 0;
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

  ForeignSegments(std::unique_ptr<ForeignSource> source, bool no_split)
      : source_(std::move(source)), no_split_(no_split) {}
  ForeignSegments(const ForeignSegments&) = delete;
  ForeignSegments& operator=(const ForeignSegments&) = delete;
  // Segments still held are not handed back here (a pool is dropped only when it holds none;
  // the process's end reclaims the rest).
  ~ForeignSegments() {
    for (auto& [base, seg] : segments_) {
      for (Block* b = seg->head; b != nullptr;) {
        for (uintptr_t e : b->events) source_->DestroyEvent(e);
        Block* next = b->next;
        delete b;
        b = next;
      }
    }
  }

  void set_no_split(bool no_split) {
    std::lock_guard<std::mutex> lock(mu_);
    no_split_ = no_split;
  }

  // A block of at least `size` bytes (size > 0) on `stream`, or null (see the file comment).
  void* Allocate(size_t size, uintptr_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    CollectPendingLocked(/*wait=*/false);
    const bool small = size <= kSmallRequest;
    const size_t rounded = RoundUp(size, kMinBlock);
    Block* block = FindFreeLocked(rounded, stream, small);
    if (block == nullptr) {
      const size_t segment = no_split_ ? RoundUp(rounded, kMinBlock) : SegmentSize(rounded);
      void* base = source_->Allocate(segment, stream);
      if (base == nullptr && ReleaseCachedLocked() > 0) {
        ++stats_.num_alloc_retries;
        base = source_->Allocate(segment, stream);
      }
      if (base == nullptr) return nullptr;
      block = NewSegmentLocked(static_cast<char*>(base), segment, stream, small);
    }
    SplitLocked(block, rounded);
    block->allocated = true;
    block->requested = size;
    live_[block->ptr] = block;
    Count(block->seg->small, [&](int t) {
      stats_.allocation[t].Add(1);
      stats_.active[t].Add(1);
      stats_.allocated_bytes[t].Add(static_cast<int64_t>(block->size));
      stats_.active_bytes[t].Add(static_cast<int64_t>(block->size));
      stats_.requested_bytes[t].Add(static_cast<int64_t>(size));
    });
    return block->ptr;
  }

  // Frees a block this pool handed out: reusable at once by its stream, or once the events of
  // the other streams that used it complete. False if `ptr` is not one.
  bool Free(void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(static_cast<char*>(ptr));
    if (it == live_.end() || !it->second->allocated) return false;
    Block* block = it->second;
    block->allocated = false;
    Count(block->seg->small, [&](int t) {
      stats_.allocation[t].Sub(1);
      stats_.allocated_bytes[t].Sub(static_cast<int64_t>(block->size));
      stats_.requested_bytes[t].Sub(static_cast<int64_t>(block->requested));
    });
    for (uintptr_t s : block->uses) block->events.push_back(source_->RecordEvent(s));
    block->uses.clear();
    if (block->events.empty()) {
      live_.erase(it);
      FreeLocked(block);
    } else {
      ++pending_;  // stays in live_ until its events complete (CollectPendingLocked)
    }
    return true;
  }

  // Notes that `stream` uses allocated block `ptr` (torch.Tensor.record_stream); false if
  // `ptr` is not an allocated block of this pool.
  bool RecordStream(void* ptr, uintptr_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(static_cast<char*>(ptr));
    if (it == live_.end() || !it->second->allocated) return false;
    if (stream != it->second->seg->stream) it->second->uses.insert(stream);
    return true;
  }

  // Hands back every segment that holds no allocated block, after a device synchronisation
  // (pending blocks complete then); the number handed back.
  size_t ReleaseCached() {
    std::lock_guard<std::mutex> lock(mu_);
    return ReleaseCachedLocked();
  }

  // True when the pool holds no segment (it may be dropped).
  bool Empty() {
    std::lock_guard<std::mutex> lock(mu_);
    return segments_.empty();
  }

  ForeignStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void ResetPeaks() {
    std::lock_guard<std::mutex> lock(mu_);
    ForEachStat([](ForeignStat& s) { s.peak = s.current; });
  }

  void ResetAccumulated() {
    std::lock_guard<std::mutex> lock(mu_);
    ForEachStat([](ForeignStat& s) { s.allocated = s.freed = 0; });
    stats_.num_device_alloc = stats_.num_device_free = stats_.num_alloc_retries = 0;
  }

  std::vector<ForeignSegmentInfo> Snapshot() {
    std::lock_guard<std::mutex> lock(mu_);
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
    std::set<uintptr_t> uses;       // other streams, while allocated
    std::vector<uintptr_t> events;  // while pending (freed, other streams not done)
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

  template <typename F>
  void ForEachStat(F&& f) {
    for (auto* group : {&stats_.allocation, &stats_.segment, &stats_.active,
                        &stats_.inactive_split, &stats_.allocated_bytes, &stats_.reserved_bytes,
                        &stats_.active_bytes, &stats_.inactive_split_bytes,
                        &stats_.requested_bytes}) {
      for (ForeignStat& s : *group) f(s);
    }
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
    // Without splitting, a cached segment much larger than the request is left for a larger
    // one (PyTorch's allocator likewise keeps oversize blocks from small requests).
    if (no_split_ && block->size > std::max(2 * rounded, rounded + kRound)) return nullptr;
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
      stats_.segment[t].Add(1);
      stats_.reserved_bytes[t].Add(static_cast<int64_t>(size));
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
      stats_.active[t].Sub(1);
      stats_.active_bytes[t].Sub(static_cast<int64_t>(block->size));
    });
    for (Block* n : {block->prev, block->next}) {
      if (n == nullptr || n->allocated || !n->events.empty() || !IsFiled(n)) continue;
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
    Count(b->seg->small, [&](int t) {
      stats_.inactive_split[t].Add(1);
      stats_.inactive_split_bytes[t].Add(static_cast<int64_t>(b->size));
    });
  }

  void UnfileLocked(Block* b) {
    free_.erase(KeyOf(b));
    free_blocks_.erase(b->ptr);
    Count(b->seg->small, [&](int t) {
      stats_.inactive_split[t].Sub(1);
      stats_.inactive_split_bytes[t].Sub(static_cast<int64_t>(b->size));
    });
  }

  // Frees the pending blocks whose events are done (all of them after a synchronisation).
  void CollectPendingLocked(bool wait) {
    if (pending_ == 0 && !wait) return;
    for (auto it = live_.begin(); it != live_.end();) {
      Block* block = it->second;
      const bool done =
          !block->allocated && !block->events.empty() &&
          std::all_of(block->events.begin(), block->events.end(),
                      [&](uintptr_t e) { return wait || source_->EventDone(e); });
      if (!done) {
        ++it;
        continue;
      }
      for (uintptr_t e : block->events) source_->DestroyEvent(e);
      block->events.clear();
      it = live_.erase(it);
      FreeLocked(block);
    }
    pending_ = 0;
    for (const auto& [ptr, block] : live_) pending_ += block->allocated ? 0 : 1;
  }

  size_t ReleaseCachedLocked() {
    bool any = false;
    for (const auto& [base, seg] : segments_) any = any || IsWholeAndFree(seg.get());
    if (!any && pending_ == 0) return 0;
    source_->SynchronizeDevice();
    CollectPendingLocked(/*wait=*/true);
    size_t released = 0;
    for (auto it = segments_.begin(); it != segments_.end();) {
      Segment* seg = it->second.get();
      if (!IsWholeAndFree(seg)) {
        ++it;
        continue;
      }
      UnfileLocked(seg->head);
      delete seg->head;
      source_->Release(seg->base);
      ++stats_.num_device_free;
      Count(seg->small, [&](int t) {
        stats_.segment[t].Sub(1);
        stats_.reserved_bytes[t].Sub(static_cast<int64_t>(seg->size));
      });
      it = segments_.erase(it);
      ++released;
    }
    return released;
  }

  bool IsWholeAndFree(const Segment* seg) const {
    return seg->head->next == nullptr && IsFiled(seg->head);
  }

  std::mutex mu_;
  std::unique_ptr<ForeignSource> source_;
  bool no_split_;
  std::map<char*, std::unique_ptr<Segment>> segments_;
  std::unordered_map<char*, Block*> live_;         // allocated and pending blocks
  std::set<FreeKey> free_;                         // free blocks, best fit first
  std::unordered_map<char*, Block*> free_blocks_;  // the same, by address
  size_t pending_ = 0;  // freed blocks in live_ whose events may not be done
  ForeignStats stats_;
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_FOREIGN_SEGMENTS_H_
