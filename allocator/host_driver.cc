// host_driver.cc: the host backend (see host_driver.h).
//
// Physical memory is a memfd file per allocation, a reserved range is an anonymous PROT_NONE
// mapping, Map replaces part of a reservation with a MAP_SHARED mapping of the file (still
// PROT_NONE), SetAccess makes it read-write, and Unmap puts an anonymous PROT_NONE mapping back so
// that the reservation stays whole. ReserveAt asks the kernel for exactly the range given
// (MAP_FIXED_NOREPLACE). As the CUDA backend is taken to require, Map, Unmap and SetAccess each
// stay inside one reservation, even where two lie end to end. All bookkeeping lives in tables
// guarded by one mutex; the system calls that change the address space run under it too, so that
// two threads can never map over each other.
//
// Accounting: a physical allocation's bytes count against the capacity once, from the first
// Create() or Import() of its memfd in this driver until the last table entry for that file
// (by inode) is both released and unmapped, however many imports and mappings reference it:
// importing one handle 33,000 times costs its size once. Imports of memory not yet counted
// count too but, as in CUDA, are never refused for lack of capacity, so free bytes stop at 0.
// An exported POSIX fd keeps the file alive but is not counted.
//
// A fabric handle names the exporter's descriptor as /proc/<pid>/fd/<fd>, so an import needs
// the exporter alive, still holding the allocation (not released), and the right to open its
// /proc entries (the same user). Everything else about the file (inode, size, the random tag
// in the memfd's name) is checked after opening it: an fd that names another file now (the
// exporter released the allocation and the number was reused) is a stale handle (NotFound);
// only bytes that cannot be a handle are InvalidArgument.
//
// Seals: every memfd is sealed against shrinking and growing (and further seals) right after
// it is sized, so no process can truncate it under a mapping (SIGBUS); Import, by fd or by
// fabric handle, refuses a file without those seals (PermissionDenied).
//
// Streams are worker threads with a FIFO of work; events are generation counters that a
// marker queued on a stream advances. Stream 0 runs its work at once on the calling thread.
//
// fork(): the driver's lock is held across fork() (fork_guard.h, ForkLevel::kDriver), so a
// forked child finds it free and the tables whole, however busy its parent's threads were with
// this driver. The child has none of its parent's stream threads: in the child, the parent's
// streams and events are set aside (never used or destroyed there: their locks and condition
// variables may have been in use by those threads) and the work they had queued is the
// parent's (it runs there, on memory the child shares). A stream of the parent gets a new,
// empty queue and thread on its first use in the child; an event of the parent starts there
// as never recorded (done).
//
// Devices (host_driver.h): a device index is checked against the count and otherwise only
// names a UUID and a bit in the access masks that SetAccess records per mapping.
#include "allocator/host_driver.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "allocator/fork_guard.h"
#include "allocator/host_memfd.h"
#include "allocator/host_streams.h"
#include "allocator/log.h"
#include "allocator/mutex.h"
#include "allocator/status_macros.h"
#include "allocator/unique_fd.h"

// The flag's value since Linux 4.17, for C libraries whose headers predate it.
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

namespace vmm {
namespace {

using host::CreateMemfd;
using host::DecodeFabric;
using host::DeviceIdHex;
using host::EncodeFabric;
using host::FabricFields;
using host::Fstat;
using host::FileIdentity;
using host::IdentifyMemfd;
using host::RandomTag;
using host::ReadBootIdHex;
using host::StableHash;
using host::HostEvent;
using host::HostStream;

// --- Small helpers ------------------------------------------------------------------------

// "call: strerror(errno)" with the code chosen from errno (ENOMEM: ResourceExhausted, ...).
absl::Status ErrnoStatus(absl::string_view call) { return absl::ErrnoToStatus(errno, call); }

bool IsPowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

void* ToPointer(DevPtr ptr) { return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)); }
DevPtr ToDevPtr(const void* p) { return static_cast<DevPtr>(reinterpret_cast<uintptr_t>(p)); }

// `requested` when it is a power of two of at least a page (mmap works in pages), else the
// default granularity with a warning: NewHostDriver() has no way to return an error.
size_t ValidGranularity(size_t requested) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (IsPowerOfTwo(requested) && requested >= page) return requested;
  const size_t fallback = HostDriverOptions().granularity;
  LogWarning(absl::StrCat("host: granularity ", requested,
                          " is not a power of two of at least a page; using ", fallback));
  return fallback;
}

// Each physical allocation of the host backend is a memfd, so a pool of many chunks (8 MiB
// pages: 128 per GiB) holds many files: the soft limit on open files is raised to the hard
// one, once, as programs that keep many files do. A failure leaves the limit as it was.
void RaiseOpenFileLimit() {
  static const bool raised = [] {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return false;
    limit.rlim_cur = limit.rlim_max;
    return ::setrlimit(RLIMIT_NOFILE, &limit) == 0;
  }();
  (void)raised;
}

// `requested` when it is in 1..kMaxHostDevices, else 1 with a warning (as above).
int ValidDeviceCount(int requested) {
  if (requested >= 1 && requested <= kMaxHostDevices) return requested;
  LogWarning(absl::StrCat("host: device_count ", requested, " is outside 1..", kMaxHostDevices,
                          "; using 1"));
  return 1;
}

