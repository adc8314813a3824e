// The C interface of vmm (vmm_c.h). Each function converts its arguments, calls the process's
// state (process_state.h) or the allocator library, and converts the result or the failure
// (stored per thread as a code and a message). No logic lives here.
#include "torch_plugin/vmm_c.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "allocator/byte_size.h"
#include "allocator/capture_window.h"
#include "allocator/descriptor.h"
#include "allocator/driver_error.h"
#include "allocator/driver_factory.h"
#include "allocator/log.h"
#include "allocator/pool_options.h"
#include "allocator/import_closer.h"
#include "allocator/send_acker.h"
#include "allocator/send_ledger.h"
#include "allocator/stats_json.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/process_state.h"

namespace vmm {
namespace {

// vmm_status_code mirrors absl::StatusCode value by value.
#define VMM_SAME_CODE(c, absl_name) \
  static_assert(c == static_cast<int>(absl::StatusCode::absl_name), #c " must mirror absl");
VMM_SAME_CODE(VMM_OK, kOk)
VMM_SAME_CODE(VMM_CANCELLED, kCancelled)
VMM_SAME_CODE(VMM_UNKNOWN, kUnknown)
VMM_SAME_CODE(VMM_INVALID_ARGUMENT, kInvalidArgument)
VMM_SAME_CODE(VMM_DEADLINE_EXCEEDED, kDeadlineExceeded)
VMM_SAME_CODE(VMM_NOT_FOUND, kNotFound)
VMM_SAME_CODE(VMM_ALREADY_EXISTS, kAlreadyExists)
VMM_SAME_CODE(VMM_PERMISSION_DENIED, kPermissionDenied)
VMM_SAME_CODE(VMM_RESOURCE_EXHAUSTED, kResourceExhausted)
VMM_SAME_CODE(VMM_FAILED_PRECONDITION, kFailedPrecondition)
VMM_SAME_CODE(VMM_ABORTED, kAborted)
VMM_SAME_CODE(VMM_OUT_OF_RANGE, kOutOfRange)
VMM_SAME_CODE(VMM_UNIMPLEMENTED, kUnimplemented)
VMM_SAME_CODE(VMM_INTERNAL, kInternal)
VMM_SAME_CODE(VMM_UNAVAILABLE, kUnavailable)
VMM_SAME_CODE(VMM_DATA_LOSS, kDataLoss)
VMM_SAME_CODE(VMM_UNAUTHENTICATED, kUnauthenticated)
#undef VMM_SAME_CODE
static_assert(VMM_HANDLE_POSIX_FD == static_cast<int>(HandleType::kPosixFd) &&
                  VMM_HANDLE_FABRIC == static_cast<int>(HandleType::kFabric) &&
                  VMM_HANDLE_NONE == static_cast<int>(HandleType::kNone),
              "vmm_handle_type must mirror HandleType");
static_assert(VMM_BACKEND_CUDA == static_cast<int>(Backend::kCuda) &&
                  VMM_BACKEND_HOST == static_cast<int>(Backend::kHost),
              "vmm_backend must mirror Backend");
static_assert(VMM_HANDLE_BYTES == kDescriptorHandleSize, "handle size");

// This thread's last failure. A thread's thread_local objects are destroyed before it ends,
// and those of the thread that calls exit() before the process's atexit handlers and static
// destructors, which may still call in (a storage freed by a library's static destructor):
// from then on only the code is kept, in a trivially destructible variable (the last one
// recorded first), and the message is a fixed text. Writing to the destroyed string freed
// its buffer twice.
thread_local bool last_error_gone = false;
thread_local int last_error_code_after = VMM_OK;
thread_local int32_t last_driver_error_after = 0;
constexpr char kMessageGone[] =
    "(no message: the failure came after this thread's records were destroyed at its exit)";

struct LastError {
  int code = VMM_OK;
  int32_t driver_error = 0;  // the CUresult behind it (driver_error.h), or 0
  std::string message;
  ~LastError() {
    last_error_code_after = code;
    last_driver_error_after = driver_error;
    last_error_gone = true;
  }
};
thread_local LastError last_error;

int Fail(const absl::Status& status) {
  if (last_error_gone) {
    last_error_code_after = static_cast<int>(status.code());
    last_driver_error_after = DriverErrorOf(status);
    return -1;
  }
  last_error.code = static_cast<int>(status.code());
  last_error.driver_error = DriverErrorOf(status);
  last_error.message = std::string(status.message());
  return -1;
}
template <typename T>
T* FailNull(const absl::Status& status) {
  Fail(status);
  return nullptr;
}
int Check(const absl::Status& status) { return status.ok() ? 0 : Fail(status); }

absl::Status NoMemoryFor(size_t bytes) {
  return absl::ResourceExhaustedError(
      absl::StrCat("no host memory for the ", bytes, " bytes of the result"));
}

// A malloc'd copy (released with vmm_release_buffer); NULL, with the error set, if the host
// has no memory for it.
char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) return FailNull<char>(NoMemoryFor(s.size() + 1));
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

int CopyBytes(const std::string& bytes, uint8_t** out, size_t* out_len) {
  *out = static_cast<uint8_t*>(std::malloc(bytes.empty() ? 1 : bytes.size()));
  if (*out == nullptr) return Fail(NoMemoryFor(bytes.size()));
  std::memcpy(*out, bytes.data(), bytes.size());
  *out_len = bytes.size();
  return 0;
}

absl::string_view Text(const char* s) { return s == nullptr ? absl::string_view() : s; }

// A vmm_backend argument: nullopt for VMM_BACKEND_DEFAULT.
absl::StatusOr<std::optional<Backend>> BackendArg(int backend) {
  switch (backend) {
    case VMM_BACKEND_DEFAULT:
      return std::nullopt;
    case VMM_BACKEND_CUDA:
      return Backend::kCuda;
    case VMM_BACKEND_HOST:
      return Backend::kHost;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "backend ", backend, " is not VMM_BACKEND_DEFAULT, VMM_BACKEND_CUDA or "
          "VMM_BACKEND_HOST"));
  }
}

