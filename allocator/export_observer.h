// export_observer.h: what a pool tells the sharing side about its exported chunks.
//
// A pool keeps the export invariant itself (pool.h) but knows nothing of handles, fds or
// descriptors. Whoever hands exported memory to other processes (ExportRegistry,
// export_registry.h) is the pool's observer, fixed when the pool is created, and is told when
// an exported chunk goes back to the driver, so that it can drop what it holds for that chunk
// (a cached handle, an fd) and nothing pins released memory.
//
// Locking: the pool calls its observer with the pool's lock held. An observer must not call
// back into any pool, and must take only locks of its own that it never holds while calling
// a pool (so the order is always pool, then observer).
#ifndef VMM_ALLOCATOR_EXPORT_OBSERVER_H_
#define VMM_ALLOCATOR_EXPORT_OBSERVER_H_

#include <cstdint>

namespace vmm {

class ExportObserver {
 public:
  virtual ~ExportObserver() = default;
  // ChunkReleased: the exported chunk `chunk_id` of pool `pool_id` was unmapped and released
  // (also when the pool is destroyed).
  virtual void ChunkReleased(uint64_t pool_id, uint64_t chunk_id) = 0;
  // ChunkRenamed: the exported chunk `old_id` of pool `pool_id` is reused under `new_id`
  // (pool.h, "Reusing exported chunks"): nothing may name it by `old_id` any more. By default
  // what was kept for it is dropped, as for a release.
  virtual void ChunkRenamed(uint64_t pool_id, uint64_t old_id, uint64_t new_id) {
    (void)new_id;
    ChunkReleased(pool_id, old_id);
  }
  // PoolDestroyed: pool `pool_id` is going away; every ChunkReleased call for it came before.
  virtual void PoolDestroyed(uint64_t pool_id) = 0;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_EXPORT_OBSERVER_H_
