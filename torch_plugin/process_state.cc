#include "torch_plugin/process_state.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/base/optimization.h"
#include "absl/strings/str_cat.h"
#include "allocator/byte_size.h"
#include "allocator/driver_factory.h"
#include "allocator/import_closer.h"
#include "allocator/log.h"
#include "allocator/pool_options.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

// Device pools grow by exactly what a request needs unless configured otherwise: in PyTorch
// training that gave the smallest peak reserved (below expandable segments), and a growth
// costs about 0.1 ms, nothing beside a training step (README: results).
PoolOptions DevicePoolDefaults() {
  PoolOptions defaults;
  defaults.growth_fraction = 0;
  return defaults;
}

// The send budget VMM_SEND_BUDGET asks for (bytes, K/M/G/T suffixes; 0: none), else 1 GiB;
// a malformed value is said once and the default used.
uint64_t SendBudgetFromEnvironment() {
  constexpr uint64_t kDefault = uint64_t{1} << 30;
  const char* text = std::getenv("VMM_SEND_BUDGET");
  if (text == nullptr || text[0] == '\0') return kDefault;
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok()) {
    LogWarningOnce("send-budget", absl::StrCat("VMM_SEND_BUDGET: ", bytes.status().message(),
                                               "; using the default of 1 GiB"));
    return kDefault;
  }
  return *bytes;
}

absl::Status BadDevice(int device) {
  return absl::InvalidArgumentError(absl::StrCat("device ", device, " is out of range"));
}

}  // namespace

ProcessState& ProcessState::Get() {
  static auto* state = new ProcessState();
  return *state;
}

ProcessState::ProcessState() : send_budget_(SendBudgetFromEnvironment()) {
  MutexLock lock(&mu_);
  options_ = DevicePoolDefaults();
}

ProcessState::~ProcessState() {
  // Moved out under the lock, destroyed after it (as everywhere else).
  std::map<int64_t, OpenImport> imports;
  std::map<int64_t, std::shared_ptr<ExplicitPool>> pools;
  std::vector<Pool*> abandoned;
  {
    MutexLock lock(&mu_);
    imports.swap(imports_);
    pools.swap(explicit_);
    abandoned.swap(abandoned_);
  }
  imports.clear();
  pools.clear();
  for (Pool* pool : abandoned) delete pool;
  for (auto& p : device_pools_) delete p.exchange(nullptr);
}

absl::Status ProcessState::Configure(absl::string_view text) {
  VMM_ASSIGN_OR_RETURN(PoolOptions options, ParsePoolOptions(text, DevicePoolDefaults()));
  MutexLock lock(&mu_);
  if (any_device_pool_) {
    return absl::FailedPreconditionError(
        "vmm is already allocating: set options before the first allocation");
  }
  options_ = std::move(options);
  return absl::OkStatus();
}

absl::StatusOr<Pool*> ProcessState::DevicePool(int device) {
  if (device < 0 || device >= kMaxDevices) return BadDevice(device);
  Pool* pool = device_pools_[device].load(std::memory_order_acquire);
  if (ABSL_PREDICT_TRUE(pool != nullptr && !pool->made_before_fork())) return pool;
  MutexLock lock(&mu_);
  pool = device_pools_[device].load(std::memory_order_relaxed);
  if (pool != nullptr && pool->made_before_fork()) {
    AbandonParentsDevicePools();
    pool = nullptr;
  }
  if (pool != nullptr) return pool;
  VMM_ASSIGN_OR_RETURN(Driver * driver, DefaultDriver());
  PoolOptions options = options_;
  options.device = device;
  // peer_devices names every device that should reach each pool; a pool's own device is not
  // its peer.
  options.peer_devices.erase(
      std::remove(options.peer_devices.begin(), options.peer_devices.end(), device),
      options.peer_devices.end());
  VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> created, CreateExportablePool(driver, options));
  if (fractions_[device] > 0) VMM_RETURN_IF_ERROR(ApplyFraction(*created, fractions_[device]));
  pool = created.release();  // freed by the destructor (never, for the process's state)
  device_pools_[device].store(pool, std::memory_order_release);
  any_device_pool_ = true;
  return pool;
}

void ProcessState::AbandonParentsDevicePools() {
  for (auto& p : device_pools_) {
    Pool* pool = p.load(std::memory_order_relaxed);
    if (pool == nullptr || !pool->made_before_fork()) continue;
    abandoned_.push_back(pool);
    p.store(nullptr, std::memory_order_release);
  }
  any_device_pool_ = false;
}