static_assert(VMM_BLOCK_INACTIVE == static_cast<int>(TorchBlockState::kInactive) &&
                  VMM_BLOCK_ACTIVE_ALLOCATED ==
                      static_cast<int>(TorchBlockState::kActiveAllocated) &&
                  VMM_BLOCK_ACTIVE_PENDING_FREE ==
                      static_cast<int>(TorchBlockState::kActivePendingFree),
              "vmm_block_state must mirror TorchBlockState");
// PyTorch's DeviceStats: 9 statistics of 3 kinds, 5 counters, 2 oversize statistics, one size.
static_assert(sizeof(vmm_stat) == 32 && sizeof(vmm_torch_stats) == (9 * 3 + 2) * 32 + 6 * 8,
              "vmm_torch_stats layout");
static_assert(sizeof(vmm_block_entry) == 40 && sizeof(vmm_segment_entry) == 8 * 8 + 24 + 16,
              "vmm_block_entry / vmm_segment_entry layout (vmm_torch/_signatures.py mirrors it)");

// PoolStats as PyTorch's DeviceStats: the fields stats.h's lists name, of the pool in
// [VMM_STAT_ALL] and of its small and large arenas in [VMM_STAT_SMALL] and [VMM_STAT_LARGE].
vmm_torch_stats TorchStats(const PoolStats& stats) {
  vmm_torch_stats out{};
  auto put = [](const Stat& all, const Stat& small, const Stat& large,
                vmm_stat (&to)[VMM_STAT_TYPES]) {
    auto value = [](const Stat& s) { return vmm_stat{s.current, s.peak, s.allocated, s.freed}; };
    to[VMM_STAT_ALL] = value(all);
    to[VMM_STAT_SMALL] = value(small);
    to[VMM_STAT_LARGE] = value(large);
  };
#define VMM_PUT_STAT(name) \
  put(stats.name, stats.arena[kSmallArena].name, stats.arena[kLargeArena].name, out.name);
  VMM_TORCH_STATS(VMM_PUT_STAT)
#undef VMM_PUT_STAT
#define VMM_PUT_COUNTER(name) out.name = stats.name;
  VMM_TORCH_COUNTERS(VMM_PUT_COUNTER)
#undef VMM_PUT_COUNTER
  out.max_split_size = -1;
  return out;
}

static_assert(VMM_FOREIGN_STREAM_BIT == kForeignStreamBit, "one foreign-stream mark");

// A stream as the snapshot structs carry it: 0 for a free block any stream may take.
uint64_t StreamValue(Stream stream) {
  return stream == kAnyStream ? 0 : static_cast<uint64_t>(stream);
}

std::string StatsDocument(const PoolStats& stats) {
  nlohmann::json doc;
  doc["vmm"] = StatsToJson(stats);
  doc["torch"] = TorchMemoryStats(stats);
  return doc.dump();
}

ProcessState& State() { return ProcessState::Get(); }

}  // namespace
}  // namespace vmm

using vmm::State;

