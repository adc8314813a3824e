// host_driver.h: the host backend of the driver interface (driver.h), for machines without
// a GPU and for CI.
//
// It keeps the CUDA backend's contract on the CPU: a physical allocation is a memfd file, a
// reserved range is a PROT_NONE mapping, Map is mmap(MAP_FIXED|MAP_SHARED) of the file and
// SetAccess is mprotect. Export gives a duplicated fd (kPosixFd) or a 64-byte handle that is
// plain bytes (kFabric) which another process of the same user imports by opening the
// exporter's fd through /proc; the handle names the file's inode and a random tag kept in the
// memfd's name, so a stale or forged handle is refused cleanly. Streams are worker threads
// that run their queued work in order; events complete when their stream reaches them, so
// stream-ordering logic is tested for real. Device 0 is the only device.
//
// Out of memory is simulated by a capacity: Create() past it returns ResourceExhausted, and
// GetMemInfo() reports capacity minus the bytes of live physical allocations.
#ifndef VMM_ALLOCATOR_HOST_DRIVER_H_
#define VMM_ALLOCATOR_HOST_DRIVER_H_

#include <cstddef>
#include <memory>

#include "allocator/driver.h"

namespace vmm {

struct HostDriverOptions {
  size_t granularity = size_t{2} << 20;  // 2 MiB, as on the GPU
  size_t capacity = size_t{64} << 30;    // bytes of physical memory Create() may hand out
};

// Creates an independent host backend (tests use small capacities to reach out-of-memory).
std::unique_ptr<Driver> NewHostDriver(const HostDriverOptions& options = {});

// The process-wide host backend with default options.
Driver* GetHostDriver();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_HOST_DRIVER_H_
