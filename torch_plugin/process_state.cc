#include "torch_plugin/process_state.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "allocator/byte_size.h"
#include "allocator/capture_window.h"
#include "allocator/driver_factory.h"
#include "allocator/import_closer.h"
#include "allocator/log.h"
#include "allocator/pool_options.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

// Every pool of the plugin grows in single chunks rather than large_page pages
// (pool_options.h) unless asked: a tensor sent in place spans the chunks behind it, and an
// importer's cost grows with their number (one handle per 4 MiB page would be 256 for a 1 GiB
// tensor). `large_page=4M` turns the moving of free pages on (and small_size, left to the
// pool, then becomes 256 KiB instead of 1 MiB). Past half of what a pool may hold, its growth
// is in pressure_page pages all the same (4 MiB), which move: near the GPU's capacity single
// chunks pinned by blocks that span them ran out of memory where PyTorch's allocator did not.
PoolOptions PluginPoolDefaults() {
  PoolOptions defaults;
  defaults.large_page = 0;
  return defaults;
}

// Device pools also grow by exactly what a request needs: in PyTorch training that gave the
// smallest peak reserved (below expandable segments), and a growth costs about 0.1 ms, nothing
// beside a training step (README: results).
PoolOptions DevicePoolDefaults() {
  PoolOptions defaults = PluginPoolDefaults();
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

// A device the default driver has (0 <= device < its DeviceCount()), or InvalidArgument; the
// driver's error where there is none. For what sets a GPU's figures or limits for later
// (another allocator's counts, a memory fraction): a number past the GPU's count names no GPU,
// and its figures or fraction would apply to nothing (PyTorch's allocator refuses it too).
// Where `may_load` is false and the driver is not loaded yet, only the range is checked
// (loading it would run cuInit for the caller; what the fraction applies to later, a pool
// or another allocator's counts, is checked then).
absl::Status CheckDeviceExists(int device, bool may_load) {
  if (device < 0 || device >= ProcessState::kMaxDevices) return BadDevice(device);
  absl::StatusOr<Driver*> driver = may_load ? DefaultDriver() : DefaultDriverIfLoaded();
  if (!may_load && absl::IsUnavailable(driver.status())) return absl::OkStatus();
  VMM_RETURN_IF_ERROR(driver.status());
  const int count = (*driver)->DeviceCount();
  if (device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " is out of range (", count, " devices)"));
  }
  return absl::OkStatus();
}

}  // namespace

ProcessState& ProcessState::Get() {
  // Never destroyed; not a function's static (fork_guard.h PublishOnce).
  static std::atomic<ProcessState*> state{nullptr};
  return PublishOnce(state, [] { return new ProcessState(); });
}

ProcessState::ProcessState() : send_budget_(SendBudgetFromEnvironment()) {
  MutexLock lock(&mu_);
  options_ = DevicePoolDefaults();
  fractions_.fill(kNoFraction);
}

ProcessState::~ProcessState() {
  // Moved out under the lock, destroyed after it (as everywhere else).
  std::map<int64_t, OpenImport> imports;
  std::map<int64_t, std::shared_ptr<ExplicitPool>> pools;
  std::vector<Pool*> abandoned;
  std::map<PrivateKey, PrivateUse> private_pools;
  {
    MutexLock lock(&private_mu_);
    private_pools.swap(private_);
  }
  {
    MutexLock lock(&mu_);
    imports.swap(imports_);
    pools.swap(explicit_);
    explicit_by_base_.clear();
    abandoned.swap(abandoned_);
  }
  imports.clear();
  private_pools.clear();
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
  VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> created,
                       CreateExportablePool(driver, DevicePoolOptions(device)));
  VMM_RETURN_IF_ERROR(ShareCapLocked(device, *created));
  created->SetMappingListener(&mappings_, MappingSource{device, {0, 0}});
  pool = created.release();  // freed by the destructor (never, for the process's state)
  device_pools_[device].store(pool, std::memory_order_release);
  any_device_pool_ = true;
  return pool;
}

PoolOptions ProcessState::DevicePoolOptions(int device) {
  PoolOptions options = options_;
  options.device = device;
  // peer_devices names every device that should reach each pool; a pool's own device is not
  // its peer.
  options.peer_devices.erase(
      std::remove(options.peer_devices.begin(), options.peer_devices.end(), device),
      options.peer_devices.end());
  return options;
}

