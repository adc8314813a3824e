// Which MemPool over another allocator (foreign_segments.h) holds an address: the segments of
// every such pool, by address, so that a free or a record_stream of vmm's own memory (the
// common case) learns in one look that no such pool gave it, without taking the pools' locks.
//
// Each entry keeps its pool alive (`keep`) while it is looked up, so that a pool dropped by
// another thread meanwhile is not used after its end; the caller then asks the pool itself,
// with no lock of the index held (a pool's lock is held while its source adds and removes
// entries: holding both the other way round would deadlock). Failures: none; an address in
// no segment gives no owner. Thread safe; Empty is one relaxed atomic load.
#ifndef VMM_TORCH_PLUGIN_CSRC_FOREIGN_INDEX_H_
#define VMM_TORCH_PLUGIN_CSRC_FOREIGN_INDEX_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace vmm_torch {

class ForeignSegments;

class ForeignIndex {
 public:
  struct Owner {
    ForeignSegments* pool = nullptr;
    std::shared_ptr<void> keep;  // holds the pool while the caller uses it
  };

  // A segment [base, base + size) of `owner`.
  void Add(const void* base, size_t size, Owner owner) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    segments_[reinterpret_cast<uintptr_t>(base)] = Entry{size, std::move(owner)};
    count_.store(segments_.size(), std::memory_order_relaxed);
  }

  void Remove(const void* base) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    segments_.erase(reinterpret_cast<uintptr_t>(base));
    count_.store(segments_.size(), std::memory_order_relaxed);
  }

  bool Empty() const { return count_.load(std::memory_order_relaxed) == 0; }

  // The pool whose segment holds `ptr` (pool null if none).
  Owner Find(const void* ptr) const { return FindSegment(ptr).owner; }

  // The segment that holds `ptr`: its start (null if none) and its pool.
  struct Segment {
    const void* base = nullptr;
    Owner owner;
  };
  Segment FindSegment(const void* ptr) const {
    if (Empty()) return {};
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = segments_.upper_bound(address);
    if (it == segments_.begin()) return {};
    --it;
    if (address - it->first >= it->second.size) return {};
    return Segment{reinterpret_cast<const void*>(it->first), it->second.owner};
  }

 private:
  struct Entry {
    size_t size = 0;
    Owner owner;
  };

  mutable std::shared_mutex mu_;
  std::map<uintptr_t, Entry> segments_;  // by base address
  std::atomic<size_t> count_{0};         // segments_.size()
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_FOREIGN_INDEX_H_