extern "C" {

int vmm_last_error_code(void) {
  return vmm::last_error_gone ? vmm::last_error_code_after : vmm::last_error.code;
}

int vmm_last_driver_error(void) {
  return vmm::last_error_gone ? vmm::last_driver_error_after : vmm::last_error.driver_error;
}

const char* vmm_last_error(void) {
  return vmm::last_error_gone ? vmm::kMessageGone : vmm::last_error.message.c_str();
}

int vmm_default_backend(void) {
  absl::StatusOr<vmm::Driver*> driver = vmm::DefaultDriver();
  if (!driver.ok()) return VMM_BACKEND_HOST;
  return static_cast<int>((*driver)->backend());
}

void vmm_release_buffer(void* buffer) { std::free(buffer); }

int vmm_parse_byte_size(const char* text, uint64_t* out) {
  if (text == nullptr || out == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_parse_byte_size: null argument"));
  }
  absl::StatusOr<uint64_t> n = vmm::ParseByteSize(text);
  if (!n.ok()) return vmm::Fail(n.status());
  *out = *n;
  return 0;
}

int vmm_check_pool_options(const char* options) {
  absl::StatusOr<vmm::PoolOptions> parsed = vmm::ParsePoolOptions(vmm::Text(options));
  if (!parsed.ok()) return vmm::Fail(parsed.status());
  // As a private pool takes them (a MemPool's, whose blocks may be exported).
  return vmm::Check(vmm::CheckPoolOptions(*parsed, /*exportable=*/true));
}

int vmm_configure(const char* options) {
  return vmm::Check(State().Configure(vmm::Text(options)));
}

void* vmm_alloc(size_t size, int device, void* stream) {
  absl::StatusOr<void*> p =
      State().DeviceAllocate(device, size, reinterpret_cast<vmm::Stream>(stream));
  if (!p.ok()) return vmm::FailNull<void>(p.status());
  return *p;
}

int vmm_free(void* ptr, int device) {
  if (ptr == nullptr) return 0;
  // A send holds it: freed at its release (or a second free of it, refused).
  if (std::optional<absl::Status> deferred = State().DeferFreeIfHeld(ptr)) {
    return vmm::Check(*deferred);
  }
  vmm::Pool* pool = device >= 0 ? State().DevicePoolIfAny(device) : nullptr;
  if (pool != nullptr && pool->Contains(ptr)) return vmm::Check(pool->Free(ptr));
  return vmm::Check(State().FreeBlock(ptr));
}

int vmm_record_stream(void* ptr, void* stream) {
  vmm::ProcessState::PoolRef owner = State().Owner(ptr);
  if (owner.pool == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("record_stream: not a vmm block"));
  }
  return vmm::Check(owner.pool->RecordStream(ptr, reinterpret_cast<vmm::Stream>(stream)));
}

int vmm_empty_cache(int device) {
  if (device >= 0) {
    if (absl::Status s = vmm::ProcessState::CheckDevice(device); !s.ok()) return vmm::Fail(s);
  }
  const std::vector<vmm::ProcessState::PoolRef> pools =
      device >= 0 ? State().DevicePools(device) : State().AllPools();
  for (const vmm::ProcessState::PoolRef& p : pools) {
    if (absl::Status s = p.pool->EmptyCache(); !s.ok()) return vmm::Fail(s);
  }
  return 0;
}

int vmm_set_memory_fraction(double fraction, int device) {
  return vmm::Check(State().SetMemoryFraction(fraction, device));
}

int vmm_device_hold(int device, int64_t delta) {
  return vmm::Check(State().HoldExternal(device, delta));
}

int vmm_device_hold_allocated(int device, int64_t delta) {
  return vmm::Check(State().CountExternalAllocated(device, delta));
}

char* vmm_stats_json(int device) {
  return vmm::CopyString(vmm::StatsDocument(State().DeviceStats(device)));
}

int vmm_reset_peak_stats(int device) {
  State().ResetDevicePeaks(device);
  return 0;
}

int vmm_reset_accumulated_stats(int device) {
  State().ResetDeviceAccumulated(device);
  return 0;
}

char* vmm_snapshot_json(void) {
  const std::vector<vmm::Snapshot> snaps = State().Snapshots();
  nlohmann::json pools = nlohmann::json::array();
  for (const vmm::Snapshot& snap : snaps) pools.push_back(vmm::SnapshotToJson(snap));
  nlohmann::json doc = vmm::TorchSnapshot(snaps);
  doc["vmm_pools"] = std::move(pools);
  return vmm::CopyString(doc.dump());
}

int64_t vmm_pool_create(int backend, int device, const char* options) {
  absl::StatusOr<std::optional<vmm::Backend>> b = vmm::BackendArg(backend);
  if (!b.ok()) return vmm::Fail(b.status());
  vmm::Backend which = vmm::Backend::kHost;
  if (b->has_value()) {
    which = **b;
  } else {
    absl::StatusOr<vmm::Driver*> driver = vmm::DefaultDriver();
    if (!driver.ok()) return vmm::Fail(driver.status());
    which = (*driver)->backend();
  }
  absl::StatusOr<int64_t> id = State().CreatePool(which, device, vmm::Text(options));
  return id.ok() ? *id : vmm::Fail(id.status());
}

