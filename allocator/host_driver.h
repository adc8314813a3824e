// host_driver.h: the host backend of the driver interface (driver.h), for machines without
// a GPU and for CI.
//
// It keeps the CUDA backend's contract on the CPU: a physical allocation is a memfd file, a
// reserved range is a PROT_NONE mapping, Map is mmap(MAP_FIXED|MAP_SHARED) of the file and
// SetAccess is mprotect. Export gives a duplicated fd (kPosixFd) or a 64-byte handle that is
// plain bytes (kFabric) which another process of the same user imports by opening the
// exporter's fd through /proc; the handle names the file's inode and a random tag kept in the
// memfd's name, so a stale handle (NotFound, also when the exporter's fd number now names
// another file) or a forged one is refused cleanly. Every memfd is sealed against resizing
// when created, and imports refuse unsealed files, so no process holding one can truncate it
// under another's mapping (SIGBUS). Streams are worker threads
// that run their queued work in order; events complete when their stream reaches them, so
// stream-ordering logic is tested for real.
//
// Devices. It emulates `device_count` devices (one by default), so that multi-device code
// (peer access, importing on another device) runs in CI. They differ only in name and in the
// access bookkeeping: each has its own UUID ("HOST-" and a UUID derived from the boot id and
// the index; device 0's is the boot id itself, as when there was one device), and SetAccess
// records which devices were granted each mapped byte, which HasAccess reports. Everything
// else is shared by all devices: the granularity, the capacity and GetMemInfo() (the same
// figures for every device), the streams and events (SynchronizeDevice(d) waits for the
// streams of every device), and the memory itself, which the work of every device (and the CPU)
// can touch once any device has been granted access: access is recorded, not enforced per
// device.
//
// Open files. Every physical allocation is a memfd; NewHostDriver raises the soft limit on open
// files (RLIMIT_NOFILE) to the hard limit once, so that pools of many chunks fit.
//
// Out of memory is simulated by a capacity: Create() past it returns ResourceExhausted, and
// GetMemInfo() reports capacity minus the bytes of live physical allocations, each memfd
// counted once however many imports and mappings of it this driver holds.
#ifndef VMM_ALLOCATOR_HOST_DRIVER_H_
#define VMM_ALLOCATOR_HOST_DRIVER_H_

#include <cstddef>
#include <memory>

#include "allocator/driver.h"

namespace vmm {

// The most devices the host backend emulates.
inline constexpr int kMaxHostDevices = 64;

struct HostDriverOptions {
  size_t granularity = size_t{2} << 20;  // 2 MiB, as on the GPU
  size_t capacity = size_t{64} << 30;    // bytes of physical memory Create() may hand out
  // Devices to emulate, 1..kMaxHostDevices (anything else: 1, with a warning).
  int device_count = 1;
};

// Creates an independent host backend (tests use small capacities to reach out-of-memory,
// and several devices to test peer access).
std::unique_ptr<Driver> NewHostDriver(const HostDriverOptions& options = {});

// The process-wide host backend with default options, except for the number of devices: the
// environment variable VMM_HOST_DEVICES (read once, on the first call) sets it, so that a
// helper process started by a test (which finds its backend through driver_factory.h) can
// emulate several devices. Unset or empty: 1; not a number in 1..kMaxHostDevices: 1, with a
// warning.
Driver* GetHostDriver();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_HOST_DRIVER_H_
