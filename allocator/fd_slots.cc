#include "allocator/fd_slots.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace vmm {
namespace {

using Slot = std::array<uint8_t, FdSlots::kSlotBytes>;

constexpr char kTrailerMagic[8] = {'V', 'M', 'M', 'S', 'L', 'O', 'T', 'S'};
constexpr off_t kTrailerOffset = static_cast<off_t>(FdSlots::kMaxSlots) * FdSlots::kSlotBytes;

// The trailer: magic, pid (u32), 4 zero bytes, server id (u64), 8 zero bytes.
Slot TrailerOf(uint32_t pid, uint64_t server_id) {
  Slot trailer{};
  std::memcpy(trailer.data(), kTrailerMagic, sizeof(kTrailerMagic));
  std::memcpy(trailer.data() + 8, &pid, sizeof(pid));
  std::memcpy(trailer.data() + 16, &server_id, sizeof(server_id));
  return trailer;
}

// A live slot: the nonce, the key, then a byte 1, so that no slot of a registration reads as
// a free one (all zero, as the sparse file's holes read).
Slot SlotOf(uint64_t key, const FdNonce& nonce) {
  Slot slot{};
  std::memcpy(slot.data(), nonce.data(), nonce.size());
  std::memcpy(slot.data() + nonce.size(), &key, sizeof(key));
  slot[nonce.size() + sizeof(key)] = 1;
  return slot;
}

absl::Status ErrnoStatus(const char* what, int err) {
  return absl::Status(absl::ErrnoToStatusCode(err), absl::StrCat(what, ": ", std::strerror(err)));
}

// pwrite of a whole slot at `offset` (EINTR retried; a short write of 32 bytes to a memfd
// does not happen, and is an error if it does).
absl::Status WriteSlot(int file, off_t offset, const Slot& slot) {
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

// The slot of fd number `fd`.
off_t SlotOffset(uint32_t fd) {
  return static_cast<off_t>(fd) * static_cast<off_t>(FdSlots::kSlotBytes);
}

// pread of a whole slot at `offset`: whether it read one (a short read past the end, or an
// error of any kind, is no slot).
bool ReadSlot(int file, off_t offset, Slot* slot) {
  ssize_t n;
  do {
    n = pread(file, slot->data(), slot->size(), offset);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(slot->size());
}

}  // namespace

absl::StatusOr<FdSlots> FdSlots::Create(uint64_t server_id) {
  UniqueFd file(memfd_create("vmm-fd-slots", MFD_CLOEXEC));
  if (!file.valid()) return ErrnoStatus("memfd_create (the fd slots file)", errno);
  if (absl::Status s = WriteSlot(file.get(), kTrailerOffset,
                                 TrailerOf(static_cast<uint32_t>(getpid()), server_id));
      !s.ok()) {
    return s;
  }
  return FdSlots(std::move(file));
}

absl::Status FdSlots::Publish(int fd, uint64_t key, const FdNonce& nonce) {
  if (fd < 0 || fd >= kMaxSlots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fd ", fd, " is past the ", kMaxSlots, " numbers the fd server keeps slots for"));
  }
  return WriteSlot(file_.get(), SlotOffset(static_cast<uint32_t>(fd)), SlotOf(key, nonce));
}

absl::Status FdSlots::Withdraw(int fd) {
  return WriteSlot(file_.get(), SlotOffset(static_cast<uint32_t>(fd)), Slot{});
}

absl::Status CheckSlot(const UniqueFd& slots, const SlotClaim& claim) {
  Slot trailer{}, slot{};
  if (claim.fd >= static_cast<uint32_t>(FdSlots::kMaxSlots) ||
      !ReadSlot(slots.get(), kTrailerOffset, &trailer) ||
      trailer != TrailerOf(claim.pid, claim.server_id) ||
      !ReadSlot(slots.get(), SlotOffset(claim.fd), &slot) ||
      slot != SlotOf(claim.key, claim.nonce)) {
    return absl::NotFoundError(absl::StrCat("fd ", claim.fd, " of process ", claim.pid,
                                            " is not the handle's"));
  }
  return absl::OkStatus();
}

}  // namespace vmm