absl::StatusOr<void*> ProcessState::DeviceAllocate(int device, size_t size, Stream stream) {
  VMM_RETURN_IF_ERROR(CheckRequestSize(size));
  VMM_ASSIGN_OR_RETURN(Pool * pool, DevicePool(device));
  return pool->Allocate(size, stream);
}

Pool* ProcessState::DevicePoolIfAny(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return device_pools_[device].load(std::memory_order_acquire);
}

absl::Status ProcessState::SetMemoryFraction(double fraction, int device) {
  if (!(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory fraction ", fraction, " is outside (0, 1]"));
  }
  if (device < 0 || device >= kMaxDevices) return BadDevice(device);
  MutexLock lock(&mu_);
  fractions_[device] = fraction;
  Pool* pool = device_pools_[device].load();
  return pool != nullptr ? ApplyFraction(*pool, fraction) : absl::OkStatus();
}

absl::Status ProcessState::ApplyFraction(Pool& pool, double fraction) {
  VMM_ASSIGN_OR_RETURN(MemInfo info, pool.driver()->GetMemInfo(pool.device()));
  pool.SetMemoryLimit(static_cast<size_t>(fraction * static_cast<double>(info.total)));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ProcessState::CreatePool(Backend backend, int device,
                                                 absl::string_view options_text) {
  VMM_ASSIGN_OR_RETURN(PoolOptions options, ParsePoolOptions(options_text));
  if (device < 0) return BadDevice(device);
  VMM_ASSIGN_OR_RETURN(Driver * driver, DriverFor(backend));
  options.device = device;
  VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> pool, CreateExportablePool(driver, options));
  auto entry = std::make_shared<ExplicitPool>();
  entry->pool = std::move(pool);
  MutexLock lock(&mu_);
  const int64_t id = next_id_++;
  explicit_[id] = std::move(entry);
  return id;
}

absl::StatusOr<std::shared_ptr<ProcessState::ExplicitPool>> ProcessState::FindPool(int64_t id) {
  MutexLock lock(&mu_);
  auto it = explicit_.find(id);
  if (it == explicit_.end() || it->second->closed) {
    return absl::InvalidArgumentError(absl::StrCat("no open pool ", id));
  }
  return it->second;
}

absl::Status ProcessState::ClosePool(int64_t id) {
  std::shared_ptr<ExplicitPool> doomed;  // destroys the pool outside the lock
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
  return absl::OkStatus();
}

absl::StatusOr<void*> ProcessState::PoolAllocate(int64_t id, size_t size, Stream stream,
                                                 bool shareable) {
  VMM_RETURN_IF_ERROR(CheckRequestSize(size));
  // The block is counted before it exists, under the lock that ClosePool takes, so that a
  // pool closed meanwhile is not destroyed under the allocation.
  std::shared_ptr<ExplicitPool> entry;
  {
    MutexLock lock(&mu_);
    auto it = explicit_.find(id);
    if (it == explicit_.end() || it->second->closed) {
      return absl::InvalidArgumentError(absl::StrCat("no open pool ", id));
    }
    entry = it->second;
    ++entry->live;
  }
  Pool& pool = *entry->pool;
  absl::StatusOr<void*> ptr =
      shareable ? pool.AllocateShareable(size, stream) : pool.Allocate(size, stream);
  if (!ptr.ok()) BlockGone(entry);
  return ptr;
}

void ProcessState::BlockGone(const std::shared_ptr<ExplicitPool>& entry) {
  if (entry->live.fetch_sub(1) != 1) return;
  // The last live block of an explicit pool: destroy the pool if it was closed.
  std::shared_ptr<ExplicitPool> doomed;  // destroyed after the lock is released
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

ProcessState::PoolRef ProcessState::Owner(const void* ptr) {
  for (auto& p : device_pools_) {
    Pool* pool = p.load(std::memory_order_acquire);
    if (pool != nullptr && pool->Contains(ptr)) return PoolRef{pool, nullptr};
  }
  MutexLock lock(&mu_);
  for (auto& [id, e] : explicit_) {
    if (e->pool->Contains(ptr)) return PoolRef{e->pool.get(), e};
  }
  for (Pool* pool : abandoned_) {
    if (pool->Contains(ptr)) return PoolRef{pool, nullptr};
  }
  return PoolRef{};
}

std::vector<ProcessState::PoolRef> ProcessState::AllPools() {
  std::vector<PoolRef> out;
  for (auto& p : device_pools_) {
    if (Pool* pool = p.load()) out.push_back(PoolRef{pool, nullptr});
  }
  MutexLock lock(&mu_);
  for (auto& [id, e] : explicit_) out.push_back(PoolRef{e->pool.get(), e});
  return out;
}

absl::Status ProcessState::FreeBlock(void* ptr) {
  if (DeferFreeIfHeld(ptr)) return absl::OkStatus();
  return FreeBlockNow(ptr);
}

absl::Status ProcessState::FreeBlockNow(void* ptr) {
  PoolRef owner = Owner(ptr);
  if (owner.pool == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "free of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)), ", which no vmm pool allocated"));
  }
  VMM_RETURN_IF_ERROR(owner.pool->Free(ptr));
  if (owner.keep != nullptr) BlockGone(owner.keep);
  return absl::OkStatus();
}

absl::StatusOr<BufferDescriptor> ProcessState::Export(const void* ptr) {
  PoolRef owner = Owner(ptr);
  if (owner.pool == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "export of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
        ": the memory does not belong to a vmm pool (enable vmm_torch or use a vmm Pool)"));
  }
  return ExportBuffer(*owner.pool, const_cast<void*>(ptr));
}