// The device count VMM_HOST_DEVICES asks for (see GetHostDriver()).
int DeviceCountFromEnv() {
  const char* text = std::getenv("VMM_HOST_DEVICES");
  if (text == nullptr || text[0] == '\0') return 1;
  int count = 0;
  if (!absl::SimpleAtoi(text, &count)) {
    LogWarning(absl::StrCat("host: VMM_HOST_DEVICES=", text, " is not a number; using 1"));
    return 1;
  }
  return ValidDeviceCount(count);
}

// The bit of `device` in an access mask.
uint64_t DeviceBit(int device) { return uint64_t{1} << device; }

// Replaces [ptr, ptr+size) with inaccessible anonymous memory: a reservation's filler.
absl::Status MapFiller(DevPtr ptr, size_t size) {
  void* p = ::mmap(ToPointer(ptr), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return ErrnoStatus("mmap");
  return absl::OkStatus();
}

// --- Access bookkeeping ----------------------------------------------------------------------

// Which devices SetAccess granted on each byte of one mapping: runs of offsets with the same
// device mask, keyed by where they start, covering [0, size). Grants only add devices, as
// cuMemSetAccess's do for the devices it lists.
class AccessMap {
 public:
  explicit AccessMap(size_t size) : size_(size) { runs_.emplace(0, 0); }

  // Adds the devices of `mask` to [begin, end), where begin < end <= size.
  void Grant(size_t begin, size_t end, uint64_t mask) {
    Split(begin);
    Split(end);
    for (auto it = runs_.find(begin); it != runs_.end() && it->first < end; ++it) {
      it->second |= mask;
    }
  }

  // The mask of devices granted at `offset` (< size).
  uint64_t At(size_t offset) const { return std::prev(runs_.upper_bound(offset))->second; }

 private:
  // Makes a run start at `offset` unless one does, or it is the end.
  void Split(size_t offset) {
    if (offset >= size_) return;
    auto it = std::prev(runs_.upper_bound(offset));
    if (it->first != offset) runs_.emplace_hint(std::next(it), offset, it->second);
  }

  size_t size_;
  std::map<size_t, uint64_t> runs_;  // start offset -> device mask
};

// --- The driver ------------------------------------------------------------------------------

class HostDriver final : public Driver {
 public:
  explicit HostDriver(const HostDriverOptions& options)
      : granularity_(ValidGranularity(options.granularity)),
        capacity_(options.capacity),
        device_count_(ValidDeviceCount(options.device_count)),
        boot_id_hex_(ReadBootIdHex()),
        boot_hash_(StableHash(boot_id_hex_)) {}
  ~HostDriver() override;

  Backend backend() const override { return Backend::kHost; }
  int DeviceCount() const override { return device_count_; }
  absl::StatusOr<std::string> DeviceUuid(int device) override;
  absl::StatusOr<size_t> Granularity(int device) override;
  absl::StatusOr<bool> SupportsHandleType(int device, HandleType type) override;
  absl::StatusOr<MemInfo> GetMemInfo(int device) override;

  absl::StatusOr<PhysHandle> Create(int device, size_t size, uint32_t handle_types) override;
  absl::Status Release(PhysHandle handle) override;

  absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) override;
  absl::StatusOr<DevPtr> ReserveAt(DevPtr at, size_t size) override;
  absl::Status Unreserve(DevPtr ptr, size_t size) override;
  absl::Status Map(DevPtr ptr, size_t size, PhysHandle handle) override;
  absl::Status Unmap(DevPtr ptr, size_t size) override;
  absl::Status SetAccess(DevPtr ptr, size_t size, absl::Span<const int> devices) override;
  absl::StatusOr<bool> HasAccess(DevPtr ptr, int device) override;

  absl::StatusOr<ShareableHandle> Export(PhysHandle handle, HandleType type) override;
  absl::StatusOr<PhysHandle> Import(const ShareableHandle& handle) override;

  absl::StatusOr<Stream> CreateStream(int device) override;
  absl::Status DestroyStream(Stream stream) override;
  absl::Status SynchronizeStream(Stream stream) override;
  // Host streams never capture.
  absl::StatusOr<bool> StreamCapturing(Stream) override { return false; }
  absl::Status SynchronizeDevice(int device) override;
  absl::StatusOr<Event> CreateEvent(int device) override;
  absl::Status DestroyEvent(Event event) override;
  absl::Status RecordEvent(Event event, Stream stream) override;
  absl::StatusOr<bool> EventDone(Event event) override;
  absl::Status SynchronizeEvent(Event event) override;

  absl::Status LaunchHostFunc(Stream stream, void (*fn)(void*), void* arg) override;
  absl::Status MemcpyAsync(DevPtr dst, DevPtr src, size_t bytes, Stream stream) override;
  absl::Status MemsetAsync(DevPtr dst, uint8_t value, size_t bytes, Stream stream) override;

 private:
  // fork() handlers (see the file comment): mu_ is held across the fork.
  static void LockForFork(void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  static void UnlockInParent(void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  static void ForgetParentsThreadsInChild(void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  static ForkHandlers HeldAcrossFork(HostDriver* self) {
    return ForkHandlers{&LockForFork, &UnlockInParent, &ForgetParentsThreadsInChild, self};
  }

  // A physical allocation: created here or imported. Its bytes count against the capacity
  // until it is both released and unmapped everywhere in this driver; then it is erased.
  struct Allocation {
    UniqueFd fd;  // the memfd; closed at Release (mappings keep the pages)
    size_t size = 0;
    uint32_t handle_types = 0;  // k*Bit types Export() accepts
    FileIdentity identity;      // inode and tag, for fabric handles
    bool released = false;
    int map_count = 0;  // live mappings of this allocation
  };
  struct Mapping {
    Mapping(size_t size, PhysHandle handle) : size(size), handle(handle), access(size) {}
    size_t size;
    PhysHandle handle;
    AccessMap access;  // granted by SetAccess; none at first
  };
  using MappingMap = std::map<DevPtr, Mapping>;

  // InvalidArgument unless 0 <= device < device_count_.
  absl::Status CheckDevice(int device) const;
  absl::Status CheckSize(absl::string_view call, size_t size) const;
  absl::Status CheckRange(absl::string_view call, DevPtr ptr, size_t size) const;
  // The allocation `handle` names, unless unknown or released (InvalidArgument).
  absl::StatusOr<Allocation*> LiveAllocation(absl::string_view call, PhysHandle handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds an allocation to the table and, unless its file is already counted, its bytes to the
  // accounting; returns its new id.
  PhysHandle AddAllocation(Allocation allocation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases `handle` once it is released and unmapped, returning its bytes to the capacity.
  void MaybeFree(PhysHandle handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether [ptr, ptr+size) lies inside one reservation.
  bool InsideReservation(DevPtr ptr, size_t size) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool OverlapsMapping(DevPtr ptr, size_t size) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether every byte of [ptr, ptr+size) is mapped.
  bool CoveredByMappings(DevPtr ptr, size_t size) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The mapping holding the byte at `ptr`, or mappings_.end().
  MappingMap::iterator MappingAt(DevPtr ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the devices of `mask` as granted on [ptr, ptr+size), which must be mapped.
  void RecordAccess(DevPtr ptr, size_t size, uint64_t mask) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<FabricHandle> ExportFabric(const Allocation& allocation) const;
  absl::StatusOr<PhysHandle> ImportPosixFd(int fd);
  absl::StatusOr<PhysHandle> ImportFabric(const FabricHandle& handle);
  // Opens the file a fabric handle names through /proc and checks that it is that file.
  absl::StatusOr<UniqueFd> OpenFabricTarget(const FabricFields& f) const;

  // The stream `stream` (nonzero) names; InvalidArgument when unknown.
  absl::StatusOr<std::shared_ptr<HostStream>> FindStream(Stream stream);
  absl::StatusOr<std::shared_ptr<HostEvent>> FindEvent(Event event);
  // Runs `work` at once on stream 0, else queues it on `stream`.
  absl::Status Submit(Stream stream, std::function<void()> work);

  const size_t granularity_;
  const size_t capacity_;
  const int device_count_;
  const std::string boot_id_hex_;  // empty when unreadable
  const uint64_t boot_hash_;

  Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;  // ids of allocations, streams and events
  size_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the files in files_, each counted once
  // Table entries per memfd (by inode): a file's bytes count while it has any.
  absl::flat_hash_map<uint64_t, int> files_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PhysHandle, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  std::map<DevPtr, size_t> reservations_ ABSL_GUARDED_BY(mu_);  // start -> size
  MappingMap mappings_ ABSL_GUARDED_BY(mu_);                    // start -> mapping
  // Null: a stream of the parent of this forked process, made afresh on first use (FindStream).
  absl::flat_hash_map<Stream, std::shared_ptr<HostStream>> streams_ ABSL_GUARDED_BY(mu_);
  // Streams being destroyed, whose queues are still draining.
  std::vector<std::shared_ptr<HostStream>> draining_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Event, std::shared_ptr<HostEvent>> events_ ABSL_GUARDED_BY(mu_);
  // Last: unregistered before the members above go.
  ForkRegistration fork_{ForkLevel::kDriver, HeldAcrossFork(this)};
};

void HostDriver::LockForFork(void* self) { static_cast<HostDriver*>(self)->mu_.Lock(); }

void HostDriver::UnlockInParent(void* self) { static_cast<HostDriver*>(self)->mu_.Unlock(); }

void HostDriver::ForgetParentsThreadsInChild(void* self) {
  HostDriver& d = *static_cast<HostDriver*>(self);
  // Set aside for good: destroying one would join a thread that does not exist here, or
  // destroy a condition variable the parent's threads were waiting on.
  auto* parents = new std::vector<std::shared_ptr<void>>();  // never freed
  for (auto& [id, stream] : d.streams_) {
    if (stream != nullptr) parents->push_back(std::move(stream));
    stream = nullptr;
  }
  for (auto& stream : d.draining_) parents->push_back(std::move(stream));
  d.draining_.clear();
  for (auto& [id, event] : d.events_) {
    parents->push_back(std::move(event));
    event = std::make_shared<HostEvent>();
  }
  d.mu_.UnlockInForkChild();
}

HostDriver::~HostDriver() {
  std::vector<std::shared_ptr<HostStream>> streams;
  {
    MutexLock lock(&mu_);
    for (auto& [id, stream] : streams_) {
      if (stream != nullptr) streams.push_back(stream);
    }
    streams_.clear();
    events_.clear();
  }
  for (auto& stream : streams) stream->Stop();
  streams.clear();

  MutexLock lock(&mu_);
  // Unmapping a whole reservation also removes the mappings inside it.
  for (const auto& [ptr, size] : reservations_) ::munmap(ToPointer(ptr), size);
  reservations_.clear();
  mappings_.clear();
  allocations_.clear();  // closes the memfds
}

// --- Device queries ---

absl::StatusOr<std::string> HostDriver::DeviceUuid(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  if (boot_id_hex_.empty()) {
    return absl::FailedPreconditionError(
        "host: cannot read /proc/sys/kernel/random/boot_id for the device UUID");
  }
  const std::string h = DeviceIdHex(boot_id_hex_, device);
  return absl::StrCat("HOST-", h.substr(0, 8), "-", h.substr(8, 4), "-", h.substr(12, 4), "-",
                      h.substr(16, 4), "-", h.substr(20, 12));
}

absl::StatusOr<size_t> HostDriver::Granularity(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  return granularity_;
}

absl::StatusOr<bool> HostDriver::SupportsHandleType(int device, HandleType type) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  return type == HandleType::kPosixFd || type == HandleType::kFabric;
}

absl::StatusOr<MemInfo> HostDriver::GetMemInfo(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  MutexLock lock(&mu_);
  // Imports count too, so live bytes may pass the capacity; free stops at 0.
  return MemInfo{capacity_ - std::min(live_bytes_, capacity_), capacity_};
}

// --- Validation helpers ---

absl::Status HostDriver::CheckDevice(int device) const {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: invalid device ", device, " (", device_count_, " device(s))"));
  }
  return absl::OkStatus();
}

absl::Status HostDriver::CheckSize(absl::string_view call, size_t size) const {
  if (size == 0 || size % granularity_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: ", call, ": size ", size,
                     " is not a positive multiple of the granularity ", granularity_));
  }
  return absl::OkStatus();
}

absl::Status HostDriver::CheckRange(absl::string_view call, DevPtr ptr, size_t size) const {
  VMM_RETURN_IF_ERROR(CheckSize(call, size));
  if (ptr == 0 || ptr % granularity_ != 0 || ptr + size < ptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "host: %s: address 0x%x is not aligned to the granularity %u", call, ptr, granularity_));
  }
  return absl::OkStatus();
}

absl::StatusOr<HostDriver::Allocation*> HostDriver::LiveAllocation(absl::string_view call,
                                                                   PhysHandle handle) {
  auto it = allocations_.find(handle);
  if (it == allocations_.end() || it->second.released) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: ", call, ": invalid or released handle ", handle));
  }
  return &it->second;
}

