// fd_export_anchor.h: one process-wide workaround for the CUDA driver's fd-export set-up.
//
// The CUDA driver (580) sets POSIX-fd export up whenever no exported fd is open in the process
// and tears it down with the last one: exporting a chunk then costs 0.6-0.9 ms, against
// 45-80 us while another exported fd is open (bench/import_bench --keep_exported_fd). Without a
// workaround every share of a freshly allocated tensor would pay the set-up.
//
// FdExportAnchors keeps, per driver and device, one smallest allocation exported as an fd that
// stays open while at least one pool that exported fds on that device lives: Hold(pool) on a
// pool's first fd export, Drop(pool) when the pool is destroyed. So the cost is one granule
// (2 MiB on an H200) and one fd per device, not per pool, and it goes with the last such
// pool (the driver's free memory is back to its starting value once every pool is gone).
// The allocation is outside every pool's range and statistics. A failure to make it is logged
// and leaves exports working, only slower.
//
// Thread safe (its own mutex, a leaf: it calls only the driver). The mutex is held across
// fork() (fork_guard.h, ForkLevel::kExports). A forked child forgets its parent's anchors and
// closes its copies of their fds (a copy would keep the parent's granule on the GPU until the
// child exits); its own pools' exports make anchors of their own.
#ifndef VMM_ALLOCATOR_FD_EXPORT_ANCHOR_H_
#define VMM_ALLOCATOR_FD_EXPORT_ANCHOR_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "allocator/driver.h"
#include "allocator/fork_guard.h"
#include "allocator/mutex.h"

namespace vmm {

class FdExportAnchors {
 public:
  // Hold makes sure the anchor of (`driver`, `device`) exists and counts pool `pool_id` as
  // holding it (again for the same pool: no effect). `granularity`: that of the device.
  void Hold(uint64_t pool_id, Driver* driver, int device, size_t granularity);
  // Drop stops pool `pool_id` holding its anchor; the last holder's drop releases it.
  void Drop(uint64_t pool_id);
  // Anchors alive (tests).
  size_t size() const;

 private:
  using Key = std::pair<Driver*, int>;
  struct Anchor {
    PhysHandle handle = 0;  // 0: making it failed (not retried while held)
    ShareableHandle fd;
    int holders = 0;
  };

  mutable Mutex mu_;
  absl::flat_hash_map<Key, Anchor> anchors_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Key> holders_ ABSL_GUARDED_BY(mu_);
  static void ForgetInChild(FdExportAnchors& anchors);
  ForkRegistration fork_{
      ForkLevel::kExports,
      LockWithChild<FdExportAnchors, &FdExportAnchors::mu_, &ForgetInChild>(this)};  // last
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_EXPORT_ANCHOR_H_
