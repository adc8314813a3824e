// driver.h: the one interface between vmm and the memory driver.
//
// Everything vmm does to memory goes through `Driver`: physical allocations, reserved virtual
// address ranges, mappings, access rights, shareable handles, and the little of streams and
// events that stream-ordered reuse needs. No other file of the allocator calls the CUDA driver
// or mmap. Two backends implement it (see driver_factory.h):
//   - CudaDriver (cuda_driver.h): the real CUDA driver, libcuda.so.1 opened at run time.
//   - HostDriver (host_driver.h): the same contract on the CPU with memfd files and mmap, so
//     the whole stack, cross-process sharing included, runs where there is no GPU.
//
// Conventions, shared by both backends and checked by tests/driver_conformance_test.cc:
//   - Sizes and addresses given to Create/Reserve/Map/Unmap/SetAccess are multiples of
//     Granularity(device); anything else is InvalidArgument.
//   - Map(ptr, size, handle) maps the whole of `handle` at `ptr`: `size` must be the
//     allocation's size (CUDA's cuMemMap takes no offset, and refused a prefix with
//     CUDA_ERROR_NOT_SUPPORTED on an H200, driver 580). Both backends refuse another size of
//     an allocation they created with InvalidArgument (for an imported one the CUDA driver's
//     own error). The range must lie in a reserved range and not overlap another mapping;
//     SetAccess must follow before the memory is touched. Unmap must cover whole mappings.
//     Release may come before Unmap: the physical memory lives until it is both released and
//     unmapped (as in CUDA).
//   - Errors are absl::Status naming the call and the driver's error, with codes by meaning:
//     ResourceExhausted (out of memory), InvalidArgument (bad address, size or handle),
//     FailedPrecondition (no driver, no device, wrong state), PermissionDenied /
//     Unimplemented (handle type not permitted / supported), Internal (anything else).
//   - All methods are thread safe.
#ifndef VMM_ALLOCATOR_DRIVER_H_
#define VMM_ALLOCATOR_DRIVER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "allocator/unique_fd.h"

namespace vmm {

// A device virtual address (CUdeviceptr), or a host address on the host backend.
using DevPtr = uint64_t;
// A physical allocation (CUmemGenericAllocationHandle, or a host backend table id). 0 is none.
using PhysHandle = uint64_t;
// A stream (CUstream / cudaStream_t, or a host backend stream). 0 is the default stream.
using Stream = uintptr_t;
// Marks a foreign stream: one the framework does not own (torch.cuda.ExternalStream, a
// library's cudaStreamCreate), which its owner may destroy once its work is done, so that a
// driver call on it later is a call on a dead handle. A pool makes driver calls on such a
// stream only while an allocation names it: the blocks cached for it stay its own until a
// device synchronisation, and a free that must wait for its work waits on one
// (stream_reclaim.h). Drivers take a marked stream as the stream itself (StreamHandle). No CUDA
// stream or host backend stream has this bit.
inline constexpr Stream kForeignStreamBit = Stream{1} << 62;
inline constexpr Stream StreamHandle(Stream s) { return s & ~kForeignStreamBit; }
// An event (CUevent, or a host backend event). 0 is none.
using Event = uintptr_t;

// How a physical allocation can be shared with another process.
enum class HandleType : uint8_t {
  kNone = 0,     // not shareable
  kPosixFd = 1,  // a POSIX file descriptor (travels over a Unix socket)
  kFabric = 2,   // a 64-byte opaque fabric handle (travels as plain bytes)
};

// Which implementation of this interface a driver is, and so what kind of memory an address or
// a descriptor's handles refer to: device memory (kCuda) or host memory (kHost).
enum class Backend : uint8_t {
  kCuda = 1,
  kHost = 2,
};

// "cuda" or "host".
absl::string_view BackendName(Backend backend);
// The backend whose devices carry `uuid`: kHost for the host backend's "HOST-..." UUIDs, kCuda
// for CUDA's "GPU-..." ones, nullopt for anything else (a UUID given by hand, or none). The
// one place that reads a backend out of a UUID.
std::optional<Backend> BackendOfDeviceUuid(absl::string_view uuid);

// Bit masks of HandleType for Create(): which types the allocation may later be exported as.
inline constexpr uint32_t kPosixFdBit = 1u << 0;
inline constexpr uint32_t kFabricBit = 1u << 1;
inline constexpr uint32_t HandleTypeBit(HandleType t) {
  return t == HandleType::kPosixFd ? kPosixFdBit : t == HandleType::kFabric ? kFabricBit : 0u;
}

// "none", "posix_fd" or "fabric".
absl::string_view HandleTypeName(HandleType type);
// The handle type HandleTypeName gives `name`, or nullopt for any other text.
std::optional<HandleType> ParseHandleType(absl::string_view name);

inline constexpr size_t kFabricHandleSize = 64;
using FabricHandle = std::array<uint8_t, kFabricHandleSize>;

// An exported physical allocation. For kPosixFd it owns the descriptor.
struct ShareableHandle {
  HandleType type = HandleType::kNone;
  UniqueFd fd;            // kPosixFd
  FabricHandle fabric{};  // kFabric
};

struct MemInfo {
  size_t free = 0;
  size_t total = 0;
};

class Driver {
 public:
  virtual ~Driver() = default;

