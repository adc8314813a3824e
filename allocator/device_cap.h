// device_cap.h: what several pools of a device hold together: one cap on their physical
// bytes, and the joint figures whose peaks no pool can give alone.
//
// set_per_process_memory_fraction caps everything PyTorch's allocator holds on a device; with
// vmm registered, that is the device pool and the private pools (CUDA graph pools, MemPools)
// on that GPU (torch_plugin/process_state.h). Each such pool shares the DeviceCap of its GPU:
// its ChunkMap adds what it maps and subtracts what it releases, and Pool::Grow refuses a
// growth that would take the pools' sum past the limit (ResourceExhausted, after which the
// pool trims its own cache and retries, as for its own memory limit). Checked, not reserved:
// two pools growing at the same moment may pass the limit by one growth each. Segments of
// other allocators count against the limit too (AddExternal).
//
// PyTorch keeps one peak per device over all its pools; the sum of the pools' peaks is more
// wherever they peak at different times (a MemPool used after the default pool's tensors are
// gone). So each sharing pool also adds its allocated and mapped bytes to `allocated()` and
// `reserved()`, whose peaks are the GPU's (ProcessState::DeviceStats), and so do the pools
// over other allocators (a torch.cuda.MemPool over NCCL's): their segments through
// AddExternal, their blocks through AddExternalAllocated. Thread safe: atomics, no lock; a
// peak read while another thread updates may miss that update.
#ifndef VMM_ALLOCATOR_DEVICE_CAP_H_
#define VMM_ALLOCATOR_DEVICE_CAP_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vmm {

// A figure several pools update from their own threads: its current value and the highest
// since the last ResetPeak. The pools keep the cumulative totals themselves.
class JointStat {
 public:
  // Add's change of the current value and its read of the peak, and ResetPeak's store of the
  // peak and its read of the current value, are sequentially consistent: one of the two sees
  // the other's write (with relaxed order each may miss the other's, and the peak end below
  // the current value). On x86 they cost what relaxed ones do but the reset's store.
  void Add(int64_t delta) { Raise(current_.fetch_add(delta) + delta); }
  int64_t current() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void ResetPeak() {
    peak_.store(current());
    // An Add between the read and the store saw the old, higher peak and left it: the value it
    // made is current now, and the peak must cover it.
    Raise(current_.load());
  }

 private:
  void Raise(int64_t now) {
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }

  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

class DeviceCap {
 public:
  static constexpr size_t kNoLimit = SIZE_MAX;

  // The most bytes the sharing pools may hold together (kNoLimit, the default: none; 0: none
  // at all, as a memory fraction of 0 allows).
  void SetLimit(size_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  size_t limit() const { return limit_.load(std::memory_order_relaxed); }
  bool limited() const { return limit() != kNoLimit; }

  // Bytes mapped (`delta` > 0) or released (< 0) by one of the pools.
  void AddMapped(int64_t delta) { reserved_.Add(delta); }
  // Bytes another allocator's segments take (> 0) or give back (< 0): reserved too.
  void AddExternal(int64_t delta) { reserved_.Add(delta); }
  // Bytes of the blocks handed out (> 0) or taken back (< 0) in such segments: allocated.
  void AddExternalAllocated(int64_t delta) { allocated_.Add(delta); }
  // What the pools and other allocators hold together: the reserved bytes.
  int64_t held() const { return reserved_.current(); }

  // Whether `more` bytes fit under the limit now.
  bool Allows(size_t more) const {
    const size_t cap = limit();
    const int64_t held_now = held();
    const size_t held_bytes = static_cast<size_t>(held_now < 0 ? 0 : held_now);
    // Compared without the sum, which a large `more` would wrap.
    return cap == kNoLimit || (held_bytes <= cap && more <= cap - held_bytes);
  }

  // The GPU's reserved bytes (what the sharing pools map, and other allocators' segments)
  // and allocated bytes, with their joint peaks. Pools add to allocated() as they hand blocks
  // out and take them back.
  JointStat& allocated() { return allocated_; }
  const JointStat& allocated() const { return allocated_; }
  const JointStat& reserved() const { return reserved_; }
  // The reserved peak first: a block taken back and its segment released between the two
  // resets then leave the allocated peak at most the reserved one (the other order left the
  // allocated peak at the old high over a reserved peak of what was held after).
  void ResetPeaks() {
    reserved_.ResetPeak();
    allocated_.ResetPeak();
  }

 private:
  std::atomic<size_t> limit_{kNoLimit};
  JointStat reserved_;
  JointStat allocated_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_DEVICE_CAP_H_