PhysHandle HostDriver::AddAllocation(Allocation allocation) {
  const PhysHandle id = next_id_++;
  if (files_[allocation.identity.inode]++ == 0) live_bytes_ += allocation.size;
  allocations_.emplace(id, std::move(allocation));
  return id;
}

void HostDriver::MaybeFree(PhysHandle handle) {
  auto it = allocations_.find(handle);
  if (it == allocations_.end() || !it->second.released || it->second.map_count > 0) return;
  auto file = files_.find(it->second.identity.inode);
  if (--file->second == 0) {
    live_bytes_ -= it->second.size;
    files_.erase(file);
  }
  allocations_.erase(it);
}

bool HostDriver::InsideReservation(DevPtr ptr, size_t size) const {
  auto it = reservations_.upper_bound(ptr);
  if (it == reservations_.begin()) return false;
  --it;
  return ptr + size <= it->first + it->second;
}

bool HostDriver::OverlapsMapping(DevPtr ptr, size_t size) const {
  auto next = mappings_.lower_bound(ptr);
  if (next != mappings_.end() && next->first < ptr + size) return true;
  if (next == mappings_.begin()) return false;
  auto prev = std::prev(next);
  return prev->first + prev->second.size > ptr;
}

HostDriver::MappingMap::iterator HostDriver::MappingAt(DevPtr ptr) {
  auto it = mappings_.upper_bound(ptr);
  if (it == mappings_.begin()) return mappings_.end();
  --it;
  return ptr < it->first + it->second.size ? it : mappings_.end();
}

