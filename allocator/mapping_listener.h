// mapping_listener.h: who hears of each range a pool maps or unmaps.
//
// A tool's view of a pool's memory: PyTorch's allocation history records the ranges its
// allocator maps and unmaps ("segment_map" / "segment_unmap"), and its memory viewer rebuilds
// the segments of any moment from them. A pool with a listener (Pool::SetMappingListener)
// tells it of every range from then on, once the driver's calls for it succeeded:
//   - mapped: a growth's range (one call for the whole growth), a chunk moved there, a chunk
//     a failed growth could not unmap (it stays the pool's memory);
//   - unmapped: a chunk moved away, released (EmptyCache, trimming, a failed move that could
//     not map it back), or at the pool's teardown.
// So, from the moment it is set, the ranges mapped less those unmapped are what the pool
// holds: its reserved bytes (a test checks the sum).
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