void ProcessState::AbandonParentsDevicePools() {
  for (auto& p : device_pools_) {
    Pool* pool = p.load(std::memory_order_relaxed);
    if (pool == nullptr || !pool->made_before_fork()) continue;
    abandoned_.push_back(pool);
    p.store(nullptr, std::memory_order_release);
  }
  any_device_pool_ = false;
  // The parent's pools count in the parent's caps (which they keep); the child's own pools
  // start fresh ones.
  for (auto& cap : caps_) cap = nullptr;
  retired_.fill(PoolStats{});  // the parent's pools that are gone are not this process's
  peak_floor_.fill(PoolStats{});
  external_held_.fill(0);  // the parent's other allocators' segments are not this process's
  external_allocated_.fill(0);
  generation_ = ForkGeneration();
}

void ProcessState::AdoptForkLocked() {
  if (ABSL_PREDICT_FALSE(generation_ != ForkGeneration())) AbandonParentsDevicePools();
}

absl::StatusOr<void*> ProcessState::DeviceAllocate(int device, size_t size, Stream stream) {
  // A pool that exists refuses (and counts in num_ooms) what no device holds itself; none is
  // created for such a request.
  Pool* pool = DevicePoolIfAny(device);
  if (pool == nullptr || pool->made_before_fork()) {
    VMM_RETURN_IF_ERROR(CheckRequestSize(size));
    VMM_ASSIGN_OR_RETURN(pool, DevicePool(device));
  }
  return pool->Allocate(size, stream);
}

Pool* ProcessState::DevicePoolIfAny(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return device_pools_[device].load(std::memory_order_acquire);
}

absl::Status ProcessState::CheckDevice(int device) {
  return CheckDeviceExists(device, /*may_load=*/false);
}

absl::Status ProcessState::SetMemoryFraction(double fraction, int device) {
  // 0 too, as PyTorch takes it: nothing more may be mapped on that GPU (cached blocks still
  // serve).
  if (!(fraction >= 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("memory fraction %.17g is outside [0, 1]", fraction));
  }
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  MutexLock lock(&mu_);
  fractions_[device] = fraction;
  Pool* pool = device_pools_[device].load();
  if (pool != nullptr) return ShareCapLocked(device, *pool);
  // Private pools or another allocator's segments only: measure the device with the default
  // driver.
  if (caps_[device] != nullptr) SetCapFromDefaultDriverLocked(device);
  return absl::OkStatus();
}

void ProcessState::SetCapFromDefaultDriverLocked(int device) {
  absl::StatusOr<Driver*> driver = DefaultDriver();
  absl::StatusOr<MemInfo> info =
      driver.ok() ? (*driver)->GetMemInfo(device) : absl::StatusOr<MemInfo>(driver.status());
  if (info.ok()) {
    caps_[device]->SetLimit(
        static_cast<size_t>(fractions_[device] * static_cast<double>(info->total)));
  }
}