void HostDriver::RecordAccess(DevPtr ptr, size_t size, uint64_t mask) {
  const DevPtr end = ptr + size;
  for (auto it = MappingAt(ptr); it != mappings_.end() && it->first < end; ++it) {
    const DevPtr start = it->first;
    const DevPtr begin = std::max(ptr, start);
    const DevPtr stop = std::min(end, start + it->second.size);
    it->second.access.Grant(begin - start, stop - start, mask);
  }
}

bool HostDriver::CoveredByMappings(DevPtr ptr, size_t size) const {
  DevPtr cursor = ptr;
  const DevPtr end = ptr + size;
  while (cursor < end) {
    auto it = mappings_.upper_bound(cursor);
    if (it == mappings_.begin()) return false;
    --it;
    const DevPtr mapping_end = it->first + it->second.size;
    if (mapping_end <= cursor) return false;  // a hole at `cursor`
    cursor = mapping_end;
  }
  return true;
}

// --- Physical memory ---

absl::StatusOr<PhysHandle> HostDriver::Create(int device, size_t size, uint32_t handle_types) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  VMM_RETURN_IF_ERROR(CheckSize("Create", size));
  if ((handle_types & ~(kPosixFdBit | kFabricBit)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: Create: unknown handle type bits 0x", absl::Hex(handle_types)));
  }
  MutexLock lock(&mu_);
  const size_t free_bytes = capacity_ - std::min(live_bytes_, capacity_);
  if (size > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("host: out of memory: requested ", size,
                                                     " bytes, ", free_bytes, " bytes free"));
  }
  Allocation allocation;
  VMM_ASSIGN_OR_RETURN(allocation.identity.tag, RandomTag());
  VMM_ASSIGN_OR_RETURN(allocation.fd, CreateMemfd(allocation.identity.tag, size));
  VMM_ASSIGN_OR_RETURN(struct stat st, Fstat(allocation.fd.get()));
  allocation.identity.inode = static_cast<uint64_t>(st.st_ino);
  allocation.identity.size = size;
  allocation.size = size;
  allocation.handle_types = handle_types;
  return AddAllocation(std::move(allocation));
}

