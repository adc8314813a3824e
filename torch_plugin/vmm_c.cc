// The C interface of vmm (vmm_c.h): process-wide pools, imports and descriptors.
#include "torch_plugin/vmm_c.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "allocator/descriptor.h"
#include "allocator/driver_factory.h"
#include "allocator/host_driver.h"
#include "allocator/log.h"
#include "allocator/mutex.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "allocator/stats_json.h"
#include "allocator/status_macros.h"
#include "nlohmann/json.hpp"

namespace vmm {
namespace {

constexpr int kMaxDevices = 64;

thread_local std::string last_error;

int Fail(const absl::Status& status) {
  last_error = status.ToString();
  return -1;
}
template <typename T>
T* FailNull(const absl::Status& status) {
  last_error = status.ToString();
  return nullptr;
}

char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// --- Options -------------------------------------------------------------------------------

absl::StatusOr<size_t> ParseSize(absl::string_view key, absl::string_view value) {
  value = absl::StripAsciiWhitespace(value);
  uint64_t scale = 1;
  if (!value.empty()) {
    switch (absl::ascii_toupper(value.back())) {
      case 'K': scale = uint64_t{1} << 10; break;
      case 'M': scale = uint64_t{1} << 20; break;
      case 'G': scale = uint64_t{1} << 30; break;
      case 'T': scale = uint64_t{1} << 40; break;
      default: break;
    }
    if (scale != 1) value.remove_suffix(1);
  }
  uint64_t n = 0;
  if (!absl::SimpleAtoi(value, &n) || (n != 0 && n > UINT64_MAX / scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("option ", key, ": '", value, "' is not a size in bytes (e.g. 512M)"));
  }
  return static_cast<size_t>(n * scale);
}

absl::Status ApplyOption(absl::string_view key, absl::string_view value, PoolOptions& o) {
  if (key == "handle_type") {
    const std::optional<HandleRequest> request = ParseHandleRequest(value);
    if (!request) {
      return absl::InvalidArgumentError(absl::StrCat(
          "option handle_type: '", value, "' is not one of auto, none, posix_fd, fabric"));
    }
    o.handle_type = *request;
    return absl::OkStatus();
  }
  if (key == "growth_fraction") {
    double f;
    if (!absl::SimpleAtod(value, &f) || !(f >= 0 && f <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("option growth_fraction: '", value, "' is not a number in [0, 1]"));
    }
    o.growth_fraction = f;
    return absl::OkStatus();
  }
  if (key == "peer_devices") {
    o.peer_devices.clear();
    for (absl::string_view d : absl::StrSplit(value, ':', absl::SkipEmpty())) {
      int device;
      if (!absl::SimpleAtoi(d, &device) || device < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("option peer_devices: '", d, "' is not a device index"));
      }
      o.peer_devices.push_back(device);
    }
    return absl::OkStatus();
  }
  struct SizeKey {
    const char* name;
    size_t PoolOptions::*field;
  };
  static constexpr SizeKey kSizes[] = {
      {"reserve_size", &PoolOptions::reserve_size},
      {"memory_limit", &PoolOptions::memory_limit},
      {"release_threshold", &PoolOptions::release_threshold},
      {"small_size", &PoolOptions::small_size},
      {"small_chunk", &PoolOptions::small_chunk},
      {"max_growth_extra", &PoolOptions::max_growth_extra},
      {"max_chunk", &PoolOptions::max_chunk},
  };
  for (const SizeKey& k : kSizes) {
    if (key == k.name) {
      VMM_ASSIGN_OR_RETURN(o.*k.field, ParseSize(key, value));
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown option '", key, "'; options are handle_type, reserve_size, memory_limit, "
      "release_threshold, small_size, small_chunk, growth_fraction, max_growth_extra, "
      "max_chunk, peer_devices"));
}

absl::StatusOr<PoolOptions> ParseOptions(absl::string_view text,
                                         const PoolOptions& defaults = {}) {
  PoolOptions options = defaults;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first);
    if (item.find('=') == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("option '", key, "' has no value (key=value)"));
    }
    VMM_RETURN_IF_ERROR(ApplyOption(key, absl::StripAsciiWhitespace(kv.second), options));
  }
  return options;
}

// --- Process state -------------------------------------------------------------------------

