#include "allocator/fd_slots.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace vmm {
namespace {

using Slot = std::array<uint8_t, FdSlots::kSlotBytes>;

Slot SlotOf(uint64_t key, const FdNonce& nonce) {
  Slot slot{};
  std::memcpy(slot.data(), nonce.data(), nonce.size());
  std::memcpy(slot.data() + nonce.size(), &key, sizeof(key));
  return slot;
}

absl::Status ErrnoStatus(const char* what, int err) {
  return absl::Status(absl::ErrnoToStatusCode(err), absl::StrCat(what, ": ", std::strerror(err)));
}

// pwrite of a whole slot (EINTR retried; a short write of 32 bytes to a memfd does not
// happen, and is an error if it does).
absl::Status WriteSlot(int file, int fd, const Slot& slot) {
  const off_t offset = static_cast<off_t>(fd) * static_cast<off_t>(FdSlots::kSlotBytes);
  ssize_t n;
  do {
    n = pwrite(file, slot.data(), slot.size(), offset);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus("writing the fd slots file", errno);
  if (static_cast<size_t>(n) != slot.size()) {
    return absl::InternalError("writing the fd slots file: a short write");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FdSlots> FdSlots::Create() {
  UniqueFd file(memfd_create("vmm-fd-slots", MFD_CLOEXEC));
  if (!file.valid()) return ErrnoStatus("memfd_create (the fd slots file)", errno);
  return FdSlots(std::move(file));
}

absl::Status FdSlots::Publish(int fd, uint64_t key, const FdNonce& nonce) {
  if (fd < 0 || fd >= kMaxSlots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fd ", fd, " is past the ", kMaxSlots, " numbers the fd server keeps slots for"));
  }
  return WriteSlot(file_.get(), fd, SlotOf(key, nonce));
}

absl::Status FdSlots::Withdraw(int fd) { return WriteSlot(file_.get(), fd, Slot{}); }

absl::Status CheckSlot(const UniqueFd& slots, uint32_t fd, uint64_t key, const FdNonce& nonce) {
  auto stale = [&] {
    return absl::NotFoundError(absl::StrCat("fd ", fd, " of the exporter is not the handle's"));
  };
  if (fd >= static_cast<uint32_t>(FdSlots::kMaxSlots)) return stale();
  Slot slot{};
  const off_t offset = static_cast<off_t>(fd) * static_cast<off_t>(FdSlots::kSlotBytes);
  ssize_t n;
  do {
    n = pread(slots.get(), slot.data(), slot.size(), offset);
  } while (n < 0 && errno == EINTR);
  // A file that cannot be read at an offset (a pipe, a socket, a directory) is not a slots
  // file: a token that names one is not the exporter's.
  if (n < 0 && (errno == ESPIPE || errno == EINVAL || errno == EISDIR || errno == EBADF ||
                errno == ENXIO)) {
    return stale();
  }
  if (n < 0) return ErrnoStatus("reading the exporter's fd slots file", errno);
  // Past the file's end (no slot written there): a short read.
  if (static_cast<size_t>(n) != slot.size() || slot != SlotOf(key, nonce)) return stale();
  return absl::OkStatus();
}

}  // namespace vmm