int vmm_pool_destroy(int64_t pool) { return vmm::Check(State().ClosePool(pool)); }

void* vmm_pool_alloc(int64_t pool, size_t size, void* stream, int shareable) {
  absl::StatusOr<void*> ptr =
      State().PoolAllocate(pool, size, reinterpret_cast<vmm::Stream>(stream), shareable != 0);
  return ptr.ok() ? *ptr : vmm::FailNull<void>(ptr.status());
}

int vmm_pool_empty_cache(int64_t pool) {
  auto entry = State().FindPool(pool);
  if (!entry.ok()) return vmm::Fail(entry.status());
  return vmm::Check((*entry)->pool->EmptyCache());
}

int vmm_pool_set_no_split(int64_t pool) {
  auto entry = State().FindPool(pool);
  if (!entry.ok()) return vmm::Fail(entry.status());
  return vmm::Check((*entry)->pool->SetNoSplit());
}

char* vmm_pool_stats_json(int64_t pool) {
  auto entry = State().FindPool(pool);
  if (!entry.ok()) return vmm::FailNull<char>(entry.status());
  return vmm::CopyString(vmm::StatsDocument((*entry)->pool->GetStats()));
}

int vmm_pool_handle_type(int64_t pool) {
  auto entry = State().FindPool(pool);
  if (!entry.ok()) return vmm::Fail(entry.status());
  return static_cast<int>((*entry)->pool->handle_type());
}

int vmm_pool_device(int64_t pool) {
  auto entry = State().FindPool(pool);
  if (!entry.ok()) {
    vmm::Fail(entry.status());
    return -2;
  }
  const vmm::Pool& p = *(*entry)->pool;
  return p.driver()->backend() == vmm::Backend::kHost ? -1 : p.device();
}

void vmm_block_free(void* ptr) {
  if (ptr == nullptr) return;  // as free(NULL)
  absl::Status s = State().FreeBlock(ptr);
  if (!s.ok()) vmm::LogError(s.message());
}

int vmm_owns(const void* ptr) { return State().Owner(ptr).pool != nullptr ? 1 : 0; }

int vmm_device_torch_stats(int device, vmm_torch_stats* out) {
  if (out == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_device_torch_stats: null output"));
  }
  *out = vmm::TorchStats(State().DeviceStats(device));
  return 0;
}

int vmm_device_usage(int device, int64_t* allocated, int64_t* reserved) {
  if (allocated == nullptr || reserved == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_device_usage: null output"));
  }
  const vmm::ProcessState::Usage usage = State().DeviceUsage(device);
  *allocated = usage.allocated;
  *reserved = usage.reserved;
  return 0;
}

uint64_t vmm_thread_growths(void) { return vmm::Pool::ThreadGrowths(); }

int vmm_set_mapping_callback(vmm_mapping_fn fn, void* ctx) {
  // Kept for the life of the process: a pool may still be calling the one replaced.
  class Callback : public vmm::MappingListener {
   public:
    Callback(vmm_mapping_fn fn, void* ctx) : fn_(fn), ctx_(ctx) {}
    Callback* next = nullptr;  // the one made before (`kept` below)
    void RangeMapped(const vmm::MappingSource& source, uintptr_t addr, size_t size,
                     bool mapped) override {
      vmm_mapping_event event{};
      event.device = source.device;
      event.mempool_id[0] = source.owner[0];
      event.mempool_id[1] = source.owner[1];
      event.address = addr;
      event.size = size;
      event.mapped = mapped ? 1 : 0;
      fn_(&event, ctx_);
    }

   private:
    const vmm_mapping_fn fn_;
    void* const ctx_;
  };
  if (fn == nullptr) {
    State().TellMappingsTo(nullptr);
    return 0;
  }
  // Every callback made stays on this list, never destroyed: reachable, so not a leak to
  // LeakSanitizer, though none is freed. A list without a lock: nothing to hold across fork().
  static std::atomic<Callback*> kept{nullptr};
  auto* callback = new Callback(fn, ctx);
  callback->next = kept.load();
  while (!kept.compare_exchange_weak(callback->next, callback)) {
  }
  State().TellMappingsTo(callback);
  return 0;
}

int vmm_device_largest_free_block(int device, uint64_t* out) {
  if (out == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_device_largest_free_block: null output"));
  }
  *out = static_cast<uint64_t>(State().DeviceStats(device).largest_free_block);
  return 0;
}

int vmm_pool_torch_stats(int64_t pool, vmm_torch_stats* out) {
  if (out == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_pool_torch_stats: null output"));
  }
  auto entry = State().FindPool(pool);
  if (!entry.ok()) return vmm::Fail(entry.status());
  *out = vmm::TorchStats((*entry)->pool->GetStats());
  return 0;
}

