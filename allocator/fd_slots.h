// fd_slots.h: how an importer that takes an exporter's fd with pidfd_getfd knows that the fd it
// took is the registration its token names (internal to fd_share.cc; tests use it too).
//
// pidfd_getfd takes an fd by its number, and the kernel gives a closed fd's number to the next
// file the process opens. A token kept after its registration ended (the memory freed, the
// chunk released) would fetch whatever took the number: another tensor's memory, or a pool's
// that was never exported. So each registration is published in a slot of memory that stays
// mapped for the life of the process, holding the registration's nonce and fd number, and its
// key carries the slot's address. The importer reads the slot with process_vm_readv (the same
// ptrace rights as pidfd_getfd) after it took the fd, and keeps the fd only if the slot still
// holds the token's nonce and number. The exporter clears a slot before it closes the fd, so
// a match read after the fetch means the fd taken was the registered file all along.
//
// Keys: the slot's address (64-byte aligned, below 2^48) in the low 48 bits and the slot's use
// count in the high 16, so that a key whose registration ended names no live one (the socket
// path looks registrations up by key and nonce; the slot is the pidfd path's check).
#ifndef VMM_ALLOCATOR_FD_SLOTS_H_
#define VMM_ALLOCATOR_FD_SLOTS_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vmm {

using FdNonce = std::array<uint8_t, 16>;

// The slots of one fd server. Not thread safe: the server's mutex guards it.
class FdSlots {
 public:
  FdSlots() = default;
  FdSlots(const FdSlots&) = delete;
  FdSlots& operator=(const FdSlots&) = delete;
  // The slots' memory stays mapped: an importer may read a slot at any time.
  ~FdSlots() = default;

  // Publishes `nonce` and `fd` in a free slot; the registration's key. ResourceExhausted when
  // no memory for more slots could be mapped (mmap's error).
  absl::StatusOr<uint64_t> Publish(const FdNonce& nonce, int fd);
  // Clears the slot of `key` (before its fd is closed) and takes it back. `key` must be one
  // Publish returned and not withdrawn since.
  void Withdraw(uint64_t key);

 private:
  struct alignas(64) Slot {  // 64: kSlotAlign in fd_slots.cc
    // What an importer reads (PublishedFd): the nonce's two halves and the fd number, all zero
    // while the slot is free.
    std::atomic<uint64_t> words[3];
    uint16_t uses;
  };
  static constexpr size_t kSlotsPerMapping = 1024;

  std::vector<Slot*> free_;
};

// OK when, in process `pid`, the slot that `key` names holds `nonce` and `fd`: the fd that
// number names there now is the registration's file (read after taking it). NotFound when it
// does not (the registration ended, or the token was not one of this exporter's); Unavailable
// when the process is gone; PermissionDenied without ptrace rights over it.
absl::Status CheckPublishedFd(uint32_t pid, uint64_t key, const FdNonce& nonce, int fd);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_SLOTS_H_