  // kCuda or kHost.
  virtual Backend backend() const = 0;
  // "cuda" or "host" (BackendName(backend())), for messages.
  absl::string_view Name() const { return BackendName(backend()); }
  // Number of devices, numbered 0..DeviceCount()-1 (the host backend emulates one unless
  // told otherwise; see host_driver.h).
  virtual int DeviceCount() const = 0;
  // The UUID of the device as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-..."), or "HOST-..." for the
  // host backend. InvalidArgument for a bad device index.
  virtual absl::StatusOr<std::string> DeviceUuid(int device) = 0;
  // The allocation granularity of `device` in bytes (a power of two).
  virtual absl::StatusOr<size_t> Granularity(int device) = 0;
  // Whether the device reports support for exporting `type` at all. A positive answer does not
  // promise that Create() with that type succeeds (fabric needs an IMEX channel): callers probe.
  virtual absl::StatusOr<bool> SupportsHandleType(int device, HandleType type) = 0;
  // Free and total physical memory of the device.
  virtual absl::StatusOr<MemInfo> GetMemInfo(int device) = 0;

  // --- Physical memory -------------------------------------------------------------------
  // Creates `size` bytes of physical memory on `device`, exportable as the types in
  // `handle_types` (a mask of k*Bit). ResourceExhausted when the device is out of memory.
  virtual absl::StatusOr<PhysHandle> Create(int device, size_t size, uint32_t handle_types) = 0;
  // Drops this reference to a physical allocation (memory is freed once also unmapped).
  virtual absl::Status Release(PhysHandle handle) = 0;

