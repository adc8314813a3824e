#include "allocator/kept_handles.h"

#include <fcntl.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "allocator/driver_error.h"
#include "allocator/fd_share.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

constexpr size_t kMinKeptFdCap = 64;
std::atomic<size_t> kept_fds{0};
std::atomic<size_t> cap_for_testing{0};

size_t CapNow() {
  const size_t testing = cap_for_testing.load(std::memory_order_relaxed);
  return testing != 0 ? testing : KeptHandles::KeptFdCap();
}

// Takes `n` slots of the cap, all or none.
bool TakeFdSlots(size_t n) {
  const size_t cap = CapNow();
  size_t now = kept_fds.load(std::memory_order_relaxed);
  do {
    if (n > cap || now > cap - n) return false;
  } while (!kept_fds.compare_exchange_weak(now, now + n, std::memory_order_relaxed));
  return true;
}

}  // namespace

size_t KeptHandles::KeptFdCap() {
  static const size_t cap = [] {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return kMinKeptFdCap;
    if (limit.rlim_cur == RLIM_INFINITY) return static_cast<size_t>(-1);
    return std::max(kMinKeptFdCap, static_cast<size_t>(limit.rlim_cur / 4));
  }();
  return cap;
}

size_t KeptHandles::KeptFdsInUse() { return kept_fds.load(std::memory_order_relaxed); }

void KeptHandles::SetKeptFdCapForTesting(size_t cap) {
  cap_for_testing.store(cap, std::memory_order_relaxed);
}

KeptHandles::KeptHandles(Driver* driver, HandleType type, size_t pieces)
    : driver_(driver), type_(type) {
  if (type_ != HandleType::kPosixFd || pieces == 0) return;
  if (TakeFdSlots(pieces)) {
    fd_slots_ = pieces;
  } else {
    keeps_fds_ = false;
  }
}

KeptHandles::~KeptHandles() {
  absl::Status released = Release();
  if (!released.ok()) {
    LogError(absl::StrCat("releasing the handles an import kept: ", released.message()));
  }
}

absl::Status KeptHandles::Add(ShareableHandle fetched, PhysHandle imported) {
  Piece piece;
  absl::Status released;
  if (type_ == HandleType::kFabric) {
    piece.handle = imported;
  } else if (imported != 0) {
    released = driver_->Release(imported);
  }
  // The fd moves under the lock, so that a fork() finds it in pieces_ (CloseFdsInChild).
  MutexLock lock(&mu_);
  // Past the cap the fetched fd closes here: the mapping holds the memory.
  if (type_ != HandleType::kFabric && keeps_fds_) piece.fd = std::move(fetched.fd);
  pieces_.push_back(std::move(piece));
  return released;
}

// The child's copies of the kept fds close (kept_handles.h); the parent's registrations of
// them are the parent's server's, which the child never serves.
void KeptHandles::CloseFdsInChild(KeptHandles& kept) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (kept.type_ != HandleType::kPosixFd) return;
  for (Piece& piece : kept.pieces_) piece.fd.reset();
  kept.fds_closed_at_fork_ = true;
  kept.described_.reset();
  kept.fd_keys_.clear();
}

absl::StatusOr<BufferDescriptor::Handle> KeptHandles::DescribePiece(const Piece& piece,
                                                                    std::vector<uint64_t>& keys) {
  BufferDescriptor::Handle out{};
  if (type_ == HandleType::kPosixFd) {
    UniqueFd copy(::fcntl(piece.fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!copy.valid()) {
      return absl::ErrnoToStatus(errno, "duplicating a kept fd (fcntl F_DUPFD_CLOEXEC)");
    }
    VMM_ASSIGN_OR_RETURN(FdToken token, FdServer::Get().Register(std::move(copy)));
    keys.push_back(token.key);
    return token.Encode();
  }
  absl::StatusOr<ShareableHandle> exported = driver_->Export(piece.handle, HandleType::kFabric);
  if (!exported.ok()) {
    if (driver_->backend() == Backend::kCuda && absl::IsInvalidArgument(exported.status())) {
      // What the CUDA driver answers for an imported handle (seen on driver 580 for both
      // handle types): not bad input of the caller's, a limit of the driver.
      return absl::FailedPreconditionError(absl::StrCat(
          "the cuda driver does not export handles this process imported (",
          exported.status().message(),
          "); a fabric buffer cannot be sent on by an importer: send the original descriptor "
          "while its exporter holds the memory"));
    }
    return exported.status();
  }
  std::memcpy(out.data(), exported->fabric.data(), kFabricHandleSize);
  return out;
}

absl::StatusOr<std::vector<BufferDescriptor::Handle>> KeptHandles::Describe() {
  MutexLock lock(&mu_);
  if (described_.has_value()) return *described_;
  if (type_ != HandleType::kPosixFd && type_ != HandleType::kFabric) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the import's handle type is ", HandleTypeName(type_), ": there is nothing to send on"));
  }
  if (released_) {
    return absl::FailedPreconditionError("the import's mapping is closed");
  }
  if (fds_closed_at_fork_) {
    return absl::FailedPreconditionError(
        "this import was made by the parent of this forked process, and its fds were closed "
        "at the fork (a copy would hold the exporter's memory for the child's life); send it "
        "on from the process that imported it");
  }
  if (!keeps_fds()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this process keeps no fds for this import (too many imports open: the fds kept for "
        "sending imports on are capped at ", CapNow(),
        ", a quarter of the open-file limit); send the original descriptor, or a copy"));
  }
  std::vector<BufferDescriptor::Handle> handles;
  std::vector<uint64_t> keys;
  absl::Status failed;
  for (const Piece& piece : pieces_) {
    absl::StatusOr<BufferDescriptor::Handle> handle = DescribePiece(piece, keys);
    if (!handle.ok()) {
      failed = WithContext(handle.status(),
                           absl::StrCat("piece ", handles.size(), " of ", pieces_.size()));
      break;
    }
    handles.push_back(*handle);
  }
  if (!failed.ok()) {
    for (uint64_t key : keys) FdServer::Get().Unregister(key);
    return failed;
  }
  fd_keys_ = std::move(keys);
  described_ = handles;
  return handles;
}

absl::Status KeptHandles::Release() {
  std::vector<Piece> pieces;
  std::vector<uint64_t> keys;
  {
    MutexLock lock(&mu_);
    if (released_) return absl::OkStatus();
    released_ = true;
    pieces = std::move(pieces_);
    pieces_.clear();
    keys = std::move(fd_keys_);
    fd_keys_.clear();
    described_.reset();
  }
  // The kept fds close with `pieces`, below; their slots are free from here on.
  kept_fds.fetch_sub(fd_slots_, std::memory_order_relaxed);
  // Registered duplicates first, so no fetch finds them once the memory may be gone.
  for (uint64_t key : keys) FdServer::Get().Unregister(key);
  absl::Status first;
  for (Piece& piece : pieces) {
    if (piece.handle != 0) first.Update(driver_->Release(piece.handle));
  }
  return first;  // the kept fds close with `pieces`
}

size_t KeptHandles::size() const {
  MutexLock lock(&mu_);
  return pieces_.size();
}

}  // namespace vmm
