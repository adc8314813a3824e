// block_holds.h: pool blocks held for sends, whose free waits for the last hold.
//
//   holds.Hold(ptr);                        // a send of the block at ptr
//   if (holds.DeferFree(ptr)) return;       // the owner frees it: later, at the last Release
//   if (holds.Release(ptr)) pool.Free(ptr); // the receiver acknowledged: free it now
//
// A block sent to another process must stay valid until the receiver has imported it, even
// when the sender frees its tensor at once (docs/DESIGN.md §4, send holds). The free path asks
// DeferFree only while any block is held (`any()`, one relaxed atomic load), so the cached
// path of the allocator pays nothing when nothing is held. Thread safe (one mutex).
#ifndef VMM_TORCH_PLUGIN_BLOCK_HOLDS_H_
#define VMM_TORCH_PLUGIN_BLOCK_HOLDS_H_

#include <atomic>
#include <cstddef>
#include <unordered_map>

#include "allocator/mutex.h"

namespace vmm {

class BlockHolds {
 public:
  // Adds one hold on the live block at `ptr`.
  void Hold(const void* ptr);
  // Whether `ptr` is held; if so, its free is deferred to the last Release (and the caller
  // must not free it now). A second free of a held block is also absorbed here.
  bool DeferFree(const void* ptr);
  // Drops one hold. True when that was the last hold of a block freed meanwhile: the caller
  // frees it now. False for a block not held (nothing happens).
  bool Release(const void* ptr);
  // Whether any block is held (a hint for the free path: racy by design, since a block is
  // held only while its owner keeps it alive).
  bool any() const { return held_.load(std::memory_order_relaxed) != 0; }
  // Blocks held now, and of those, blocks whose free is deferred.
  size_t held();
  size_t deferred();

 private:
  struct Entry {
    size_t holds = 0;
    bool freed = false;
  };
  Mutex mu_;
  std::unordered_map<const void*, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> held_{0};
};

}  // namespace vmm

#endif  // VMM_TORCH_PLUGIN_BLOCK_HOLDS_H_
