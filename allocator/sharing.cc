#include "allocator/sharing.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "allocator/driver_error.h"
#include "allocator/export_registry.h"
#include "allocator/fork_guard.h"
#include "allocator/kept_handles.h"
#include "allocator/unique_fd.h"
#include "allocator/log.h"
#include "allocator/mutex.h"
#include "allocator/status_macros.h"

namespace vmm {

// --- Export -------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Pool>> CreateExportablePool(Driver* driver,
                                                           const PoolOptions& options) {
  return Pool::Create(driver, options, &ExportRegistry::Process());
}

absl::StatusOr<BufferDescriptor> ExportBuffer(Pool& pool, void* ptr,
                                              ExportNeighbours neighbours, ExportUse use,
                                              std::vector<ExportedChunk>* chunks) {
  return ExportRegistry::Process().Export(pool, ptr, neighbours, use, chunks);
}

// --- Import -------------------------------------------------------------------------------

// One contiguous mapping of imported handles; shared by the imports of the same handles.
// Built by one thread (MapHandles) before any other sees it; then only `kept()` changes, and
// that is thread safe.
class ImportedBuffer::Mapping {
 public:
  Mapping(Driver* driver, int device, DevPtr base, size_t size, HandleType type, size_t pieces,
          std::string key)
      : driver_(driver),
        device_(device),
        base_(base),
        size_(size),
        key_(std::move(key)),
        kept_(driver, type, pieces) {}
  ~Mapping();

  // Records that the next `size` bytes after those mapped so far are mapped (pieces are
  // mapped in address order from the base, so the mapped part is always a prefix), from
  // `fetched`, imported as `imported`: what a re-export needs of them is kept until Close
  // (the error is that of releasing an imported handle not needed; the piece counts anyway).
  absl::Status AddPiece(size_t size, ShareableHandle fetched, PhysHandle imported) {
    mapped_ += size;
    sizes_.push_back(size);
    return kept_.Add(std::move(fetched), imported);
  }
  // The devices granted access to the whole mapping: their work may use it until Close.
  void Granted(std::vector<int> devices) { granted_ = std::move(devices); }
  // Waits for the work of the devices granted access (kernels reading a tensor over the
  // import may still run when its last view dies), then unmaps the mapped prefix in one
  // call, releases what was kept for re-exports, and frees the range; reports the first
  // error. If a device cannot be synchronized, its work may still use the range, and
  // unmapping under it is an illegal address on the device: the range is then left mapped
  // and reserved for the process's life (said once, with LogError), what was kept for
  // re-exports is still released, and the synchronize error is reported.
  absl::Status Close();