// A pool created through vmm_pool_create: it lives until it is closed and its last block is
// freed.
struct ExplicitPool {
  std::unique_ptr<Pool> pool;
  std::atomic<int64_t> live{0};
  bool closed = false;
};

struct Import {
  std::unique_ptr<ImportedBuffer> buffer;
  bool host = false;  // imported through the host backend (CPU memory)
  int64_t refs = 1;
};

class State {
 public:
  static State& Get() {
    static auto* state = new State();
    return *state;
  }

  // Device pools grow by exactly what a request needs unless configured otherwise: in
  // PyTorch training that gave the smallest peak reserved (below expandable segments),
  // and a growth costs about 0.1 ms, nothing beside a training step (README: results).
  State() {
    MutexLock lock(&mu_);
    options_.growth_fraction = 0;
  }

  // The device pool of `device`, created on first use.
  absl::StatusOr<Pool*> DevicePool(int device) {
    if (device < 0 || device >= kMaxDevices) {
      return absl::InvalidArgumentError(absl::StrCat("device ", device, " is out of range"));
    }
    Pool* pool = device_pools_[device].load(std::memory_order_acquire);
    if (pool != nullptr) return pool;
    MutexLock lock(&mu_);
    pool = device_pools_[device].load(std::memory_order_relaxed);
    if (pool != nullptr) return pool;
    VMM_ASSIGN_OR_RETURN(Driver * driver, DefaultDriver());
    PoolOptions options = options_;
    options.device = device;
    // peer_devices names every device that should reach each pool; a pool's own device is
    // not its peer.
    options.peer_devices.erase(
        std::remove(options.peer_devices.begin(), options.peer_devices.end(), device),
        options.peer_devices.end());
    VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> created, Pool::Create(driver, options));
    if (fractions_[device] > 0) {
      VMM_RETURN_IF_ERROR(ApplyFraction(*created, fractions_[device]));
    }
    pool = created.release();  // device pools live as long as the process
    device_pools_[device].store(pool, std::memory_order_release);
    any_device_pool_ = true;
    return pool;
  }

  Pool* DevicePoolIfAny(int device) {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return device_pools_[device].load(std::memory_order_acquire);
  }

  absl::Status Configure(absl::string_view text) {
    PoolOptions defaults;
    defaults.growth_fraction = 0;  // see State()
    VMM_ASSIGN_OR_RETURN(PoolOptions options, ParseOptions(text, defaults));
    MutexLock lock(&mu_);
    if (any_device_pool_) {
      return absl::FailedPreconditionError(
          "vmm is already allocating: set options before the first allocation");
    }
    options_ = options;
    return absl::OkStatus();
  }

  absl::Status SetFraction(double fraction, int device) {
    if (!(fraction > 0 && fraction <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory fraction ", fraction, " is outside (0, 1]"));
    }
    if (device < 0 || device >= kMaxDevices) {
      return absl::InvalidArgumentError(absl::StrCat("device ", device, " is out of range"));
    }
    MutexLock lock(&mu_);
    fractions_[device] = fraction;
    Pool* pool = device_pools_[device].load();
    return pool != nullptr ? ApplyFraction(*pool, fraction) : absl::OkStatus();
  }

  // Every pool, device pools first.
  std::vector<Pool*> AllPools() {
    std::vector<Pool*> out;
    for (auto& p : device_pools_) {
      if (Pool* pool = p.load()) out.push_back(pool);
    }
    MutexLock lock(&mu_);
    for (auto& [id, e] : explicit_) out.push_back(e->pool.get());
    return out;
  }

  // The pool whose range holds `ptr`, and its explicit entry if any.
  Pool* Owner(const void* ptr, std::shared_ptr<ExplicitPool>* entry) {
    for (auto& p : device_pools_) {
      Pool* pool = p.load(std::memory_order_acquire);
      if (pool != nullptr && pool->Contains(ptr)) return pool;
    }
    MutexLock lock(&mu_);
    for (auto& [id, e] : explicit_) {
      if (e->pool->Contains(ptr)) {
        if (entry != nullptr) *entry = e;
        return e->pool.get();
      }
    }
    return nullptr;
  }

  absl::StatusOr<int64_t> CreatePool(absl::string_view device, absl::string_view options_text) {
    VMM_ASSIGN_OR_RETURN(PoolOptions options, ParseOptions(options_text));
    Driver* driver = nullptr;
    std::string d = absl::AsciiStrToLower(absl::StripAsciiWhitespace(device));
    if (d == "host") {
      driver = GetHostDriver();
      options.device = 0;
    } else {
      if (absl::StartsWith(d, "cuda:")) d = d.substr(5);
      int index;
      if (!absl::SimpleAtoi(d, &index) || index < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "device '", device, "' is neither \"host\" nor a CUDA device index"));
      }
      VMM_ASSIGN_OR_RETURN(driver, DriverByName("cuda"));
      options.device = index;
    }
    VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> pool, Pool::Create(driver, options));
    auto entry = std::make_shared<ExplicitPool>();
    entry->pool = std::move(pool);
    MutexLock lock(&mu_);
    const int64_t id = next_id_++;
    explicit_[id] = std::move(entry);
    return id;
  }

  absl::StatusOr<std::shared_ptr<ExplicitPool>> FindPool(int64_t id) {
    MutexLock lock(&mu_);
    auto it = explicit_.find(id);
    if (it == explicit_.end() || it->second->closed) {
      return absl::InvalidArgumentError(absl::StrCat("no open pool ", id));
    }
    return it->second;
  }

  absl::Status ClosePool(int64_t id) {
    std::shared_ptr<ExplicitPool> doomed;
    {
      MutexLock lock(&mu_);
      auto it = explicit_.find(id);
      if (it == explicit_.end() || it->second->closed) {
        return absl::InvalidArgumentError(absl::StrCat("no open pool ", id));
      }
      it->second->closed = true;
      if (it->second->live.load() == 0) {
        doomed = std::move(it->second);
        explicit_.erase(it);
      }
    }
    return absl::OkStatus();  // `doomed` (if any) destroys the pool outside the lock
  }

  // After a block of an explicit pool is freed: destroys a closed pool left empty.
  void BlockFreed(const std::shared_ptr<ExplicitPool>& entry) {
    if (entry->live.fetch_sub(1) != 1) return;
    std::shared_ptr<ExplicitPool> doomed;
    MutexLock lock(&mu_);
    if (!entry->closed) return;
    for (auto it = explicit_.begin(); it != explicit_.end(); ++it) {
      if (it->second == entry) {
        doomed = std::move(it->second);
        explicit_.erase(it);
        break;
      }
    }
  }

  int64_t AddImport(std::unique_ptr<ImportedBuffer> buffer, bool host) {
    MutexLock lock(&mu_);
    const int64_t id = next_id_++;
    imports_[id] = Import{std::move(buffer), host, 1};
    return id;
  }

  // What a tensor over import `id` needs, under one lock: address, size, and the CUDA device
  // (-1 for the host backend).
  absl::Status ImportInfo(int64_t id, uint64_t* ptr, size_t* size, int* device) {
    MutexLock lock(&mu_);
    auto it = imports_.find(id);
    if (it == imports_.end()) return absl::InvalidArgumentError(absl::StrCat("no import ", id));
    const ImportedBuffer& buffer = *it->second.buffer;
    *ptr = buffer.ptr();
    *size = buffer.size();
    *device = it->second.host ? -1 : buffer.device();
    return absl::OkStatus();
  }

  absl::Status AddRef(int64_t id, int delta) {
    std::unique_ptr<ImportedBuffer> doomed;
    MutexLock lock(&mu_);
    auto it = imports_.find(id);
    if (it == imports_.end()) return absl::InvalidArgumentError(absl::StrCat("no import ", id));
    it->second.refs += delta;
    if (it->second.refs <= 0) {
      doomed = std::move(it->second.buffer);
      imports_.erase(it);
    }
    return absl::OkStatus();
  }

 private:
  absl::Status ApplyFraction(Pool& pool, double fraction) {
    VMM_ASSIGN_OR_RETURN(MemInfo info, pool.driver()->GetMemInfo(pool.device()));
    pool.SetMemoryLimit(static_cast<size_t>(fraction * static_cast<double>(info.total)));
    return absl::OkStatus();
  }

  std::array<std::atomic<Pool*>, kMaxDevices> device_pools_{};
  Mutex mu_;
  PoolOptions options_ ABSL_GUARDED_BY(mu_);
  bool any_device_pool_ ABSL_GUARDED_BY(mu_) = false;
  std::array<double, kMaxDevices> fractions_ ABSL_GUARDED_BY(mu_){};
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<int64_t, std::shared_ptr<ExplicitPool>> explicit_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Import> imports_ ABSL_GUARDED_BY(mu_);
};