int vmm_snapshot_get(vmm_snapshot_entries** out) {
  if (out == nullptr) return vmm::Fail(absl::InvalidArgumentError("vmm_snapshot_get: null output"));
  const std::vector<vmm::Snapshot> snaps = State().Snapshots();
  size_t count = 0;
  for (const vmm::Snapshot& snap : snaps) count += snap.segments.size();
  auto* entries = static_cast<vmm_snapshot_entries*>(std::calloc(1, sizeof(vmm_snapshot_entries)));
  if (entries == nullptr) return vmm::Fail(absl::ResourceExhaustedError("vmm_snapshot_get"));
  entries->segments =
      static_cast<vmm_segment_entry*>(std::calloc(count + 1, sizeof(vmm_segment_entry)));
  if (entries->segments == nullptr) {
    std::free(entries);
    return vmm::Fail(absl::ResourceExhaustedError("vmm_snapshot_get"));
  }
  for (const vmm::Snapshot& snap : snaps) {
    for (const vmm::SegmentInfo& seg : snap.segments) {
      const vmm::TorchSegmentTotals totals = vmm::TorchSegmentSummary(seg);
      vmm_segment_entry& e = entries->segments[entries->num_segments++];
      e.device = snap.device;
      e.pool = snap.pool_id;
      e.address = seg.addr;
      e.total_size = seg.size;
      e.allocated_size = totals.allocated;
      e.active_size = totals.active;
      e.requested_size = totals.requested;
      e.stream = static_cast<uint64_t>(totals.stream);
      e.is_large = seg.large ? 1 : 0;
      e.mempool_id[0] = snap.mempool_id[0];
      e.mempool_id[1] = snap.mempool_id[1];
      e.blocks = static_cast<vmm_block_entry*>(
          std::calloc(seg.blocks.size() + 1, sizeof(vmm_block_entry)));
      if (e.blocks == nullptr) {
        vmm_snapshot_entries_release(entries);
        return vmm::Fail(absl::ResourceExhaustedError("vmm_snapshot_get"));
      }
      for (const vmm::BlockInfo& b : seg.blocks) {
        vmm_block_entry& be = e.blocks[e.num_blocks++];
        be.address = b.addr;
        be.size = b.size;
        be.requested_size = vmm::TorchRequestedSize(b);
        be.stream = vmm::StreamValue(b.stream);
        be.state = static_cast<int>(vmm::TorchStateOf(b.state));
      }
    }
  }
  *out = entries;
  return 0;
}

void vmm_snapshot_entries_release(vmm_snapshot_entries* snapshot) {
  if (snapshot == nullptr) return;
  for (size_t i = 0; i < snapshot->num_segments; ++i) std::free(snapshot->segments[i].blocks);
  std::free(snapshot->segments);
  std::free(snapshot);
}

int64_t vmm_private_pool_use(int backend, int device, uint64_t id0, uint64_t id1,
                             const char* options) {
  absl::StatusOr<std::optional<vmm::Backend>> b = vmm::BackendArg(backend);
  if (!b.ok()) return vmm::Fail(b.status());
  absl::StatusOr<int64_t> id = State().UsePrivatePool(*b, device, id0, id1, vmm::Text(options));
  return id.ok() ? *id : vmm::Fail(id.status());
}

int vmm_private_pool_release(int device, uint64_t id0, uint64_t id1) {
  absl::StatusOr<int> left = State().ReleasePrivatePool(device, id0, id1);
  return left.ok() ? *left : vmm::Fail(left.status());
}

int vmm_private_pool_use_count(int device, uint64_t id0, uint64_t id1) {
  return State().PrivatePoolUses(device, id0, id1);
}

int64_t vmm_private_pool_find(int device, uint64_t id0, uint64_t id1) {
  absl::StatusOr<int64_t> id = State().FindPrivatePool(device, id0, id1);
  return id.ok() ? *id : vmm::Fail(id.status());
}

int64_t vmm_pool_live_blocks(int64_t pool, vmm_block_entry* out, size_t cap) {
  if (out == nullptr && cap > 0) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_pool_live_blocks: null output"));
  }
  absl::StatusOr<std::vector<vmm::BlockInfo>> blocks = State().PoolLiveBlocks(pool);
  if (!blocks.ok()) return vmm::Fail(blocks.status());
  for (size_t i = 0; i < std::min(cap, blocks->size()); ++i) {
    const vmm::BlockInfo& b = (*blocks)[i];
    out[i] = vmm_block_entry{b.addr, b.size, vmm::TorchRequestedSize(b),
                             vmm::StreamValue(b.stream),
                             static_cast<int>(vmm::TorchStateOf(b.state))};
  }
  return static_cast<int64_t>(blocks->size());
}