absl::Status HostDriver::Release(PhysHandle handle) {
  MutexLock lock(&mu_);
  VMM_ASSIGN_OR_RETURN(Allocation * allocation, LiveAllocation("Release", handle));
  allocation->released = true;
  allocation->fd.reset();
  MaybeFree(handle);
  return absl::OkStatus();
}

// --- Virtual address ranges ---

absl::StatusOr<DevPtr> HostDriver::Reserve(size_t size, size_t alignment) {
  VMM_RETURN_IF_ERROR(CheckSize("Reserve", size));
  if (alignment != 0 && !IsPowerOfTwo(alignment)) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: Reserve: alignment ", alignment, " is not a power of two"));
  }
  alignment = std::max(alignment, granularity_);
  const size_t padded = size + alignment;
  if (padded < size) {
    return absl::InvalidArgumentError("host: Reserve: size plus alignment overflows");
  }
  void* p = ::mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return ErrnoStatus("mmap");
  // Trim the unaligned head and the tail beyond `size`.
  const DevPtr raw = ToDevPtr(p);
  const DevPtr base = (raw + alignment - 1) & ~static_cast<DevPtr>(alignment - 1);
  if (base > raw) ::munmap(p, base - raw);
  const size_t tail = raw + padded - (base + size);
  if (tail > 0) ::munmap(ToPointer(base + size), tail);
  MutexLock lock(&mu_);
  reservations_[base] = size;
  return base;
}

absl::StatusOr<DevPtr> HostDriver::ReserveAt(DevPtr at, size_t size) {
  VMM_RETURN_IF_ERROR(CheckRange("ReserveAt", at, size));
  MutexLock lock(&mu_);
  // MAP_FIXED_NOREPLACE fails with EEXIST where any page of the range is mapped (this
  // driver's reservations included); a kernel older than the flag takes the address as a
  // hint, and a range placed elsewhere is given back.
  void* p = ::mmap(ToPointer(at), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) {
    if (errno == EEXIST || errno == ENOMEM) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "host: ReserveAt: [0x%x, +%u) is not free address space (%s)", at, size,
          std::strerror(errno)));
    }
    return ErrnoStatus("mmap");
  }
  if (ToDevPtr(p) != at) {
    ::munmap(p, size);
    return absl::ResourceExhaustedError(
        absl::StrFormat("host: ReserveAt: [0x%x, +%u) is not free address space", at, size));
  }
  reservations_[at] = size;
  return at;
}

absl::Status HostDriver::Unreserve(DevPtr ptr, size_t size) {
  MutexLock lock(&mu_);
  auto it = reservations_.find(ptr);
  if (it == reservations_.end() || it->second != size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host: Unreserve: [0x%x, +%u) is not a reserved range", ptr, size));
  }
  if (OverlapsMapping(ptr, size)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("host: Unreserve: [0x%x, +%u) still has mappings", ptr, size));
  }
  if (::munmap(ToPointer(ptr), size) != 0) return ErrnoStatus("munmap");
  reservations_.erase(it);
  return absl::OkStatus();
}