  DevPtr base() const { return base_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  const std::string& key() const { return key_; }
  // The sizes of the pieces mapped, in address order.
  const std::vector<uint64_t>& sizes() const { return sizes_; }
  KeptHandles& kept() { return kept_; }

  void OnUnmapped(absl::AnyInvocable<void(bool forwarded) &&> done) {
    MutexLock lock(&callbacks_mu_);
    on_unmapped_.push_back(std::move(done));
  }
  void MarkForwarded() { forwarded_.store(true, std::memory_order_relaxed); }
  // Runs the OnUnmapped callbacks once (after Close), forwarded if the range was left mapped.
  void RunUnmapped() {
    std::vector<absl::AnyInvocable<void(bool) &&>> callbacks;
    {
      MutexLock lock(&callbacks_mu_);
      callbacks.swap(on_unmapped_);
    }
    const bool forwarded = forwarded_.load(std::memory_order_relaxed) || leaked_;
    for (auto& done : callbacks) std::move(done)(forwarded);
  }

 private:
  Driver* const driver_;
  const int device_;
  const DevPtr base_;
  const size_t size_;
  const std::string key_;  // empty: not in the cache
  size_t mapped_ = 0;  // bytes mapped from base_
  std::vector<uint64_t> sizes_;
  KeptHandles kept_;
  bool closed_ = false;
  bool leaked_ = false;  // left mapped by Close (a device could not be synchronized)
  std::vector<int> granted_;  // devices with access (set once the import is complete)
  std::atomic<bool> forwarded_{false};
  Mutex callbacks_mu_;
  std::vector<absl::AnyInvocable<void(bool) &&>> on_unmapped_ ABSL_GUARDED_BY(callbacks_mu_);
  // callbacks_mu_ is held across fork() (fork_guard.h; kept_'s lock too): a forked child may
  // close an import its parent made. Last: unregistered before the rest goes.
  ForkRegistration fork_{ForkLevel::kImports, ForkHandlers::Lock(&callbacks_mu_)};
};

namespace {

// Open mappings by the identity of what they map. Its lock is held across fork() (fork_guard.h,
// ForkLevel::kImports): a forked child imports through it.
class MappingCache {
 public:
  static MappingCache& Get() {
    static auto* cache = new MappingCache();
    return *cache;
  }
  std::shared_ptr<ImportedBuffer::Mapping> Find(const std::string& key) {
    MutexLock lock(&mu_);
    auto it = open_.find(key);
    return it == open_.end() ? nullptr : it->second.lock();
  }
  void Add(const std::string& key, const std::shared_ptr<ImportedBuffer::Mapping>& mapping) {
    MutexLock lock(&mu_);
    open_[key] = mapping;
  }
  void Remove(const std::string& key, const ImportedBuffer::Mapping* mapping) {
    std::shared_ptr<ImportedBuffer::Mapping> current;  // if the last one, it goes unlocked
    MutexLock lock(&mu_);
    auto it = open_.find(key);
    if (it == open_.end()) return;
    current = it->second.lock();
    if (current == nullptr || current.get() == mapping) open_.erase(it);
  }
  size_t size() {
    MutexLock lock(&mu_);
    return open_.size();
  }

 private:
  MappingCache() { AtForkForever(ForkLevel::kImports, ForkHandlers::Lock(&mu_)); }

  Mutex mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<ImportedBuffer::Mapping>> open_
      ABSL_GUARDED_BY(mu_);
};

std::atomic<int64_t> open_mappings{0};

}  // namespace

ImportedBuffer::Mapping::~Mapping() {
  absl::Status closed = Close();
  if (!closed.ok() && !leaked_) {  // a leak was said by Close
    LogError(absl::StrCat("closing an imported buffer: ", closed.message()));
  }
  RunUnmapped();
}

absl::Status ImportedBuffer::Mapping::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  if (!key_.empty()) MappingCache::Get().Remove(key_, this);
  // One call for all the pieces: on the host backend one mmap puts the reservation's filler
  // back over them, which needs no new map entry, so it works even when the process has run
  // out of them (a piece-by-piece unmap could fail there and leave the mappings).
  absl::Status first;
  // Unmapping under work that still reads or writes the range is an illegal address on the
  // device: finish it first (a tensor's deleter knows none of the streams it was used on).
  for (int device : granted_) {
    absl::Status synced = driver_->SynchronizeDevice(device);
    if (!synced.ok() && first.ok()) {
      first = absl::Status(synced.code(),
                           absl::StrCat("synchronizing device ", device, ": ", synced.message(),
                                        " (the range is left mapped)"));
    }
  }
  if (!first.ok()) {
    // Its work may still run: leave the range mapped and reserved rather than unmap under it.
    leaked_ = true;
    LogError(absl::StrCat("leaving an imported buffer of ", mapped_, " bytes at ",
                          absl::Hex(base_), " mapped for the process's life: ",
                          first.message(), "; unmapping it under work that may still use it "
                          "would be an illegal address on the device"));
    first.Update(kept_.Release());  // the mapping alone holds the memory
    --open_mappings;
    return first;
  }
  if (mapped_ > 0) first.Update(driver_->Unmap(base_, mapped_));
  // The imported handles go after the mapping (both orders keep the memory until both are
  // gone; this one never leaves a mapping whose handle was released), and with them the fds
  // registered for re-exports.
  first.Update(kept_.Release());
  first.Update(driver_->Unreserve(base_, size_));
  --open_mappings;
  return first;
}

