// mapping_listener.h: who hears of each chunk a pool maps or unmaps.
//
// A tool's view of a pool's memory: PyTorch's allocation history records the ranges its
// allocator maps and unmaps ("segment_map" / "segment_unmap"), and its memory viewer rebuilds
// the segments of any moment from them. A pool with a listener (Pool::SetMappingListener)
// tells it of every chunk from then on, one call per chunk, once the driver's calls for it
// succeeded:
//   - mapped: each chunk of a growth, a chunk moved there, a chunk a failed growth could not
//     unmap (it stays the pool's memory);
//   - unmapped: a chunk moved away, released (EmptyCache, trimming, a failed move that could
//     not map it back), at the pool's teardown, or every chunk at once where the pool leaves
//     the listener's view (DetachMappingListener: it is about to go).
// So, from the moment it is set, the chunks mapped less those unmapped are the pool's chunks
// (a test checks them after every step of a randomized run with failures), and a chunk told
// unmapped is always one told mapped, whole. Two error paths keep a chunk the pool cannot
// unmap: one whose access cannot be granted stays told mapped where the pool's snapshot has
// a gap; one whose unmap fails at teardown is never told unmapped.
//
// Locking: the pool calls its listener with the pool's lock held, as its ExportObserver
// (export_observer.h): a listener must not call back into any pool, and must take only locks
// of its own that it never holds while calling a pool.
#ifndef VMM_ALLOCATOR_MAPPING_LISTENER_H_
#define VMM_ALLOCATOR_MAPPING_LISTENER_H_

#include <cstddef>
#include <cstdint>

namespace vmm {

// Which pool a range is of, as the one who set the listener named it.
struct MappingSource {
  int device = 0;
  uint64_t owner[2] = {0, 0};  // the caller's name for the pool (the C interface: a private
                               // pool's MempoolId; {0, 0} for a device pool)
};

class MappingListener {
 public:
  virtual ~MappingListener() = default;
  // [addr, addr + size) of the pool `source` names was mapped (`mapped`) or unmapped.
  virtual void RangeMapped(const MappingSource& source, uintptr_t addr, size_t size,
                           bool mapped) = 0;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_MAPPING_LISTENER_H_
