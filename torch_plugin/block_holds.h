// block_holds.h: pool blocks held for sends, whose free waits for the last hold, and blocks
// moved for a send that has not gone yet.
//
//   holds.Moved(ptr, bytes);                // moved to a chunk of its own, to be sent
//   holds.Hold(ptr);                        // a send of the block at ptr (no longer "moved")
//   if (holds.DeferFree(ptr) != HeldFree::kNotHeld) return;  // later, at the last Release
//   if (holds.Release(ptr)) pool.Free(ptr); // the receiver acknowledged: free it now
//
// A block sent to another process must stay valid until the receiver has imported it, even
// when the sender frees its tensor at once (docs/DESIGN.md §4, send holds). A block moved for a
// send counts against the send budget (process_state.h) until it is sent or freed: a queue's
// feeder thread may lag behind Queue.put. The free path asks DeferFree only while any block is
// tracked (`any()`, one relaxed atomic load), so the cached path of the allocator pays nothing
// when none is. Thread safe (one mutex).
#ifndef VMM_TORCH_PLUGIN_BLOCK_HOLDS_H_
#define VMM_TORCH_PLUGIN_BLOCK_HOLDS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "allocator/fork_guard.h"
#include "allocator/mutex.h"

namespace vmm {

// What a free of a block does where sends may hold it (BlockHolds::DeferFree).
enum class HeldFree {
  kNotHeld,     // free it now
  kDeferred,    // held: freed at the last Release
  kFreedTwice,  // held, and its free already deferred: a double free, refused
};

class BlockHolds {
 public:
  // The live block at `ptr` (whole chunks of `bytes`) was moved for a send not made yet.
  void Moved(const void* ptr, uint64_t bytes);
  // Adds one hold on the live block at `ptr` (it is no longer counted as moved).
  void Hold(const void* ptr);
  // Whether `ptr` is held; if so, its free is deferred to the last Release (and the caller
  // must not free it now). A second free of a held block is kFreedTwice (the block cannot have
  // been handed out again meanwhile: it is still allocated). A block only moved is forgotten
  // (kNotHeld: free it).
  HeldFree DeferFree(const void* ptr);
  // Drops one hold. True when that was the last hold of a block freed meanwhile: the caller
  // frees it now. False for a block not held (nothing happens).
  bool Release(const void* ptr);
  // Whether any block is held or moved (a hint for the free path: racy by design, since a
  // block is tracked only while its owner keeps it alive).
  bool any() const { return tracked_.load(std::memory_order_relaxed) != 0; }
  // Blocks held now, and of those, blocks whose free is deferred.
  size_t held();
  size_t deferred();
  // Bytes of the blocks moved and not yet sent (nor freed).
  uint64_t moved_bytes() const { return moved_bytes_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    size_t holds = 0;
    uint64_t moved = 0;  // bytes, while moved and not yet sent
    bool freed = false;
  };
  // Removes the entry at `it`.
  void Forget(std::unordered_map<const void*, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  std::unordered_map<const void*, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> tracked_{0};  // entries_.size()
  std::atomic<uint64_t> moved_bytes_{0};
  // mu_ is held across fork() (allocator/fork_guard.h): a forked child frees through DeferFree.
  ForkRegistration fork_{ForkLevel::kProcessSends, ForkHandlers::Lock(&mu_)};
};

}  // namespace vmm

#endif  // VMM_TORCH_PLUGIN_BLOCK_HOLDS_H_