void* vmm_pool_alloc_at(int64_t pool, uint64_t addr, size_t size, void* stream) {
  absl::StatusOr<void*> ptr = State().PoolAllocateAt(pool, static_cast<uintptr_t>(addr), size,
                                                     reinterpret_cast<vmm::Stream>(stream));
  return ptr.ok() ? *ptr : vmm::FailNull<void>(ptr.status());
}

int vmm_export(const void* ptr, uint8_t** out, size_t* out_len) {
  if (out == nullptr || out_len == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_export: null output"));
  }
  absl::StatusOr<vmm::BufferDescriptor> d = State().Export(ptr);
  if (!d.ok()) return vmm::Fail(d.status());
  return vmm::CopyBytes(d->Encode(), out, out_len);
}

namespace {
// Seconds from C as a duration: NaN and negative as zero, huge ones capped.
absl::Duration Timeout(double seconds) {
  return seconds > 0 ? absl::Seconds(std::min(seconds, 1e9)) : absl::ZeroDuration();
}
}  // namespace

namespace {
int SendKindCode(vmm::ProcessState::SendKind kind) {
  switch (kind) {
    case vmm::ProcessState::SendKind::kNotVmm: return VMM_SEND_NOT_VMM;
    case vmm::ProcessState::SendKind::kInPlace: return VMM_SEND_IN_PLACE;
    case vmm::ProcessState::SendKind::kRelocate: return VMM_SEND_RELOCATE;
    case vmm::ProcessState::SendKind::kImport: return VMM_SEND_IMPORT;
    case vmm::ProcessState::SendKind::kNotExportable: return VMM_SEND_NOT_EXPORTABLE;
  }
  return VMM_SEND_NOT_VMM;
}
}  // namespace

int vmm_send_kind(const void* ptr) { return SendKindCode(State().KindOfSend(ptr)); }

int vmm_send_prepare(const void* ptr) { return SendKindCode(State().PrepareSend(ptr)); }

void* vmm_alloc_beside(const void* ptr, size_t size, void* stream) {
  absl::StatusOr<void*> block =
      State().AllocateBeside(ptr, size, reinterpret_cast<vmm::Stream>(stream));
  if (!block.ok()) {
    vmm::Fail(block.status());
    return nullptr;
  }
  return *block;
}

int vmm_export_send(const void* ptr, uint8_t** out, size_t* out_len, uint8_t* ticket) {
  if (out == nullptr || out_len == nullptr || ticket == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_export_send: null output"));
  }
  absl::StatusOr<vmm::ProcessState::Send> send = State().ExportSend(ptr);
  if (!send.ok()) return vmm::Fail(send.status());
  std::memcpy(ticket, send->ticket.data(), send->ticket.size());
  return vmm::CopyBytes(send->descriptor.Encode(), out, out_len);
}

int vmm_send_ack(const uint8_t* ticket, size_t len) {
  if (ticket == nullptr) return vmm::Fail(absl::InvalidArgumentError("null ticket"));
  return vmm::Check(vmm::AckSend(absl::MakeConstSpan(ticket, len)));
}

int vmm_send_cancel(const uint8_t* ticket, size_t len) {
  if (ticket == nullptr) return vmm::Fail(absl::InvalidArgumentError("null ticket"));
  return vmm::Check(vmm::CancelSend(absl::MakeConstSpan(ticket, len)));
}

int64_t vmm_send_thread_token(void) { return vmm::SendLedger::ThreadToken(); }

int64_t vmm_send_withdraw_token(int64_t thread_token) {
  return static_cast<int64_t>(vmm::SendLedger::Get().WithdrawMadeBy(thread_token));
}

int64_t vmm_send_held_except(const int64_t* thread_tokens, size_t count) {
  if (thread_tokens == nullptr && count != 0) {
    return vmm::Fail(absl::InvalidArgumentError("null thread tokens with a count"));
  }
  return static_cast<int64_t>(vmm::SendLedger::Get().HeldNotMadeBy(
      absl::MakeConstSpan(thread_tokens, count)));
}

int vmm_send_ack_later(const uint8_t* ticket, size_t len) {
  if (ticket == nullptr || len != VMM_TICKET_BYTES) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("a send's ticket has ", VMM_TICKET_BYTES, " bytes, not ", len)));
  }
  vmm::SendLedger::Ticket t;
  std::memcpy(t.data(), ticket, t.size());
  vmm::AckSendLater(t);
  return 0;
}

int vmm_send_received(int64_t import_id, const uint8_t* ticket, size_t len) {
  if (ticket == nullptr || len != VMM_TICKET_BYTES) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("a send's ticket has ", VMM_TICKET_BYTES, " bytes, not ", len)));
  }
  vmm::SendLedger::Ticket t;
  std::memcpy(t.data(), ticket, t.size());
  vmm::ProcessState::Get().ReceivedSend(import_id, t);
  return 0;
}