absl::Status HostDriver::Map(DevPtr ptr, size_t size, PhysHandle handle) {
  VMM_RETURN_IF_ERROR(CheckRange("Map", ptr, size));
  MutexLock lock(&mu_);
  if (!InsideReservation(ptr, size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host: Map: [0x%x, +%u) is not inside one reserved range", ptr, size));
  }
  if (OverlapsMapping(ptr, size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host: Map: [0x%x, +%u) overlaps an existing mapping", ptr, size));
  }
  VMM_ASSIGN_OR_RETURN(Allocation * allocation, LiveAllocation("Map", handle));
  // As CUDA (and pages beyond the end of the file would raise SIGBUS).
  VMM_RETURN_IF_ERROR(CheckMapsWholeAllocation("host: Map", size, handle, allocation->size));
  void* p =
      ::mmap(ToPointer(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, allocation->fd.get(), 0);
  if (p == MAP_FAILED) {
    absl::Status status = ErrnoStatus("mmap");
    (void)MapFiller(ptr, size);  // MAP_FIXED may have dropped the filler already
    return status;
  }
  ++allocation->map_count;
  mappings_.emplace(ptr, Mapping(size, handle));
  return absl::OkStatus();
}

absl::Status HostDriver::Unmap(DevPtr ptr, size_t size) {
  VMM_RETURN_IF_ERROR(CheckRange("Unmap", ptr, size));
  MutexLock lock(&mu_);
  if (!InsideReservation(ptr, size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host: Unmap: [0x%x, +%u) is not inside one reserved range", ptr, size));
  }
  // Collect the whole mappings that tile [ptr, ptr+size) exactly before changing anything.
  std::vector<MappingMap::iterator> parts;
  DevPtr cursor = ptr;
  const DevPtr end = ptr + size;
  while (cursor < end) {
    auto it = mappings_.find(cursor);
    if (it == mappings_.end() || cursor + it->second.size > end) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "host: Unmap: [0x%x, +%u) does not consist of whole mappings", ptr, size));
    }
    parts.push_back(it);
    cursor += it->second.size;
  }
  if (absl::Status status = MapFiller(ptr, size); !status.ok()) {
    return absl::InternalError(absl::StrCat("host: Unmap: ", status.message()));
  }
  for (auto it : parts) {
    const PhysHandle handle = it->second.handle;
    mappings_.erase(it);
    auto alloc = allocations_.find(handle);
    if (alloc != allocations_.end()) --alloc->second.map_count;
    MaybeFree(handle);
  }
  return absl::OkStatus();
}

absl::Status HostDriver::SetAccess(DevPtr ptr, size_t size, absl::Span<const int> devices) {
  VMM_RETURN_IF_ERROR(CheckRange("SetAccess", ptr, size));
  if (devices.empty()) return absl::InvalidArgumentError("host: SetAccess: no devices");
  uint64_t mask = 0;
  for (int device : devices) {
    VMM_RETURN_IF_ERROR(CheckDevice(device));
    mask |= DeviceBit(device);
  }
  MutexLock lock(&mu_);
  if (!InsideReservation(ptr, size)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "host: SetAccess: [0x%x, +%u) is not inside one reserved range", ptr, size));
  }
  if (!CoveredByMappings(ptr, size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host: SetAccess: [0x%x, +%u) is not entirely mapped", ptr, size));
  }
  if (::mprotect(ToPointer(ptr), size, PROT_READ | PROT_WRITE) != 0) {
    return ErrnoStatus("mprotect");
  }
  RecordAccess(ptr, size, mask);
  return absl::OkStatus();
}

absl::StatusOr<bool> HostDriver::HasAccess(DevPtr ptr, int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  MutexLock lock(&mu_);
  auto it = MappingAt(ptr);
  if (it == mappings_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host: HasAccess: address 0x%x is not mapped", ptr));
  }
  return (it->second.access.At(ptr - it->first) & DeviceBit(device)) != 0;
}

// --- Sharing ---

absl::StatusOr<ShareableHandle> HostDriver::Export(PhysHandle handle, HandleType type) {
  MutexLock lock(&mu_);
  VMM_ASSIGN_OR_RETURN(Allocation * allocation, LiveAllocation("Export", handle));
  const uint32_t bit = HandleTypeBit(type);
  if (bit == 0 || (allocation->handle_types & bit) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host: Export: handle type ", HandleTypeName(type), " was not requested at Create"));
  }
  ShareableHandle out;
  out.type = type;
  if (type == HandleType::kPosixFd) {
    out.fd.reset(::fcntl(allocation->fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!out.fd.valid()) return ErrnoStatus("fcntl(F_DUPFD_CLOEXEC)");
  } else {
    VMM_ASSIGN_OR_RETURN(out.fabric, ExportFabric(*allocation));
  }
  return out;
}

absl::StatusOr<FabricHandle> HostDriver::ExportFabric(const Allocation& allocation) const {
  if (boot_id_hex_.empty()) {
    return absl::FailedPreconditionError(
        "host: Export: cannot read /proc/sys/kernel/random/boot_id for a fabric handle");
  }
  FabricFields f;
  f.pid = static_cast<uint32_t>(::getpid());
  f.fd = static_cast<uint32_t>(allocation.fd.get());
  f.inode = allocation.identity.inode;
  f.size = allocation.identity.size;
  f.tag = allocation.identity.tag;
  f.boot_hash = boot_hash_;
  return EncodeFabric(f);
}

absl::StatusOr<PhysHandle> HostDriver::Import(const ShareableHandle& handle) {
  switch (handle.type) {
    case HandleType::kPosixFd:
      return ImportPosixFd(handle.fd.get());
    case HandleType::kFabric:
      return ImportFabric(handle.fabric);
    case HandleType::kNone:
      break;
  }
  return absl::InvalidArgumentError("host: Import: the handle has no type");
}

absl::StatusOr<PhysHandle> HostDriver::ImportPosixFd(int fd) {
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("host: Import: invalid fd ", fd));
  }
  Allocation allocation;
  allocation.fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!allocation.fd.valid()) return ErrnoStatus("fcntl(F_DUPFD_CLOEXEC)");
  VMM_ASSIGN_OR_RETURN(allocation.identity, IdentifyMemfd(allocation.fd.get()));
  if (absl::Status sealed = host::CheckSealed(fd); !sealed.ok()) {
    return absl::Status(sealed.code(), absl::StrCat("host: Import: fd ", fd, ": ",
                                                    sealed.message()));
  }
  allocation.size = allocation.identity.size;
  allocation.handle_types = kPosixFdBit | kFabricBit;
  MutexLock lock(&mu_);
  return AddAllocation(std::move(allocation));
}