namespace {

// Refuses a change of `delta` bytes of another allocator's `what` ("segments", "blocks") on
// GPU `device`, which holds `now` of them: giving back more than that, or holding more than
// 2^56 bytes (no GPU holds so much: a caller's mistake, refused before the counts, signed
// beside the pools' own in the cap, could overflow).
absl::Status CheckExternalDelta(absl::string_view what, int device, int64_t now, int64_t delta) {
  if (delta < 0 && delta < -now) {
    // Signed, so that a change of -2^63 bytes prints as what it is.
    return absl::InvalidArgumentError(absl::StrCat(
        "a change of ", FormatBytes(delta), " in another allocator's ", what, " on GPU ",
        device, ", which holds ", FormatBytes(now), ", would take them below 0 B"));
  }
  constexpr int64_t kMaxHeld = int64_t{1} << 56;
  if (delta > 0 && delta > kMaxHeld - now) {
    return absl::InvalidArgumentError(absl::StrCat(
        "another allocator's ", FormatBytes(static_cast<size_t>(delta)), " of ", what,
        " on GPU ", device, " beside the ", FormatBytes(static_cast<size_t>(now)),
        " it holds would pass ", FormatBytes(static_cast<size_t>(kMaxHeld)),
        ", more than any GPU has"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ProcessState::CheckExternalDevice(int device) {
  // The caller checked the range.
  if (external_device_known_[device].load(std::memory_order_acquire)) return absl::OkStatus();
  VMM_RETURN_IF_ERROR(CheckDeviceExists(device, /*may_load=*/true));
  external_device_known_[device].store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status ProcessState::HoldExternal(int device, int64_t delta) {
  // Bytes given back need only the range: a device that holds none refuses them below.
  if (device < 0 || device >= kMaxDevices) return BadDevice(device);
  if (delta > 0) VMM_RETURN_IF_ERROR(CheckExternalDevice(device));
  MutexLock lock(&mu_);
  std::shared_ptr<DeviceCap> cap = ExternalCapLocked(device);
  VMM_RETURN_IF_ERROR(CheckExternalDelta("segments", device, external_held_[device], delta));
  if (delta > 0 && !cap->Allows(static_cast<size_t>(delta))) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "another allocator's ", FormatBytes(static_cast<size_t>(delta)),
        " would pass the memory fraction of GPU ", device, ", ", FormatBytes(cap->limit()),
        " (held now: ", FormatBytes(static_cast<size_t>(std::max<int64_t>(cap->held(), 0))),
        ")"));
  }
  cap->AddExternal(delta);
  external_held_[device] += delta;
  return absl::OkStatus();
}

absl::Status ProcessState::CountExternalAllocated(int device, int64_t delta) {
  if (device < 0 || device >= kMaxDevices) return BadDevice(device);
  if (delta > 0) VMM_RETURN_IF_ERROR(CheckExternalDevice(device));
  MutexLock lock(&mu_);
  std::shared_ptr<DeviceCap> cap = ExternalCapLocked(device);
  VMM_RETURN_IF_ERROR(
      CheckExternalDelta("blocks", device, external_allocated_[device], delta));
  cap->AddExternalAllocated(delta);
  external_allocated_[device] += delta;
  return absl::OkStatus();
}

std::shared_ptr<DeviceCap> ProcessState::ExternalCapLocked(int device) {
  AdoptForkLocked();
  const bool fresh = caps_[device] == nullptr;
  std::shared_ptr<DeviceCap> cap = CapForLocked(device);
  if (fresh && fractions_[device] >= 0) SetCapFromDefaultDriverLocked(device);
  return cap;
}

std::shared_ptr<DeviceCap> ProcessState::CapForLocked(int device) {
  AdoptForkLocked();
  if (caps_[device] == nullptr) caps_[device] = std::make_shared<DeviceCap>();
  return caps_[device];
}

bool ProcessState::OfAnotherBackendLocked(int device, const Pool& pool) const {
  const Pool* gpu = device_pools_[device].load(std::memory_order_relaxed);
  return gpu != nullptr && gpu != &pool && gpu->driver() != pool.driver();
}

absl::Status ProcessState::ShareCapLocked(int device, Pool& pool) {
  AdoptForkLocked();  // before reading device_pools_: a parent's device pool is not this GPU's
  // Neither the GPU's fraction nor its figures for a pool of another backend.
  if (OfAnotherBackendLocked(device, pool)) return absl::OkStatus();
  std::shared_ptr<DeviceCap> cap = CapForLocked(device);
  pool.ShareDeviceCap(cap);
  if (fractions_[device] >= 0) {
    VMM_ASSIGN_OR_RETURN(MemInfo info, pool.driver()->GetMemInfo(pool.device()));
    cap->SetLimit(static_cast<size_t>(fractions_[device] * static_cast<double>(info.total)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ProcessState::CreatePool(Backend backend, int device,
                                                 absl::string_view options_text) {
  VMM_ASSIGN_OR_RETURN(PoolOptions options,
                       ParsePoolOptions(options_text, PluginPoolDefaults()));
  if (device < 0 || device >= kMaxDevices) return BadDevice(device);
  VMM_ASSIGN_OR_RETURN(Driver * driver, DriverFor(backend));
  options.device = device;
  if (options.reserve_size == 0 && PastPoolRangeBudget()) {
    // Past the budget, the range of a pool that never moves pages (twice the GPU's memory,
    // and its memory for the small arena), which grows where the address space after it is
    // free, rather than the paged default of 32.75 times.
    VMM_ASSIGN_OR_RETURN(MemInfo info, driver->GetMemInfo(device));
    options.reserve_size = info.total > kMaxOptionBytes / 2 ? kMaxOptionBytes : 2 * info.total;
    options.range_grows = true;
  }
  VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> pool, CreateExportablePool(driver, options));
  return Register(std::move(pool), /*is_private=*/false, 0, 0)->id;
}

bool ProcessState::PastPoolRangeBudget() {
  MutexLock lock(&mu_);
  size_t held = 0;
  for (const auto& [id, entry] : explicit_) held += entry->pool->reserved_range();
  return held > pool_range_budget_;
}

std::shared_ptr<ProcessState::ExplicitPool> ProcessState::Register(std::unique_ptr<Pool> pool,
                                                                   bool is_private, uint64_t id0,
                                                                   uint64_t id1) {
  auto entry = std::make_shared<ExplicitPool>();
  entry->pool = std::move(pool);
  entry->is_private = is_private;
  entry->mempool_id[0] = id0;
  entry->mempool_id[1] = id1;
  MutexLock lock(&mu_);
  entry->id = next_id_++;
  explicit_[entry->id] = entry;
  explicit_by_base_[entry->pool->base()] = entry;
  return entry;
}

absl::StatusOr<std::shared_ptr<ProcessState::ExplicitPool>> ProcessState::FindOpenLocked(
    int64_t id) {
  auto it = explicit_.find(id);
  if (it == explicit_.end() || it->second->closed) {
    return absl::InvalidArgumentError(absl::StrCat("no open pool ", id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<ProcessState::ExplicitPool>> ProcessState::FindPool(int64_t id) {
  MutexLock lock(&mu_);
  return FindOpenLocked(id);
}

ProcessState::ExplicitPool::~ExplicitPool() {
  // Its teardown synchronises and unmaps: after the capture if one is under way.
  RunOutsideCapture([pool = std::shared_ptr<Pool>(std::move(pool))]() mutable { pool.reset(); });
}

void ProcessState::CloseLocked(const std::shared_ptr<ExplicitPool>& entry,
                               std::shared_ptr<ExplicitPool>* doomed) {
  entry->closed = true;
  if (entry->live.load() == 0) {
    *doomed = entry;
    explicit_.erase(entry->id);
    explicit_by_base_.erase(entry->pool->base());
    entry->pool->DetachMappingListener();  // out of Snapshots() from now on
    if (entry->is_private) retiring_.push_back(entry);  // listed until Retire
  }
}

absl::Status ProcessState::ClosePool(int64_t id) {
  std::shared_ptr<ExplicitPool> doomed;  // destroys the pool outside the lock
  MutexLock lock(&mu_);
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<ExplicitPool> entry, FindOpenLocked(id));
  if (entry->is_private) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pool ", id, " is a private pool: it closes when its last use is released"));
  }
  CloseLocked(entry, &doomed);
  return absl::OkStatus();
}

absl::StatusOr<void*> ProcessState::PoolAllocate(int64_t id, size_t size, Stream stream,
                                                 bool shareable) {
  // The block is counted before it exists, under the lock that ClosePool takes, so that a
  // pool closed meanwhile is not destroyed under the allocation.
  std::shared_ptr<ExplicitPool> entry;
  {
    MutexLock lock(&mu_);
    VMM_ASSIGN_OR_RETURN(entry, FindOpenLocked(id));
    ++entry->live;
  }
  Pool& pool = *entry->pool;
  absl::StatusOr<void*> ptr =
      shareable ? pool.AllocateShareable(size, stream) : pool.Allocate(size, stream);
  if (!ptr.ok()) BlockGone(entry);
  return ptr;
}

absl::StatusOr<void*> ProcessState::PoolAllocateAt(int64_t id, uintptr_t addr, size_t size,
                                                   Stream stream) {
  std::shared_ptr<ExplicitPool> entry;  // counted first, as in PoolAllocate
  {
    MutexLock lock(&mu_);
    VMM_ASSIGN_OR_RETURN(entry, FindOpenLocked(id));
    ++entry->live;
  }
  absl::StatusOr<void*> ptr = entry->pool->AllocateAt(addr, size, stream);
  if (!ptr.ok()) BlockGone(entry);
  return ptr;
}

absl::StatusOr<std::vector<BlockInfo>> ProcessState::PoolLiveBlocks(int64_t id) {
  VMM_ASSIGN_OR_RETURN(std::shared_ptr<ExplicitPool> entry, FindPool(id));
  return entry->pool->LiveBlocks();
}

absl::StatusOr<int64_t> ProcessState::UsePrivatePool(std::optional<Backend> backend, int device,
                                                     uint64_t id0, uint64_t id1,
                                                     absl::string_view options_text) {
  if (device < 0 || device >= kMaxDevices) return BadDevice(device);
  const PrivateKey key{device, id0, id1};
  // Held while a first use creates the pool: a second use of the same MempoolId waits for it.
  MutexLock lock(&private_mu_);
  auto it = private_.find(key);
  if (it != private_.end()) {
    if (!it->second.entry->pool->made_before_fork()) {
      ++it->second.uses;
      return it->second.entry->id;
    }
    private_.erase(it);  // the parent's pool: it stays (in explicit_) for its blocks' frees
  }
  Driver* driver = nullptr;
  if (backend.has_value()) {
    VMM_ASSIGN_OR_RETURN(driver, DriverFor(*backend));
  } else {
    VMM_ASSIGN_OR_RETURN(driver, DefaultDriver());
  }
  PoolOptions defaults;
  {
    MutexLock state_lock(&mu_);
    defaults = DevicePoolOptions(device);
  }
  VMM_ASSIGN_OR_RETURN(PoolOptions options, ParsePoolOptions(options_text, defaults));
  options.device = device;
  std::vector<size_t> fallback_sizes;  // smaller ranges to ask where the first is refused
  if (options.reserve_size == 0) {
    // A private pool keeps its memory (nothing in it moves), so the wider range of a pool that
    // moves pages (pool_options.h reserve_size) would only take address space from the
    // process, which may hold many of them (a graph each): the range of a pool without pages,
    // twice the GPU's memory for the large arena, which grows if it fills, and the
    // GPU's memory for the small arena (pool_options.h range_grows): 2.75 times in all.
    VMM_ASSIGN_OR_RETURN(MemInfo info, driver->GetMemInfo(device));
    options.reserve_size =
        info.total > kMaxOptionBytes / 2 ? kMaxOptionBytes : 2 * info.total;  // as Pool::Init
    options.range_grows = true;
    // Past the budget of the explicit and private pools alive (kPoolRangeBudget), a quarter
    // of the GPU's memory, which does not grow (a pool's range may grow only into the address
    // space right after it, which the next pool's mostly takes): hundreds of full ranges took
    // most of the process's address space, which the host's own memory mappings share (400
    // pools of an H100 asked for 88 TB, run DU). Such a pool holds at most that much, a request
    // of at most seven eighths of it (its large arena; small blocks past the small arena's
    // eighth spill into the large one, pool.h). Where the driver refuses
    // that much, an eighth, then a sixty-fourth, of it (at least kLeastGrowingRange), as a
    // range that grows is asked (pool_options.h), rather than fail where a pool within the
    // budget would be made.
    if (PastPoolRangeBudget()) {
      options.reserve_size = std::max(static_cast<size_t>(info.total / 4), kLeastGrowingRange);
      options.range_grows = false;
      fallback_sizes = {std::max(options.reserve_size / 8, kLeastGrowingRange),
                        std::max(options.reserve_size / 64, kLeastGrowingRange)};
    }
  }
  absl::StatusOr<std::unique_ptr<Pool>> made = CreateExportablePool(driver, options);
  const absl::Status first = made.status();
  const size_t first_size = options.reserve_size;
  for (size_t smaller : fallback_sizes) {
    // Refused as Pool::Init takes a refusal: out of memory, or a size taken for invalid.
    const bool refused =
        absl::IsResourceExhausted(made.status()) || absl::IsInvalidArgument(made.status());
    if (made.ok() || !refused || smaller >= options.reserve_size) break;
    options.reserve_size = smaller;
    made = CreateExportablePool(driver, options);
    if (made.ok()) {
      LogWarningOnce("private-range",
                     absl::StrCat("reserving ", FormatBytes(first_size),
                                  " of address space for a private pool failed (",
                                  first.message(), "); it reserved ", FormatBytes(smaller)));
    }
  }
  if (!made.ok()) return first;  // why the range it should have had was refused
  std::unique_ptr<Pool> pool = *std::move(made);
  pool->SetKeepMemory(true);
  pool->SetMappingListener(&mappings_, MappingSource{device, {id0, id1}});
  {  // counts against the GPU's memory fraction with its pool
    MutexLock state_lock(&mu_);
    VMM_RETURN_IF_ERROR(ShareCapLocked(device, *pool));
  }
  std::shared_ptr<ExplicitPool> entry = Register(std::move(pool), /*is_private=*/true, id0, id1);
  private_[key] = PrivateUse{entry, 1};
  return entry->id;
}

absl::StatusOr<int> ProcessState::ReleasePrivatePool(int device, uint64_t id0, uint64_t id1) {
  std::shared_ptr<ExplicitPool> entry;
  {
    MutexLock lock(&private_mu_);
    auto it = private_.find(PrivateKey{device, id0, id1});
    if (it == private_.end()) {
      return absl::NotFoundError(absl::StrCat("no private pool (", id0, ", ", id1,
                                              ") on device ", device));
    }
    if (--it->second.uses > 0) return it->second.uses;
    entry = std::move(it->second.entry);
    private_.erase(it);
  }
  // No graph replays into it any more: it may give memory back, and takes no new block.
  entry->pool->SetKeepMemory(false);
  std::shared_ptr<ExplicitPool> doomed;  // destroyed (with `entry`) outside the lock
  {
    MutexLock lock(&mu_);
    if (!entry->closed) CloseLocked(entry, &doomed);
  }
  Retire(doomed);
  if (doomed == nullptr) {
    // Blocks are left: what is cached goes now, the rest with the pool (BlockGone).
    absl::Status emptied = entry->pool->EmptyCache();
    if (!emptied.ok()) {
      LogError(absl::StrCat("closing private pool ", entry->id, ": ", emptied.message()));
    }
  }
  return 0;
}

int ProcessState::PrivatePoolUses(int device, uint64_t id0, uint64_t id1) {
  MutexLock lock(&private_mu_);
  auto it = private_.find(PrivateKey{device, id0, id1});
  return it == private_.end() ? 0 : it->second.uses;
}

absl::StatusOr<int64_t> ProcessState::FindPrivatePool(int device, uint64_t id0, uint64_t id1) {
  MutexLock lock(&private_mu_);
  auto it = private_.find(PrivateKey{device, id0, id1});
  if (it == private_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no private pool (", id0, ", ", id1, ") on device ", device));
  }
  return it->second.entry->id;
}

std::vector<ProcessState::PoolRef> ProcessState::DevicePools(int device, PoolStats* retired,
                                                             PoolStats* peak_floor) {
  std::vector<PoolRef> out;
  Pool* device_pool = DevicePoolIfAny(device);
  // A device pool made before a fork is the parent's (abandoned at the child's first use).
  if (device_pool != nullptr && device_pool->made_before_fork()) device_pool = nullptr;
  Driver* driver = nullptr;
  if (device_pool != nullptr) {
    out.push_back(PoolRef{device_pool, nullptr});
    driver = device_pool->driver();
  } else if (absl::StatusOr<Driver*> d = DefaultDriver(); d.ok()) {
    driver = *d;
  }
  MutexLock lock(&mu_);
  auto add = [&](const std::shared_ptr<ExplicitPool>& e) {
    if (e->is_private && e->pool->device() == device && !e->pool->made_before_fork() &&
        (driver == nullptr || e->pool->driver() == driver)) {
      out.push_back(PoolRef{e->pool.get(), e});
    }
  };
  for (auto& [id, e] : explicit_) add(e);
  for (const std::shared_ptr<ExplicitPool>& e : retiring_) add(e);
  if (device >= 0 && device < kMaxDevices && (retired != nullptr || peak_floor != nullptr)) {
    AdoptForkLocked();
    if (retired != nullptr) *retired = retired_[device];
    if (peak_floor != nullptr) *peak_floor = peak_floor_[device];
  }
  return out;
}

PoolStats ProcessState::DeviceStats(int device) {
  // The totals of private pools that are gone, read with the list of those alive: a pool is
  // in one of the two (Retire), so no total falls.
  PoolStats total;
  PoolStats peak_floor;
  const std::vector<PoolRef> pools = DevicePools(device, &total, &peak_floor);
  for (const PoolRef& p : pools) AddPoolStats(p.pool->GetStats(), total);
  RaisePeaks(peak_floor, total);
  // The sum of the pools' peaks counts each at its own high, and forgets a pool that is gone;
  // the cap's joint peak is the GPU's (pools of another backend than its device pool's do
  // not share it: ShareCapLocked).
  if (std::shared_ptr<DeviceCap> cap = CapOf(device); cap != nullptr) {
    total.allocated_bytes.peak = std::max(cap->allocated().peak(), total.allocated_bytes.current);
    total.reserved_bytes.peak = std::max(cap->reserved().peak(), total.reserved_bytes.current);
    // Read apart from a reset of the two (ResetDevicePeaks), which sets reserved first: the
    // allocated peak held within the reserved one, as after the reset.
    HoldPeakWithin(total.allocated_bytes, total.reserved_bytes);
    // Figures that are parts of those (an arena's share, the bytes requested of what was
    // allocated) peak no higher than the whole, as PyTorch's do; their own peaks are sums.
    HoldPeakWithin(total.requested_bytes, total.allocated_bytes);
    for (ArenaStats& arena : total.arena) {
      HoldPeakWithin(arena.allocated_bytes, total.allocated_bytes);
      HoldPeakWithin(arena.requested_bytes, arena.allocated_bytes);
      HoldPeakWithin(arena.reserved_bytes, total.reserved_bytes);
    }
  }
  return total;
}

ProcessState::Usage ProcessState::DeviceUsage(int device) {
  if (std::shared_ptr<DeviceCap> cap = CapOf(device); cap != nullptr) {
    // Two figures read apart: a free and the release of its memory (or a growth and the
    // allocation in it) may fall between the reads. Allocated bytes are held within reserved
    // ones, as figures read together would be.
    const int64_t reserved = cap->reserved().current();
    return Usage{std::min(cap->allocated().current(), reserved), reserved};
  }
  const PoolStats stats = DeviceStats(device);
  return Usage{stats.allocated_bytes.current, stats.reserved_bytes.current};
}

void ProcessState::ResetDeviceAccumulated(int device) {
  MutexLock stats_lock(&stats_mu_);
  for (const PoolRef& p : DevicePools(device)) p.pool->ResetAccumulatedStats();
  if (device < 0 || device >= kMaxDevices) return;
  MutexLock lock(&mu_);
  AdoptForkLocked();
  ResetAccumulated(retired_[device]);
}

void ProcessState::ResetDevicePeaks(int device) {
  MutexLock stats_lock(&stats_mu_);
  for (const PoolRef& p : DevicePools(device)) p.pool->ResetPeakStats();
  if (std::shared_ptr<DeviceCap> cap = CapOf(device); cap != nullptr) cap->ResetPeaks();
  if (device < 0 || device >= kMaxDevices) return;
  MutexLock lock(&mu_);
  AdoptForkLocked();
  peak_floor_[device] = PoolStats{};
}

std::shared_ptr<DeviceCap> ProcessState::CapOf(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  MutexLock lock(&mu_);
  AdoptForkLocked();
  return caps_[device];
}

void ProcessState::BlockGone(const std::shared_ptr<ExplicitPool>& entry) {
  if (entry->live.fetch_sub(1) != 1) return;
  // The last live block of an explicit pool: destroy the pool if it was closed.
  std::shared_ptr<ExplicitPool> doomed;  // destroyed after the lock is released
  {
    MutexLock lock(&mu_);
    // An allocation may have begun between the count reaching 0 and this lock (counted under
    // it, before the pool closed): its own end destroys the pool then.
    if (!entry->closed || entry->live.load() != 0) return;
    // By its id, as CloseLocked finds it (a walk of every pool per closed pool's last free).
    if (auto it = explicit_.find(entry->id); it != explicit_.end() && it->second == entry) {
      doomed = std::move(it->second);
      explicit_.erase(it);
      explicit_by_base_.erase(entry->pool->base());
      doomed->pool->DetachMappingListener();  // out of Snapshots() from now on
      if (doomed->is_private) retiring_.push_back(doomed);  // listed until Retire
    }
  }
  Retire(doomed);
}

void ProcessState::Retire(const std::shared_ptr<ExplicitPool>& doomed) {
  if (doomed == nullptr || !doomed->is_private) return;
  const int device = doomed->pool->device();
  const RetireHook hook = retire_hook_.load();
  if (hook != nullptr) hook(*this, device, RetireStage::kStarting);
  MutexLock stats_lock(&stats_mu_);
  // Outside mu_: the pool's lock may be held through a device synchronisation (a sweep's
  // EmptyCache), which would hold every free of the process behind mu_.
  const PoolStats stats = doomed->pool->FreezeStats();
  if (hook != nullptr) hook(*this, device, RetireStage::kFrozen);
  // The GPU's peaks with the pool still counted (it is in retiring_), read outside mu_ as any
  // reader does: where another pool's peak rises between this read and the pool leaving the
  // list, a reader may see the sum fall back by up to that rise, never by the pool's own.
  const PoolStats peaks = device >= 0 && device < kMaxDevices ? DeviceStats(device) : PoolStats{};
  MutexLock lock(&mu_);
  // Off the list and into the totals at once: a reader of DevicePools counts the pool (its
  // frozen figures, from now on) or its totals, never neither nor both.
  if (auto it = std::find(retiring_.begin(), retiring_.end(), doomed); it != retiring_.end()) {
    retiring_.erase(it);
  }
  if (device < 0 || device >= kMaxDevices) return;
  AdoptForkLocked();
  if (doomed->pool->made_before_fork()) return;  // the parent's, counted in the parent
  if (OfAnotherBackendLocked(device, *doomed->pool)) return;  // not among DevicePools either
  AddPoolStats(RetiredStats(stats), retired_[device]);
  RaisePeaks(peaks, peak_floor_[device]);
}

ProcessState::PoolRef ProcessState::Owner(const void* ptr) {
  for (auto& p : device_pools_) {
    Pool* pool = p.load(std::memory_order_acquire);
    if (pool != nullptr && pool->Contains(ptr)) return PoolRef{pool, nullptr};
  }
  MutexLock lock(&mu_);
  // The pool whose range starts last at or below `ptr`, if its range holds it.
  auto it = explicit_by_base_.upper_bound(reinterpret_cast<uintptr_t>(ptr));
  if (it != explicit_by_base_.begin()) {
    const std::shared_ptr<ExplicitPool>& e = std::prev(it)->second;
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

std::vector<Snapshot> ProcessState::Snapshots() {
  std::vector<Snapshot> out;
  for (const PoolRef& p : AllPools()) {
    out.push_back(p.pool->GetSnapshot());
    if (p.keep == nullptr) continue;
    Snapshot& snap = out.back();
    snap.pool_id = p.keep->id;
    snap.mempool_id[0] = p.keep->mempool_id[0];
    snap.mempool_id[1] = p.keep->mempool_id[1];
  }
  return out;
}

std::optional<absl::Status> ProcessState::DeferredFree(const void* ptr, HeldFree verdict) {
  switch (verdict) {
    case HeldFree::kNotHeld:
      return std::nullopt;
    case HeldFree::kDeferred:
      return absl::OkStatus();
    case HeldFree::kFreedTwice:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "double free of the block at ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
      ": it was freed already, and a send holds it until its receiver has imported it"));
}

absl::Status ProcessState::FreeBlock(void* ptr) {
  if (std::optional<absl::Status> deferred = DeferFreeIfHeld(ptr)) return *deferred;
  return FreeBlockNow(ptr);
}

absl::Status ProcessState::FreeBlockNow(void* ptr) {
  PoolRef owner = Owner(ptr);
  if (owner.pool == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "free of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)), ", which no vmm pool allocated"));
  }
  absl::Status freed = owner.pool->Free(ptr);
  // InvalidArgument: not a live block, nothing freed. Any other error is a driver fault met
  // after the block was freed (Pool::Free): it is gone all the same.
  if (absl::IsInvalidArgument(freed)) return freed;
  if (owner.keep != nullptr) BlockGone(owner.keep);
  return freed;
}

absl::StatusOr<BufferDescriptor> ProcessState::Export(const void* ptr) {
  PoolRef owner = Owner(ptr);
  if (owner.pool != nullptr) return ExportBuffer(*owner.pool, const_cast<void*>(ptr));
  const int64_t id = RetainImportAt(ptr);
  if (id == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "export of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
        ": the memory does not belong to a vmm pool (enable vmm_torch or use a vmm Pool) and "
        "is not the start of an imported buffer"));
  }
  absl::StatusOr<BufferDescriptor> d = ForwardImport(id, ptr);
  (void)AddImportRef(id, -1);  // the caller keeps the import alive (see the header)
  return d;
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
    imports_by_ptr_.erase({doomed->ptr(), id});
    imports_.erase(it);
  }
  // Closing synchronizes the devices and unmaps: for a small import on the closing thread,
  // not on the caller's (a tensor's deleter, holding the interpreter lock), where a receiver
  // of many pays it per tensor. A large one is closed here, so that its unmapping (about 1 ms
  // for 8 GiB on an H200) is over before the caller goes on, as a program dropping a big
  // tensor before its next step expects. Not while a capture is under way (capture_window.h:
  // the closing thread waits for it to end); a window that opens meanwhile waits for the close.
  if (doomed->mapped_size() > kCloseInlineBytes) {
    const WorkOutsideCapture closing(/*wanted=*/true);
    if (closing.entered()) {
      doomed.reset();
      return absl::OkStatus();
    }
  }
  CloseLater(std::move(doomed));
  return absl::OkStatus();
}

int64_t ProcessState::ImportAtLocked(const void* ptr) const {
  const DevPtr at = reinterpret_cast<DevPtr>(ptr);
  auto it = imports_by_ptr_.lower_bound({at, std::numeric_limits<int64_t>::min()});
  return it != imports_by_ptr_.end() && it->first == at ? it->second : 0;
}

size_t ProcessState::import_count() {
  MutexLock lock(&mu_);
  return imports_.size();
}

}  // namespace vmm
