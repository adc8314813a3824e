#include "allocator/fd_export_anchor.h"

#include "absl/strings/str_cat.h"
#include "allocator/log.h"

namespace vmm {

void FdExportAnchors::Hold(uint64_t pool_id, Driver* driver, int device, size_t granularity) {
  MutexLock lock(&mu_);
  if (holders_.contains(pool_id)) return;
  const Key key{driver, device};
  holders_[pool_id] = key;
  Anchor& anchor = anchors_[key];
  if (anchor.holders++ > 0) return;
  absl::StatusOr<PhysHandle> handle =
      driver->Create(device, granularity, HandleTypeBit(HandleType::kPosixFd));
  absl::StatusOr<ShareableHandle> fd =
      handle.ok() ? driver->Export(*handle, HandleType::kPosixFd) : handle.status();
  if (fd.ok()) {
    anchor.handle = *handle;
    anchor.fd = *std::move(fd);
    return;
  }
  LogWarning(absl::StrCat("POSIX fd exports stay unanchored (each may be slower): ",
                          fd.status().message()));
  if (handle.ok()) {
    absl::Status released = driver->Release(*handle);
    if (!released.ok()) {
      LogError(absl::StrCat("releasing the fd export anchor: ", released.message()));
    }
  }
}

void FdExportAnchors::Drop(uint64_t pool_id) {
  MutexLock lock(&mu_);
  auto holder = holders_.find(pool_id);
  if (holder == holders_.end()) return;
  const Key key = holder->second;
  holders_.erase(holder);
  auto it = anchors_.find(key);
  if (it == anchors_.end() || --it->second.holders > 0) return;
  Anchor anchor = std::move(it->second);
  anchors_.erase(it);
  if (anchor.handle == 0) return;
  anchor.fd.fd.reset();  // the fd first, then the allocation it exports
  absl::Status released = key.first->Release(anchor.handle);
  if (!released.ok()) {
    LogError(absl::StrCat("releasing the fd export anchor: ", released.message()));
  }
}

// The parent's anchors are the parent's: the child closes its copies of their fds and releases
// nothing (the allocations are the parent's), and its parent's pools hold nothing here.
void FdExportAnchors::ForgetInChild(FdExportAnchors& anchors) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  anchors.anchors_.clear();
  anchors.holders_.clear();
}

size_t FdExportAnchors::size() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [key, anchor] : anchors_) n += anchor.handle != 0;
  return n;
}

}  // namespace vmm