ImportedBuffer::~ImportedBuffer() = default;
void ImportedBuffer::OnUnmapped(absl::AnyInvocable<void(bool forwarded) &&> done) {
  mapping_->OnUnmapped(std::move(done));
}
void ImportedBuffer::MarkForwarded() { mapping_->MarkForwarded(); }
DevPtr ImportedBuffer::ptr() const { return mapping_->base() + offset_; }
int ImportedBuffer::device() const { return mapping_->device(); }
HandleType ImportedBuffer::handle_type() const { return mapping_->kept().type(); }
DevPtr ImportedBuffer::mapping_base() const { return mapping_->base(); }
size_t ImportedBuffer::mapped_size() const { return mapping_->size(); }

size_t OpenImportMappings() { return static_cast<size_t>(open_mappings.load()); }

namespace {

absl::Status Owned(const BufferDescriptor& d, const absl::Status& cause) {
  return WithContext(cause, absl::StrCat("importing a buffer of ", d.OwnerForMessages()));
}

absl::StatusOr<int> ResolveDevice(Driver* driver, const BufferDescriptor& d, int requested) {
  const int count = driver->DeviceCount();
  if (requested >= 0) {
    if (requested >= count) {
      return absl::InvalidArgumentError(absl::StrCat("device ", requested, " is out of range: ",
                                                     driver->Name(), " has ", count));
    }
    return requested;
  }
  if (d.owner_uuid().has_value()) {
    for (int i = 0; i < count; ++i) {
      absl::StatusOr<std::string> uuid = driver->DeviceUuid(i);
      if (uuid.ok() && *uuid == *d.owner_uuid()) return i;
    }
  }
  return 0;
}

// The shareable handles of the descriptor, fds fetched from the exporter.
absl::StatusOr<std::vector<ShareableHandle>> Handles(const BufferDescriptor& d, FdFetch how) {
  std::vector<ShareableHandle> out(d.handles().size());
  if (d.handle_type() == HandleType::kFabric) {
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].type = HandleType::kFabric;
      std::memcpy(out[i].fabric.data(), d.handles()[i].data(), kFabricHandleSize);
    }
    return out;
  }
  std::vector<FdToken> tokens;
  for (const auto& bytes : d.handles()) {
    VMM_ASSIGN_OR_RETURN(FdToken token, FdToken::Decode(bytes));
    tokens.push_back(token);
  }
  VMM_ASSIGN_OR_RETURN(std::vector<UniqueFd> fds, FetchFds(tokens, how));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].type = HandleType::kPosixFd;
    out[i].fd = std::move(fds[i]);
  }
  return out;
}

std::string CacheKey(Driver* driver, int device, const BufferDescriptor& d,
                     const std::vector<int>& peers) {
  std::string key = absl::StrCat(static_cast<int>(driver->backend()), "/", device, "/",
                                 static_cast<int>(d.handle_type()), "/");
  for (int p : peers) absl::StrAppend(&key, p, ",");
  for (size_t i = 0; i < d.handles().size(); ++i) {
    key.append(reinterpret_cast<const char*>(d.handles()[i].data()), d.handles()[i].size());
    absl::StrAppend(&key, ":", d.sizes()[i], ";");
  }
  return key;
}

absl::Status CheckImportable(Driver* driver, const BufferDescriptor& d, size_t granularity) {
  if (d.handles().empty()) {
    return absl::InvalidArgumentError("the descriptor has no allocations to map");
  }
  for (size_t i = 0; i < d.sizes().size(); ++i) {
    if (d.sizes()[i] % granularity != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allocation size ", i, " is ", d.sizes()[i], ", not a multiple of the granularity ",
          granularity));
    }
  }
  if (d.backend().has_value() && *d.backend() != driver->backend()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the buffer lives on ", *d.owner_uuid(), ", which the ", driver->Name(),
        " backend of this process cannot map"));
  }
  return absl::OkStatus();
}

// --- What one import may map ---------------------------------------------------------------

// The kernel's default vm.max_map_count, assumed when /proc/sys/vm/max_map_count is unreadable.
constexpr size_t kDefaultMaxMapCount = 65530;

// The newline characters of the file at `path` (read to its end), or an error naming it.
absl::StatusOr<size_t> CountLines(const char* path) {
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  char buf[16384];
  size_t lines = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("read ", path));
    if (n == 0) return lines;
    for (ssize_t i = 0; i < n; ++i) lines += buf[i] == '\n';
  }
}