int vmm_send_check(const uint8_t* ticket, size_t len) {
  if (ticket == nullptr || len != VMM_TICKET_BYTES) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("a send's ticket has ", VMM_TICKET_BYTES, " bytes, not ", len)));
  }
  vmm::SendLedger::Ticket t;
  std::memcpy(t.data(), ticket, t.size());
  return vmm::Check(State().CheckSendNotReleased(t));
}

int64_t vmm_send_ack_flush(double timeout_seconds) {
  // Imports closed first: their release reports join the acknowledgements' queue.
  const absl::Time deadline = absl::Now() + Timeout(timeout_seconds);
  vmm::FlushCloses(deadline - absl::Now());
  return static_cast<int64_t>(vmm::FlushAcks(std::max(deadline - absl::Now(),
                                                      absl::ZeroDuration())));
}

int vmm_imports_hold_closing(void) {
  vmm::OpenCaptureWindow();
  vmm::HoldCloses();
  return 0;
}

int vmm_imports_release_closing(void) {
  vmm::ReleaseCloses();
  vmm::CloseCaptureWindow();
  return 0;
}

int vmm_send_set_lease(double seconds) {
  // (A value that rounds to no time at all, below absl's quarter nanosecond, would be kept
  // out by SetLease with only a log line: refused here.)
  if (!(seconds > 0) || seconds > 1e9 || absl::Seconds(seconds) <= absl::ZeroDuration()) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("a send's lease is a number of seconds, at least a quarter of a "
                     "nanosecond and at most 1e9, not ",
                     seconds)));
  }
  vmm::SendLedger::Get().SetLease(absl::Seconds(seconds));
  return 0;
}

int vmm_send_stats_get(vmm_send_stats* out) {
  if (out == nullptr) return vmm::Fail(absl::InvalidArgumentError("null output"));
  const vmm::SendLedger::Stats stats = vmm::SendLedger::Get().GetStats();
  out->held = stats.held;
  out->held_bytes = stats.held_bytes;
  out->peak_held_bytes = stats.peak_held_bytes;
  out->holds = stats.holds;
  out->acked = stats.acked;
  out->expired = stats.expired;
  out->awaiting_release = stats.awaiting_release;
  out->released = stats.released;
  out->lease_seconds = absl::ToDoubleSeconds(vmm::SendLedger::Get().lease());
  return 0;
}

int vmm_send_set_budget(int64_t bytes) {
  if (bytes < 0) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("a send budget is a number of bytes >= 0, not ", bytes)));
  }
  State().SetSendBudget(static_cast<uint64_t>(bytes));
  return 0;
}

int vmm_send_over_budget(void) { return State().OverSendBudget() ? 1 : 0; }

int vmm_send_wait_for_room(double stall_seconds) {
  return State().WaitForSendRoom(Timeout(stall_seconds)) ? 1 : 0;
}

int64_t vmm_send_wait(double timeout_seconds) {
  return static_cast<int64_t>(vmm::SendLedger::Get().WaitUntilEmpty(Timeout(timeout_seconds)));
}

int64_t vmm_import(const uint8_t* descriptor, size_t len, int device, int backend, int pidfd) {
  if (descriptor == nullptr) return vmm::Fail(absl::InvalidArgumentError("null descriptor"));
  absl::StatusOr<std::optional<vmm::Backend>> b = vmm::BackendArg(backend);
  if (!b.ok()) return vmm::Fail(b.status());
  absl::StatusOr<int64_t> id = State().Import(
      absl::string_view(reinterpret_cast<const char*>(descriptor), len), device, *b, pidfd != 0);
  return id.ok() ? *id : vmm::Fail(id.status());
}

int vmm_import_info(int64_t import_id, uint64_t* ptr, size_t* size, int* device) {
  if (ptr == nullptr || size == nullptr || device == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_import_info: null output"));
  }
  absl::StatusOr<vmm::ProcessState::ImportInfo> info = State().GetImportInfo(import_id);
  if (!info.ok()) return vmm::Fail(info.status());
  *ptr = info->ptr;
  *size = info->size;
  *device = info->device;
  return 0;
}

int vmm_import_retain(int64_t import_id) {
  return vmm::Check(State().AddImportRef(import_id, +1));
}

void vmm_import_release(void* import_id) {
  absl::Status s = State().AddImportRef(reinterpret_cast<int64_t>(import_id), -1);
  if (!s.ok()) vmm::LogError(s.message());
}