absl::StatusOr<int64_t> ProcessState::Import(absl::string_view bytes, int device,
                                             std::optional<Backend> backend, bool pidfd) {
  VMM_ASSIGN_OR_RETURN(BufferDescriptor d, BufferDescriptor::Decode(bytes));
  // The caller's backend; else the host backend for the host backend's buffers, and the
  // default one for everything else (ImportBuffer then names the owner when it cannot map
  // the buffer, e.g. a GPU buffer in a process without CUDA).
  if (!backend.has_value() && d.backend() == Backend::kHost) backend = Backend::kHost;
  Driver* driver = nullptr;
  if (backend.has_value()) {
    VMM_ASSIGN_OR_RETURN(driver, DriverFor(*backend));
  } else {
    VMM_ASSIGN_OR_RETURN(driver, DefaultDriver());
  }
  ImportOptions options;
  options.device = device;
  if (pidfd) options.fd_fetch = FdFetch::kPidfd;
  VMM_ASSIGN_OR_RETURN(std::unique_ptr<ImportedBuffer> buffer, ImportBuffer(driver, d, options));
  MutexLock lock(&mu_);
  const int64_t id = next_id_++;
  imports_by_ptr_.emplace(buffer->ptr(), id);
  imports_[id] = OpenImport{std::move(buffer), driver->backend() == Backend::kHost, 1,
                           std::make_shared<const BufferDescriptor>(std::move(d))};
  return id;
}

absl::StatusOr<ProcessState::ImportInfo> ProcessState::GetImportInfo(int64_t id) {
  MutexLock lock(&mu_);
  auto it = imports_.find(id);
  if (it == imports_.end()) return absl::InvalidArgumentError(absl::StrCat("no import ", id));
  const ImportedBuffer& buffer = *it->second.buffer;
  return ImportInfo{buffer.ptr(), buffer.size(), it->second.host ? -1 : buffer.device()};
}

absl::Status ProcessState::AddImportRef(int64_t id, int delta) {
  std::unique_ptr<ImportedBuffer> doomed;  // closed outside the lock
  {
    MutexLock lock(&mu_);
    auto it = imports_.find(id);
    if (it == imports_.end()) return absl::InvalidArgumentError(absl::StrCat("no import ", id));
    it->second.refs += delta;
    if (it->second.refs > 0) return absl::OkStatus();
    doomed = std::move(it->second.buffer);
    auto [first, last] = imports_by_ptr_.equal_range(doomed->ptr());
    for (auto at = first; at != last; ++at) {
      if (at->second == id) {
        imports_by_ptr_.erase(at);
        break;
      }
    }
    imports_.erase(it);
  }
  // Closing synchronizes the devices and unmaps: for a small import on the closing thread,
  // not on the caller's (a tensor's deleter, holding the interpreter lock), where a receiver
  // of many pays it per tensor. A large one is closed here, so that its unmapping (about 1 ms
  // for 8 GiB on an H200) is over before the caller goes on, as a program dropping a big
  // tensor before its next step expects.
  if (doomed->mapped_size() > kCloseInlineBytes) {
    doomed.reset();
  } else {
    CloseLater(std::move(doomed));
  }
  return absl::OkStatus();
}

size_t ProcessState::import_count() {
  MutexLock lock(&mu_);
  return imports_.size();
}

}  // namespace vmm