absl::StatusOr<PhysHandle> HostDriver::ImportFabric(const FabricHandle& handle) {
  VMM_ASSIGN_OR_RETURN(FabricFields f, DecodeFabric(handle));
  if (boot_id_hex_.empty() || f.boot_hash != boot_hash_) {
    return absl::FailedPreconditionError(
        "host: Import: fabric handle from another machine (or an earlier boot)");
  }
  Allocation allocation;
  VMM_ASSIGN_OR_RETURN(allocation.fd, OpenFabricTarget(f));
  allocation.identity.inode = f.inode;
  allocation.identity.size = f.size;
  allocation.identity.tag = f.tag;
  allocation.size = f.size;
  allocation.handle_types = kPosixFdBit | kFabricBit;
  MutexLock lock(&mu_);
  return AddAllocation(std::move(allocation));
}

namespace {

// Whether process `pid` has exited: no /proc entry (ENOENT, ESRCH), or one of a zombie
// (exited, not yet waited for by its parent) or a dead process. Its descriptors are gone
// either way. A process /proc will not show (hidepid, EACCES) counts as alive.
bool ProcessHasExited(uint32_t pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  UniqueFd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file.valid()) return errno == ENOENT || errno == ESRCH;
  char buffer[512];
  const ssize_t n = ::read(file.get(), buffer, sizeof(buffer) - 1);
  if (n <= 0) return false;
  const std::string line(buffer, static_cast<size_t>(n));
  // "pid (comm) state ...": the command may hold spaces and parentheses, the state follows
  // the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  return state == 'Z' || state == 'X' || state == 'x';
}

}  // namespace

absl::StatusOr<UniqueFd> HostDriver::OpenFabricTarget(const FabricFields& f) const {
  const std::string path = absl::StrCat("/proc/", f.pid, "/fd/", f.fd);
  // The exporter's fd now names another file: it released the allocation and the number was
  // reused (or the handle never named a host allocation: the two look the same from here).
  auto released = [&](absl::string_view what) {
    return absl::NotFoundError(absl::StrCat(
        "host: Import: stale handle: the exporter (pid ", f.pid,
        ") released the allocation; ", path, " ", what));
  };
  // stat()/open() failed: ENOENT means the process or its descriptor is gone (Unavailable: the
  // exporter has exited, as the POSIX-fd path says when its fd server is gone; NotFound: it
  // lives but released the allocation); anything else (EACCES: another user's process) means
  // it cannot be reached from here.
  auto unreachable = [&](absl::string_view call) {
    const int err = errno;
    const std::string why =
        absl::StrCat("(", absl::ErrnoToStatus(err, absl::StrCat(call, " ", path)).message(), ")");
    if (err == ENOENT || err == ESRCH) {
      if (ProcessHasExited(f.pid)) {
        return absl::UnavailableError(absl::StrCat(
            "host: Import: the exporter (pid ", f.pid,
            ") has exited, and its allocation went with it ", why));
      }
      return absl::NotFoundError(absl::StrCat("host: Import: stale handle: the exporter (pid ",
                                              f.pid, ") no longer holds the allocation ", why));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "host: Import: cannot reach the exporter's (pid ", f.pid, ") allocation ", why));
  };
  // stat() first so that nothing but the expected kind of file is ever opened (opening a
  // device or a FIFO could block).
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return unreachable("stat");
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_ino) != f.inode) {
    return released("is another file now");
  }
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (!fd.valid()) return unreachable("open");
  // The fd in the exporter may have changed between stat() and open(): check what we got.
  absl::StatusOr<FileIdentity> id = IdentifyMemfd(fd.get());
  if (!id.ok()) return released("is not a host driver allocation now");
  if (id->inode != f.inode || id->tag != f.tag) {
    return released("is another host driver allocation now (inode or tag differ)");
  }
  // The file the handle names, but not as the handle describes it: forged bytes.
  if (id->size != f.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host: Import: forged handle: it says ", f.size, " bytes, ", path, " has ", id->size));
  }
  if (absl::Status sealed = host::CheckSealed(fd.get()); !sealed.ok()) {
    return absl::Status(sealed.code(), absl::StrCat("host: Import: ", path, ": ",
                                                    sealed.message()));
  }
  return fd;
}

// --- Streams and events ---

absl::StatusOr<std::shared_ptr<HostStream>> HostDriver::FindStream(Stream stream) {
  MutexLock lock(&mu_);
  auto it = streams_.find(StreamHandle(stream));
  if (it == streams_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("host: unknown stream ", stream));
  }
  // A stream of the parent of this forked process: a queue and thread of the child's own.
  if (it->second == nullptr) it->second = std::make_shared<HostStream>();
  return it->second;
}

absl::StatusOr<std::shared_ptr<HostEvent>> HostDriver::FindEvent(Event event) {
  MutexLock lock(&mu_);
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("host: unknown event ", event));
  }
  return it->second;
}