// vm.max_map_count: the most map entries a process may hold.
size_t MaxMapCount() {
  UniqueFd fd(::open("/proc/sys/vm/max_map_count", O_RDONLY | O_CLOEXEC));
  char buf[32];
  const ssize_t n = fd.valid() ? ::read(fd.get(), buf, sizeof(buf) - 1) : -1;
  size_t value = 0;
  if (n <= 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buf, n)), &value)) {
    return kDefaultMaxMapCount;
  }
  return value;
}

// The fds open in this process (entries of /proc/self/fd, less the one reading it).
absl::StatusOr<size_t> CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return absl::ErrnoToStatus(errno, "opendir /proc/self/fd");
  size_t count = 0;
  while (const dirent* entry = ::readdir(dir)) count += entry->d_name[0] != '.';
  ::closedir(dir);
  return count > 0 ? count - 1 : 0;
}

// ResourceExhausted unless `handles` more map entries fit under the map limit (`limit`, 0:
// vm.max_map_count) beside the process's current maps, with kMapCountHeadroom to spare.
absl::Status CheckMapBudget(size_t handles, size_t limit) {
  if (limit == 0) limit = MaxMapCount();
  VMM_ASSIGN_OR_RETURN(size_t maps, CountLines("/proc/self/maps"));
  if (maps + handles + kMapCountHeadroom <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "mapping ", handles, " handles would exceed this process's map limit: it holds ", maps,
      " maps, the limit (vm.max_map_count) is ", limit, ", and ", kMapCountHeadroom,
      " are kept free for the rest of the process"));
}

// ResourceExhausted unless `handles` more fds fit under RLIMIT_NOFILE beside the open ones,
// with kFdHeadroom to spare.
absl::Status CheckFdBudget(size_t handles) {
  if (handles == 0) return absl::OkStatus();
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return absl::OkStatus();
  }
  VMM_ASSIGN_OR_RETURN(size_t open, CountOpenFds());
  if (open + handles + kFdHeadroom <= limit.rlim_cur) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "keeping ", handles, " fds for this import would exceed this process's open-file "
      "limit: ", open, " fds are open, the limit (RLIMIT_NOFILE) is ", limit.rlim_cur, ", and ",
      kFdHeadroom, " are kept free for the rest of the process"));
}

// The fds an import of `d` keeps open while it is mapped (kept_handles.h): the fds fetched
// for a POSIX-fd descriptor; for a fabric one on the host backend, the files of the imported
// handles (a CUDA handle holds no fd).
size_t KeptFds(Driver* driver, const BufferDescriptor& d) {
  if (d.handle_type() == HandleType::kPosixFd) return d.handles().size();
  if (driver->backend() == Backend::kHost) return d.handles().size();
  return 0;
}

// Refuses, before anything is fetched or reserved, a descriptor whose import this process
// cannot hold (sharing.h: what one import may map).
absl::Status CheckImportBudget(Driver* driver, const BufferDescriptor& d,
                               const ImportOptions& options) {
  const size_t handles = d.handles().size();
  if (handles > kMaxImportHandles) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the descriptor has ", handles, " handles; one import maps at most ", kMaxImportHandles,
        " (vmm's exports carry one per chunk, a handful per buffer)"));
  }
  if (handles <= kUncountedImportHandles) return absl::OkStatus();
  VMM_RETURN_IF_ERROR(CheckMapBudget(handles, options.max_map_count));
  return CheckFdBudget(KeptFds(driver, d));
}