int vmm_descriptor_decode(const uint8_t* descriptor, size_t len, vmm_descriptor_fields* out) {
  if (descriptor == nullptr || out == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_descriptor_decode: null argument"));
  }
  *out = vmm_descriptor_fields{};
  absl::StatusOr<vmm::BufferDescriptor> d = vmm::BufferDescriptor::Decode(
      absl::string_view(reinterpret_cast<const char*>(descriptor), len));
  if (!d.ok()) return vmm::Fail(d.status());
  const size_t count = d->handles().size();
  out->handle_type = static_cast<int32_t>(d->handle_type());
  out->backend = d->backend().has_value() ? static_cast<int32_t>(*d->backend()) : 0;
  out->count = count;
  out->size = d->size();
  out->offset = d->offset();
  out->handles = static_cast<uint8_t*>(std::malloc(count * VMM_HANDLE_BYTES + 1));
  out->sizes = static_cast<uint64_t*>(std::malloc(count * sizeof(uint64_t) + 1));
  if (out->handles == nullptr || out->sizes == nullptr) {
    vmm_descriptor_fields_release(out);
    return vmm::Fail(vmm::NoMemoryFor(count * (VMM_HANDLE_BYTES + sizeof(uint64_t))));
  }
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(out->handles + i * VMM_HANDLE_BYTES, d->handles()[i].data(), VMM_HANDLE_BYTES);
    out->sizes[i] = d->sizes()[i];
  }
  if (d->owner_uuid().has_value()) {
    const std::string& owner = *d->owner_uuid();
    out->owner_uuid = static_cast<char*>(std::malloc(owner.size() + 1));
    if (out->owner_uuid == nullptr) {
      vmm_descriptor_fields_release(out);
      return vmm::Fail(vmm::NoMemoryFor(owner.size() + 1));
    }
    std::memcpy(out->owner_uuid, owner.data(), owner.size());
    out->owner_uuid[owner.size()] = '\0';
    out->owner_uuid_len = owner.size();
  }
  return 0;
}

void vmm_descriptor_fields_release(vmm_descriptor_fields* fields) {
  if (fields == nullptr) return;
  std::free(fields->handles);
  std::free(fields->sizes);
  std::free(fields->owner_uuid);
  *fields = vmm_descriptor_fields{};
}

int vmm_descriptor_from_handles(int handle_type, const uint8_t* const* handles,
                                const size_t* handle_lens, const int64_t* sizes, size_t count,
                                int64_t size, const char* owner, int64_t offset, uint8_t** out,
                                size_t* out_len) {
  if (out == nullptr || out_len == nullptr ||
      (count > 0 && (handles == nullptr || handle_lens == nullptr || sizes == nullptr))) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_descriptor_from_handles: null argument"));
  }
  if (handle_type != VMM_HANDLE_POSIX_FD && handle_type != VMM_HANDLE_FABRIC) {
    return vmm::Fail(absl::InvalidArgumentError(absl::StrCat(
        "handle type ", handle_type, " is not VMM_HANDLE_POSIX_FD (1) or VMM_HANDLE_FABRIC (2)")));
  }
  // (The encoding counts handles in 32 bits: more is refused before any copy.)
  if (count > std::numeric_limits<uint32_t>::max()) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("vmm_descriptor_from_handles: ", count,
                     " handles do not fit the encoding's 32-bit count")));
  }
  // The copies below may need more host memory than there is: an error, not an exception
  // through the C interface.
  try {
    std::vector<std::string> h;
    for (size_t i = 0; i < count; ++i) {
      if (handles[i] == nullptr) {
        return vmm::Fail(absl::InvalidArgumentError(
            absl::StrCat("vmm_descriptor_from_handles: handle ", i, " is a null pointer")));
      }
      // (Checked before the copy, with FromHandles' message: a longer length would read
      // past the caller's handle.)
      if (handle_lens[i] != VMM_HANDLE_BYTES) {
        return vmm::Fail(absl::InvalidArgumentError(absl::StrCat(
            "handle ", i, " is ", handle_lens[i], " bytes, expected ", VMM_HANDLE_BYTES)));
      }
      h.emplace_back(reinterpret_cast<const char*>(handles[i]), handle_lens[i]);
    }
    std::vector<int64_t> s(sizes, sizes + count);
    absl::StatusOr<vmm::BufferDescriptor> d = vmm::BufferDescriptor::FromHandles(
        static_cast<vmm::HandleType>(handle_type), h, s,
        size < 0 ? std::nullopt : std::optional<int64_t>(size),
        owner == nullptr ? std::nullopt : std::optional<std::string>(owner), offset);
    if (!d.ok()) return vmm::Fail(d.status());
    return vmm::CopyBytes(d->Encode(), out, out_len);
  } catch (const std::bad_alloc&) {
    return vmm::Fail(absl::ResourceExhaustedError(absl::StrCat(
        "vmm_descriptor_from_handles: no host memory for ", count, " handles")));
  }
}

}  // extern "C"