  // --- Virtual address ranges ------------------------------------------------------------
  // Reserves `size` bytes of address space aligned to `alignment` (0: granularity).
  virtual absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) = 0;
  // Reserves exactly [at, at + size) (both multiples of the granularity), to lengthen a range
  // the caller holds that ends at `at`. The new range is a reservation of its own: Unreserve
  // frees it alone, and no Map, Unmap or SetAccess may cross from it into its neighbour.
  // ResourceExhausted when any of that address space is taken, or the driver would place the
  // range elsewhere (nothing is then left reserved); InvalidArgument for a bad address or size;
  // Internal where a range placed elsewhere could not be given back.
  virtual absl::StatusOr<DevPtr> ReserveAt(DevPtr at, size_t size) = 0;
  // Frees a whole reserved range; it must have no mappings left.
  virtual absl::Status Unreserve(DevPtr ptr, size_t size) = 0;
  // Maps `handle`, whose size is `size`, at `ptr`. InvalidArgument for any other size.
  virtual absl::Status Map(DevPtr ptr, size_t size, PhysHandle handle) = 0;
  // Unmaps [ptr, ptr+size), which must consist of whole mappings.
  virtual absl::Status Unmap(DevPtr ptr, size_t size) = 0;
  // Grants read-write access to [ptr, ptr+size) (all mapped) for each device in `devices`.
  // Grants add up: devices not listed keep the access they had. A device other than the one
  // holding the physical memory reads and writes it over the peer link (NVLink or PCIe).
  // InvalidArgument for a bad device index, an empty list, or a range not entirely mapped.
  virtual absl::Status SetAccess(DevPtr ptr, size_t size, absl::Span<const int> devices) = 0;
  // Whether `device` may read and write the mapped address `ptr` (any byte of a mapping), as
  // SetAccess granted it. InvalidArgument for a bad device index or an address that is not
  // mapped. For tests and diagnostics: it asks the driver each time.
  virtual absl::StatusOr<bool> HasAccess(DevPtr ptr, int device) = 0;

  // --- Sharing ---------------------------------------------------------------------------
  // Exports `handle` as `type`, which must have been requested at Create(). For kPosixFd the
  // result owns a new file descriptor.
  virtual absl::StatusOr<ShareableHandle> Export(PhysHandle handle, HandleType type) = 0;
  // Imports a handle exported by this or another process (the fd is not consumed). A stale or
  // forged handle gives an error, never a crash. The caller Release()s the result.
  virtual absl::StatusOr<PhysHandle> Import(const ShareableHandle& handle) = 0;

  // --- Streams and events ----------------------------------------------------------------
  virtual absl::StatusOr<Stream> CreateStream(int device) = 0;
  virtual absl::Status DestroyStream(Stream stream) = 0;
  virtual absl::Status SynchronizeStream(Stream stream) = 0;
  // Whether `stream` is capturing a CUDA graph (cuStreamIsCapturing; the host backend's
  // streams never do). Work queued there while it captures, an event record included, joins
  // the graph instead of running: an event so recorded cannot be queried (Unavailable), and
  // synchronising the stream ends the capture with an error.
  virtual absl::StatusOr<bool> StreamCapturing(Stream stream) = 0;
  // Waits for all work on all streams of `device`.
  virtual absl::Status SynchronizeDevice(int device) = 0;
  virtual absl::StatusOr<Event> CreateEvent(int device) = 0;
  virtual absl::Status DestroyEvent(Event event) = 0;
  // Captures the work queued on `stream` so far.
  virtual absl::Status RecordEvent(Event event, Stream stream) = 0;
  // True when the captured work has completed (cuEventQuery), false while it has not;
  // Unavailable for an event last recorded in a stream that was capturing a graph.
  virtual absl::StatusOr<bool> EventDone(Event event) = 0;
  virtual absl::Status SynchronizeEvent(Event event) = 0;

  // --- Stream work (tests, demos, benchmarks) --------------------------------------------
  // Runs fn(arg) on the host in stream order; it must not call the driver.
  virtual absl::Status LaunchHostFunc(Stream stream, void (*fn)(void*), void* arg) = 0;
  // Copies `bytes` between any two addresses (host or device) in stream order.
  virtual absl::Status MemcpyAsync(DevPtr dst, DevPtr src, size_t bytes, Stream stream) = 0;
  virtual absl::Status MemsetAsync(DevPtr dst, uint8_t value, size_t bytes, Stream stream) = 0;
};

// Map's rule on every backend: a mapping covers a whole allocation. OK if `size` is
// `allocation_size`, else InvalidArgument naming both (`who` first, e.g. "host: Map"). Each
// backend calls it with the size it knows the allocation has.
absl::Status CheckMapsWholeAllocation(absl::string_view who, size_t size, PhysHandle handle,
                                      size_t allocation_size);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_DRIVER_H_