std::string StatsDocument(const PoolStats& stats) {
  nlohmann::json doc;
  doc["vmm"] = nlohmann::json::parse(StatsToJson(stats));
  doc["torch"] = TorchMemoryStats(stats);
  return doc.dump();
}

absl::StatusOr<Driver*> ImportDriver(const BufferDescriptor& d, const char* backend) {
  if (backend != nullptr && backend[0] != '\0') return DriverByName(backend);
  if (d.owner_uuid().has_value() && absl::StartsWith(*d.owner_uuid(), "HOST-")) {
    return GetHostDriver();
  }
  return DefaultDriver();
}

}  // namespace
}  // namespace vmm

using vmm::State;

extern "C" {

const char* vmm_last_error(void) { return vmm::last_error.c_str(); }

const char* vmm_backend(void) {
  absl::StatusOr<vmm::Driver*> driver = vmm::DefaultDriver();
  if (!driver.ok()) return "host";
  return (*driver)->Name() == "cuda" ? "cuda" : "host";
}

void vmm_release_buffer(void* buffer) { std::free(buffer); }

int vmm_configure(const char* options) {
  absl::Status s = State::Get().Configure(options == nullptr ? "" : options);
  return s.ok() ? 0 : vmm::Fail(s);
}

void* vmm_alloc(size_t size, int device, void* stream) {
  absl::StatusOr<vmm::Pool*> pool = State::Get().DevicePool(device);
  if (!pool.ok()) return vmm::FailNull<void>(pool.status());
  absl::StatusOr<void*> p = (*pool)->Allocate(size, reinterpret_cast<vmm::Stream>(stream));
  if (!p.ok()) return vmm::FailNull<void>(p.status());
  return *p;
}

int vmm_free(void* ptr, int device) {
  if (ptr == nullptr) return 0;
  vmm::Pool* pool = device >= 0 ? State::Get().DevicePoolIfAny(device) : nullptr;
  if (pool == nullptr || !pool->Contains(ptr)) pool = State::Get().Owner(ptr, nullptr);
  if (pool == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("free of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                     ", which no vmm pool allocated")));
  }
  absl::Status s = pool->Free(ptr);
  return s.ok() ? 0 : vmm::Fail(s);
}

int vmm_record_stream(void* ptr, void* stream) {
  vmm::Pool* pool = State::Get().Owner(ptr, nullptr);
  if (pool == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("record_stream: not a vmm block"));
  }
  absl::Status s = pool->RecordStream(ptr, reinterpret_cast<vmm::Stream>(stream));
  return s.ok() ? 0 : vmm::Fail(s);
}

int vmm_empty_cache(int device) {
  std::vector<vmm::Pool*> pools;
  if (device >= 0) {
    if (vmm::Pool* p = State::Get().DevicePoolIfAny(device)) pools.push_back(p);
  } else {
    pools = State::Get().AllPools();
  }
  for (vmm::Pool* p : pools) {
    absl::Status s = p->EmptyCache();
    if (!s.ok()) return vmm::Fail(s);
  }
  return 0;
}

int vmm_set_memory_fraction(double fraction, int device) {
  absl::Status s = State::Get().SetFraction(fraction, device);
  return s.ok() ? 0 : vmm::Fail(s);
}

char* vmm_stats_json(int device) {
  vmm::Pool* pool = State::Get().DevicePoolIfAny(device);
  return vmm::CopyString(vmm::StatsDocument(pool != nullptr ? pool->GetStats() : vmm::PoolStats{}));
}

int vmm_reset_peak_stats(int device) {
  if (vmm::Pool* p = State::Get().DevicePoolIfAny(device)) p->ResetPeakStats();
  return 0;
}

int vmm_reset_accumulated_stats(int device) {
  if (vmm::Pool* p = State::Get().DevicePoolIfAny(device)) p->ResetAccumulatedStats();
  return 0;
}

char* vmm_snapshot_json(void) {
  std::vector<vmm::Snapshot> snaps;
  nlohmann::json pools = nlohmann::json::array();
  for (vmm::Pool* p : State::Get().AllPools()) {
    snaps.push_back(p->GetSnapshot());
    pools.push_back(vmm::SnapshotToJson(snaps.back()));
  }
  nlohmann::json doc = vmm::TorchSnapshot(snaps);
  doc["vmm_pools"] = std::move(pools);
  return vmm::CopyString(doc.dump());
}

int64_t vmm_pool_create(const char* device, const char* options) {
  absl::StatusOr<int64_t> id =
      State::Get().CreatePool(device == nullptr ? "" : device, options == nullptr ? "" : options);
  return id.ok() ? *id : vmm::Fail(id.status());
}

int vmm_pool_destroy(int64_t pool) {
  absl::Status s = State::Get().ClosePool(pool);
  return s.ok() ? 0 : vmm::Fail(s);
}

void* vmm_pool_alloc(int64_t pool, size_t size, void* stream, int shareable) {
  auto entry = State::Get().FindPool(pool);
  if (!entry.ok()) return vmm::FailNull<void>(entry.status());
  vmm::Pool& p = *(*entry)->pool;
  const auto s = reinterpret_cast<vmm::Stream>(stream);
  absl::StatusOr<void*> ptr = shareable ? p.AllocateShareable(size, s) : p.Allocate(size, s);
  if (!ptr.ok()) return vmm::FailNull<void>(ptr.status());
  ++(*entry)->live;
  return *ptr;
}

int vmm_pool_empty_cache(int64_t pool) {
  auto entry = State::Get().FindPool(pool);
  if (!entry.ok()) return vmm::Fail(entry.status());
  absl::Status s = (*entry)->pool->EmptyCache();
  return s.ok() ? 0 : vmm::Fail(s);
}

char* vmm_pool_stats_json(int64_t pool) {
  auto entry = State::Get().FindPool(pool);
  if (!entry.ok()) return vmm::FailNull<char>(entry.status());
  return vmm::CopyString(vmm::StatsDocument((*entry)->pool->GetStats()));
}

const char* vmm_pool_handle_type(int64_t pool) {
  auto entry = State::Get().FindPool(pool);
  if (!entry.ok()) return vmm::FailNull<const char>(entry.status());
  return vmm::HandleTypeName((*entry)->pool->handle_type()).data();
}

int vmm_pool_device(int64_t pool) {
  auto entry = State::Get().FindPool(pool);
  if (!entry.ok()) {
    vmm::Fail(entry.status());
    return -2;
  }
  const vmm::Pool& p = *(*entry)->pool;
  return p.driver()->Name() == "host" ? -1 : p.device();
}

void vmm_block_free(void* ptr) {
  std::shared_ptr<vmm::ExplicitPool> entry;
  vmm::Pool* pool = State::Get().Owner(ptr, &entry);
  if (pool == nullptr) {
    vmm::LogError(absl::StrCat("free of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                               ", which no vmm pool allocated"));
    return;
  }
  absl::Status s = pool->Free(ptr);
  if (!s.ok()) vmm::LogError(s.ToString());
  if (entry != nullptr && s.ok()) State::Get().BlockFreed(entry);
}

int vmm_owns(const void* ptr) { return State::Get().Owner(ptr, nullptr) != nullptr ? 1 : 0; }

int vmm_export(const void* ptr, uint8_t** out, size_t* out_len) {
  if (out == nullptr || out_len == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_export: null output"));
  }
  vmm::Pool* pool = State::Get().Owner(ptr, nullptr);
  if (pool == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError(absl::StrCat(
        "export of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
        ": the memory does not belong to a vmm pool (enable vmm_torch or use a vmm Pool)")));
  }
  absl::StatusOr<vmm::BufferDescriptor> d = vmm::ExportBuffer(*pool, const_cast<void*>(ptr));
  if (!d.ok()) return vmm::Fail(d.status());
  const std::string bytes = d->Encode();
  *out = static_cast<uint8_t*>(std::malloc(bytes.size()));
  std::memcpy(*out, bytes.data(), bytes.size());
  *out_len = bytes.size();
  return 0;
}

int64_t vmm_import(const uint8_t* descriptor, size_t len, int device, const char* backend,
                   int pidfd) {
  if (descriptor == nullptr) return vmm::Fail(absl::InvalidArgumentError("null descriptor"));
  absl::StatusOr<vmm::BufferDescriptor> d = vmm::BufferDescriptor::Decode(
      absl::string_view(reinterpret_cast<const char*>(descriptor), len));
  if (!d.ok()) return vmm::Fail(d.status());
  absl::StatusOr<vmm::Driver*> driver = vmm::ImportDriver(*d, backend);
  if (!driver.ok()) return vmm::Fail(driver.status());
  vmm::ImportOptions options;
  options.device = device;
  if (pidfd != 0) options.fd_fetch = vmm::FdFetch::kPidfd;
  absl::StatusOr<std::unique_ptr<vmm::ImportedBuffer>> buffer =
      vmm::ImportBuffer(*driver, *d, options);
  if (!buffer.ok()) return vmm::Fail(buffer.status());
  return State::Get().AddImport(std::move(*buffer), (*driver)->Name() == "host");
}

int vmm_import_info(int64_t import_id, uint64_t* ptr, size_t* size, int* device) {
  if (ptr == nullptr || size == nullptr || device == nullptr) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_import_info: null output"));
  }
  absl::Status s = State::Get().ImportInfo(import_id, ptr, size, device);
  return s.ok() ? 0 : vmm::Fail(s);
}

int vmm_import_retain(int64_t import_id) {
  absl::Status s = State::Get().AddRef(import_id, +1);
  return s.ok() ? 0 : vmm::Fail(s);
}

void vmm_import_release(void* import_id) {
  absl::Status s = State::Get().AddRef(reinterpret_cast<int64_t>(import_id), -1);
  if (!s.ok()) vmm::LogError(s.ToString());
}

int vmm_descriptor_from_handles(int handle_type, const uint8_t* const* handles,
                                const size_t* handle_lens, const int64_t* sizes, size_t count,
                                int64_t size, const char* owner, int64_t offset, uint8_t** out,
                                size_t* out_len) {
  if (out == nullptr || out_len == nullptr || (count > 0 && (handles == nullptr ||
                                                             handle_lens == nullptr ||
                                                             sizes == nullptr))) {
    return vmm::Fail(absl::InvalidArgumentError("vmm_descriptor_from_handles: null argument"));
  }
  vmm::HandleType type;
  if (handle_type == 1) {
    type = vmm::HandleType::kPosixFd;
  } else if (handle_type == 2) {
    type = vmm::HandleType::kFabric;
  } else {
    return vmm::Fail(absl::InvalidArgumentError(
        absl::StrCat("handle type ", handle_type, " is not 1 (posix_fd) or 2 (fabric)")));
  }
  std::vector<std::string> h;
  for (size_t i = 0; i < count; ++i) {
    h.emplace_back(reinterpret_cast<const char*>(handles[i]), handle_lens[i]);
  }
  std::vector<int64_t> s(sizes, sizes + count);
  absl::StatusOr<vmm::BufferDescriptor> d = vmm::BufferDescriptor::FromHandles(
      type, h, s, size < 0 ? std::nullopt : std::optional<int64_t>(size),
      owner == nullptr ? std::nullopt : std::optional<std::string>(owner), offset);
  if (!d.ok()) return vmm::Fail(d.status());
  const std::string bytes = d->Encode();
  *out = static_cast<uint8_t*>(std::malloc(bytes.size()));
  std::memcpy(*out, bytes.data(), bytes.size());
  *out_len = bytes.size();
  return 0;
}

char* vmm_descriptor_json(const uint8_t* descriptor, size_t len) {
  if (descriptor == nullptr) {
    return vmm::FailNull<char>(absl::InvalidArgumentError("null descriptor"));
  }
  absl::StatusOr<vmm::BufferDescriptor> d = vmm::BufferDescriptor::Decode(
      absl::string_view(reinterpret_cast<const char*>(descriptor), len));
  if (!d.ok()) return vmm::FailNull<char>(d.status());
  nlohmann::json doc;
  doc["handle_type"] = std::string(vmm::HandleTypeName(d->handle_type()));
  doc["handles"] = nlohmann::json::array();
  for (const auto& handle : d->handles()) {
    doc["handles"].push_back(absl::BytesToHexString(
        absl::string_view(reinterpret_cast<const char*>(handle.data()), handle.size())));
  }
  doc["sizes"] = d->sizes();
  doc["size"] = d->size();
  doc["offset"] = d->offset();
  doc["owner_uuid"] = d->owner_uuid().has_value() ? nlohmann::json(*d->owner_uuid()) : nullptr;
  // The owner UUID comes from untrusted bytes and need not be UTF-8: replace invalid bytes
  // (U+FFFD) instead of letting dump() throw through this C function.
  return vmm::CopyString(doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // extern "C"
