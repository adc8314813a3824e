// pool_closer.h: destroying a pool without disturbing a CUDA graph capture.
//
//   DestroyOutsideCapture(std::move(pool));  // now, or once no capture window is open
//   FlushPoolDestroys(absl::Seconds(5));     // waits for the deferred ones
//
// Destroying a pool synchronises its devices, then unmaps and releases its chunks and frees its
// address range. In CUDA's global capture mode (PyTorch's default) any of these, by any thread,
// invalidates a capture under way (capture_window.h). A pool's last use can end during a
// capture: a private pool (a CUDA graph's, a MemPool's) whose graph is deleted, or whose last
// block is freed, while another graph is captured. PyTorch's own allocator then keeps the
// pool's memory until a later empty_cache; vmm keeps the whole pool until the window closes.
//
// DestroyOutsideCapture destroys the pool on the calling thread when no window is open, as
// background work (a window that opens meanwhile waits for it to end). Otherwise it hands the
// pool to one thread per process (process_queue.h), which destroys it once no window is open
// (or the one open is stale, kStaleAfter). Failures: those of the pool's teardown, logged by
// it. If the thread cannot be started, the caller destroys the pool once the window closes.
// A fork waits for a destruction under way (process_queue.h kForkWaits), and a forked child
// never destroys what its parent queued. Thread safe.
#ifndef VMM_ALLOCATOR_POOL_CLOSER_H_
#define VMM_ALLOCATOR_POOL_CLOSER_H_

#include <cstddef>
#include <memory>

#include "absl/time/time.h"
#include "allocator/pool.h"

namespace vmm {

void DestroyOutsideCapture(std::unique_ptr<Pool> pool);
// Waits until every pool handed to the thread so far is destroyed, at most `timeout`; returns
// how many are still waiting or being destroyed.
size_t FlushPoolDestroys(absl::Duration timeout);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_POOL_CLOSER_H_
