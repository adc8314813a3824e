// fd_slots.h: how an importer that takes an exporter's fd with pidfd_getfd knows that the fd it
// took is the registration its token names (internal to fd_share.cc).
//
// pidfd_getfd takes an fd by its number, and the kernel gives a closed fd's number to the next
// file the process opens. A token kept after its registration ended (the memory freed, the
// chunk released) would fetch whatever took the number: another tensor's memory, or a pool's
// that was never exported. So a process that registers fds keeps a file of slots (a memfd),
// one slot per fd number: the slot of a registered fd holds its registration's nonce and key,
// and is cleared before that fd is closed. Tokens carry the number of the slots file too
// (FdToken::slots_fd). The importer takes that file with pidfd_getfd as well and, after taking
// the token's fd, reads the slot of the token's number: it keeps the fd only if the slot still
// holds the token's nonce and key, for then the fd it took was the registration's file
// throughout. A token holds no address of the exporter's, and the check needs no rights beyond
// those of pidfd_getfd itself.
//
// The file is sparse: kSlotBytes a slot, for fd numbers below kMaxSlots (a registered fd past
// them is refused), then a trailer naming its process and server (magic, pid, server id), so that a
// slots file is taken for that of the token's process and server only: a forked child closes its copy of
// its parent's at the fork, and a file that later takes that number in the child (or any file
// of another process's) must not pass for the child's slots. A token whose
// slots file names some other file of the exporter's fails the check unless that file holds
// the trailer and the slot as the importer expects them: only a process that can write such a
// file into the exporter's hands, and holds pidfd_getfd rights over it anyway, could forge one.
#ifndef VMM_ALLOCATOR_FD_SLOTS_H_
#define VMM_ALLOCATOR_FD_SLOTS_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/unique_fd.h"

namespace vmm {

using FdNonce = std::array<uint8_t, 16>;

// The slots file of one fd server. Thread compatible: the server's mutex guards its writes
// (reads are other processes').
class FdSlots {
 public:
  static constexpr size_t kSlotBytes = 32;  // the nonce, the key, a byte 1 (live), 7 unused
  static constexpr int kMaxSlots = 1 << 22;

  // Makes the slots file of the fd server `server_id` of this process. Errors: those of
  // memfd_create and of writing its trailer.
  static absl::StatusOr<FdSlots> Create(uint64_t server_id);

  // The file's fd number in this process (what tokens carry).
  int fd() const { return file_.get(); }
  // Writes the slot of `fd`. ResourceExhausted for an fd number of kMaxSlots or more; the
  // write's error.
  absl::Status Publish(int fd, uint64_t key, const FdNonce& nonce);
  // Clears the slot of `fd`, before `fd` is closed. The write's error: then the fd must be
  // kept open (its number stays its registration's), not closed.
  absl::Status Withdraw(int fd);

 private:
  explicit FdSlots(UniqueFd file) : file_(std::move(file)) {}
  UniqueFd file_;
};

// What a token says of its registration, as CheckSlot compares it.
struct SlotClaim {
  uint32_t pid = 0;         // the exporting process
  uint64_t server_id = 0;   // its fd server
  uint32_t fd = 0;          // the fd's number there
  uint64_t key = 0;
  FdNonce nonce{};
};

// OK when `slots` (the importer's copy of a file the exporter holds) is the slots file of the
// claim's process and server and holds the claim's key and nonce in the slot of its fd;
// NotFound when not (the registration ended, or the token is not one of this exporter's,
// whatever the file is, or a read of it fails).
absl::Status CheckSlot(const UniqueFd& slots, const SlotClaim& claim);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_SLOTS_H_