absl::Status HostDriver::Submit(Stream stream, std::function<void()> work) {
  stream = StreamHandle(stream);
  if (stream == 0) {
    work();
    return absl::OkStatus();
  }
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<HostStream> s, FindStream(stream));
  if (!s->Enqueue(std::move(work))) {
    return absl::FailedPreconditionError(
        absl::StrCat("host: stream ", stream, " is being destroyed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Stream> HostDriver::CreateStream(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  auto stream = std::make_shared<HostStream>();
  MutexLock lock(&mu_);
  const Stream id = static_cast<Stream>(next_id_++);
  streams_.emplace(id, std::move(stream));
  return id;
}

absl::Status HostDriver::DestroyStream(Stream stream) {
  std::shared_ptr<HostStream> s;
  {
    MutexLock lock(&mu_);
    auto it = streams_.find(StreamHandle(stream));
    if (it == streams_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("host: DestroyStream: unknown stream ", stream));
    }
    s = std::move(it->second);
    streams_.erase(it);
    if (s == nullptr) return absl::OkStatus();  // the parent's, never used in this child
    // Until its queue is drained, SynchronizeDevice still waits for it (as CUDA's does).
    draining_.push_back(s);
  }
  s->Stop();  // drains the queue; the thread is joined when the last reference goes
  MutexLock lock(&mu_);
  draining_.erase(std::find(draining_.begin(), draining_.end(), s));
  return absl::OkStatus();
}

absl::Status HostDriver::SynchronizeStream(Stream stream) {
  stream = StreamHandle(stream);
  if (stream == 0) return absl::OkStatus();  // stream 0 work runs at once
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<HostStream> s, FindStream(stream));
  s->Synchronize();
  return absl::OkStatus();
}

absl::Status HostDriver::SynchronizeDevice(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  std::vector<std::shared_ptr<HostStream>> streams;
  {
    MutexLock lock(&mu_);
    for (auto& [id, stream] : streams_) {
      if (stream != nullptr) streams.push_back(stream);  // null: the parent's (see FindStream)
    }
    streams.insert(streams.end(), draining_.begin(), draining_.end());
  }
  for (auto& stream : streams) stream->Synchronize();
  return absl::OkStatus();
}

absl::StatusOr<Event> HostDriver::CreateEvent(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  MutexLock lock(&mu_);
  const Event id = static_cast<Event>(next_id_++);
  events_.emplace(id, std::make_shared<HostEvent>());
  return id;
}

absl::Status HostDriver::DestroyEvent(Event event) {
  MutexLock lock(&mu_);
  if (events_.erase(event) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("host: DestroyEvent: unknown event ", event));
  }
  return absl::OkStatus();  // a pending marker keeps its own reference
}

absl::Status HostDriver::RecordEvent(Event event, Stream stream) {
  stream = StreamHandle(stream);
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<HostEvent> e, FindEvent(event));
  if (stream != 0) VMM_RETURN_IF_ERROR(FindStream(stream).status());
  const uint64_t generation = e->Record();
  absl::Status status = Submit(stream, [e, generation] { e->Reach(generation); });
  // A stream destroyed in between leaves nothing to wait for: complete the event.
  if (!status.ok()) e->Reach(generation);
  return status;
}

absl::StatusOr<bool> HostDriver::EventDone(Event event) {
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<HostEvent> e, FindEvent(event));
  return e->Done();
}

absl::Status HostDriver::SynchronizeEvent(Event event) {
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<HostEvent> e, FindEvent(event));
  e->Wait();
  return absl::OkStatus();
}

absl::Status HostDriver::LaunchHostFunc(Stream stream, void (*fn)(void*), void* arg) {
  if (fn == nullptr) return absl::InvalidArgumentError("host: LaunchHostFunc: null function");
  return Submit(stream, [fn, arg] { fn(arg); });
}

absl::Status HostDriver::MemcpyAsync(DevPtr dst, DevPtr src, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == 0 || src == 0) return absl::InvalidArgumentError("host: MemcpyAsync: null address");
  return Submit(stream, [dst, src, bytes] { std::memmove(ToPointer(dst), ToPointer(src), bytes); });
}

absl::Status HostDriver::MemsetAsync(DevPtr dst, uint8_t value, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == 0) return absl::InvalidArgumentError("host: MemsetAsync: null address");
  return Submit(stream, [dst, value, bytes] { std::memset(ToPointer(dst), value, bytes); });
}

}  // namespace

std::unique_ptr<Driver> NewHostDriver(const HostDriverOptions& options) {
  RaiseOpenFileLimit();
  return std::make_unique<HostDriver>(options);
}

namespace {

// The process-wide host driver, made under a lock held across fork() (ForkLevel::kDriverInit)
// rather than as a function's static: a child forked while another thread makes it would find
// the static's initialisation under way for good, and hang.
ABSL_CONST_INIT Mutex host_driver_mu;
std::atomic<Driver*> host_driver{nullptr};
const bool host_driver_mu_held_across_fork = [] {
  AtForkForever(ForkLevel::kDriverInit, ForkHandlers::Lock(&host_driver_mu));
  return true;
}();

}  // namespace

Driver* GetHostDriver() {
  (void)host_driver_mu_held_across_fork;
  if (Driver* driver = host_driver.load(std::memory_order_acquire)) return driver;
  MutexLock lock(&host_driver_mu);
  Driver* driver = host_driver.load(std::memory_order_relaxed);
  if (driver == nullptr) {
    HostDriverOptions options;
    options.device_count = DeviceCountFromEnv();
    driver = NewHostDriver(options).release();  // lives until the process exits
    host_driver.store(driver, std::memory_order_release);
  }
  return driver;
}

}  // namespace vmm