absl::StatusOr<std::shared_ptr<ImportedBuffer::Mapping>> MapHandles(
    Driver* driver, const BufferDescriptor& d, int device, size_t granularity,
    const ImportOptions& options, std::string key) {
  VMM_ASSIGN_OR_RETURN(std::vector<ShareableHandle> handles, Handles(d, options.fd_fetch));
  VMM_ASSIGN_OR_RETURN(DevPtr base, driver->Reserve(d.mapped_size(), granularity));
  ++open_mappings;
  auto mapping = std::make_shared<ImportedBuffer::Mapping>(
      driver, device, base, d.mapped_size(), d.handle_type(), handles.size(), std::move(key));
  // From here on, a failure unmaps, releases what was kept and unreserves through the
  // mapping's destructor.
  DevPtr at = base;
  for (size_t i = 0; i < handles.size(); ++i) {
    VMM_ASSIGN_OR_RETURN(PhysHandle physical, driver->Import(handles[i]));
    absl::Status mapped = driver->Map(at, d.sizes()[i], physical);
    if (!mapped.ok()) {
      (void)driver->Release(physical);  // nothing maps it: the mapping's error is the one
      return mapped;
    }
    VMM_RETURN_IF_ERROR(mapping->AddPiece(d.sizes()[i], std::move(handles[i]), physical));
    at += d.sizes()[i];
  }
  std::vector<int> devices = {device};
  devices.insert(devices.end(), options.peer_devices.begin(), options.peer_devices.end());
  VMM_RETURN_IF_ERROR(driver->SetAccess(base, d.mapped_size(), devices));
  mapping->Granted(std::move(devices));
  return mapping;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ImportedBuffer>> ImportBuffer(Driver* driver,
                                                             const BufferDescriptor& d,
                                                             const ImportOptions& options) {
  if (driver == nullptr) return absl::InvalidArgumentError("ImportBuffer: no driver");
  absl::StatusOr<int> device = ResolveDevice(driver, d, options.device);
  if (!device.ok()) return Owned(d, device.status());
  absl::StatusOr<size_t> granularity = driver->Granularity(*device);
  if (!granularity.ok()) return Owned(d, granularity.status());
  if (absl::Status ok = CheckImportable(driver, d, *granularity); !ok.ok()) return Owned(d, ok);
  if (absl::Status ok = CheckImportBudget(driver, d, options); !ok.ok()) return Owned(d, ok);
  std::string key;
  if (options.share_mappings) {
    key = CacheKey(driver, *device, d, options.peer_devices);
    if (auto open = MappingCache::Get().Find(key)) {
      return std::unique_ptr<ImportedBuffer>(
          new ImportedBuffer(open, d.offset(), d.size(), true, d.owner_uuid()));
    }
  }
  absl::StatusOr<std::shared_ptr<ImportedBuffer::Mapping>> mapping =
      MapHandles(driver, d, *device, *granularity, options, key);
  if (!mapping.ok()) return Owned(d, mapping.status());
  if (!key.empty()) MappingCache::Get().Add(key, *mapping);
  return std::unique_ptr<ImportedBuffer>(
      new ImportedBuffer(*mapping, d.offset(), d.size(), false, d.owner_uuid()));
}

// --- Re-export ------------------------------------------------------------------------------

absl::StatusOr<BufferDescriptor> ReExportImport(ImportedBuffer& buffer) {
  ImportedBuffer::Mapping& mapping = *buffer.mapping_;
  auto owned = [&](const absl::Status& cause) {
    return WithContext(cause, absl::StrCat("re-exporting an imported buffer of ",
                                           OwnerForMessages(buffer.owner_uuid())));
  };
  absl::StatusOr<std::vector<BufferDescriptor::Handle>> handles = mapping.kept().Describe();
  if (!handles.ok()) return owned(handles.status());
  std::vector<std::string> bytes;
  std::vector<int64_t> sizes;
  bytes.reserve(handles->size());
  for (size_t i = 0; i < handles->size(); ++i) {
    bytes.emplace_back(reinterpret_cast<const char*>((*handles)[i].data()), (*handles)[i].size());
    sizes.push_back(static_cast<int64_t>(mapping.sizes()[i]));
  }
  absl::StatusOr<BufferDescriptor> d = BufferDescriptor::FromHandles(
      mapping.kept().type(), bytes, sizes, static_cast<int64_t>(buffer.size()),
      buffer.owner_uuid(), static_cast<int64_t>(buffer.offset_));
  if (!d.ok()) return owned(d.status());
  // Whoever imports the re-export is counted by nobody (marked only once it exists: a failed
  // re-export leaves the import's report as it was).
  mapping.MarkForwarded();
  return d;
}

}  // namespace vmm
