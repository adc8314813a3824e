#include "allocator/fd_slots.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/uio.h>

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace vmm {
namespace {

constexpr int kUseShift = 48;
constexpr uintptr_t kSlotAlign = 64;  // FdSlots::Slot's
constexpr uint64_t kAddressMask = (uint64_t{1} << kUseShift) - 1;

// A slot as process_vm_readv copies it: its first three words.
struct PublishedFd {
  uint64_t nonce[2];
  uint64_t fd;  // the number + 1 (0: free)
};

uint64_t NonceWord(const FdNonce& nonce, int half) {
  uint64_t w;
  std::memcpy(&w, nonce.data() + 8 * half, 8);
  return w;
}

}  // namespace

absl::StatusOr<uint64_t> FdSlots::Publish(const FdNonce& nonce, int fd) {
  static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                    sizeof(std::atomic<uint64_t>) == sizeof(uint64_t),
                "an importer reads the slot's words as plain words");
  if (free_.empty()) {
    void* mem = mmap(nullptr, kSlotsPerMapping * sizeof(Slot), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mapping the fd server's slots: ", std::strerror(errno)));
    }
    if ((reinterpret_cast<uintptr_t>(mem) + kSlotsPerMapping * sizeof(Slot)) > kAddressMask) {
      munmap(mem, kSlotsPerMapping * sizeof(Slot));
      return absl::ResourceExhaustedError(
          "the fd server's slots were mapped above 2^48, where a key cannot name them");
    }
    Slot* slots = static_cast<Slot*>(mem);
    for (size_t i = kSlotsPerMapping; i-- > 0;) free_.push_back(new (&slots[i]) Slot{});
  }
  Slot* slot = free_.back();
  free_.pop_back();
  ++slot->uses;
  slot->words[2].store(static_cast<uint64_t>(fd) + 1, std::memory_order_relaxed);
  slot->words[0].store(NonceWord(nonce, 0), std::memory_order_relaxed);
  slot->words[1].store(NonceWord(nonce, 1), std::memory_order_release);
  return (uint64_t{slot->uses} << kUseShift) | reinterpret_cast<uintptr_t>(slot);
}

void FdSlots::Withdraw(uint64_t key) {
  Slot* slot = reinterpret_cast<Slot*>(static_cast<uintptr_t>(key & kAddressMask));
  for (auto& word : slot->words) word.store(0, std::memory_order_release);
  // The fd is closed after this: the stores are seen before its number can be taken again.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  free_.push_back(slot);
}

absl::Status CheckPublishedFd(uint32_t pid, uint64_t key, const FdNonce& nonce, int fd) {
  const uintptr_t address = static_cast<uintptr_t>(key & kAddressMask);
  auto stale = [&] {
    return absl::NotFoundError(absl::StrCat("process ", pid, " no longer holds fd ", fd,
                                            " under that handle (its registration ended)"));
  };
  if (address == 0 || address % kSlotAlign != 0) return stale();
  PublishedFd published{};
  iovec local{&published, sizeof(published)};
  iovec remote{reinterpret_cast<void*>(address), sizeof(published)};
  const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(sizeof(published))) {
    if (n < 0 && errno == ESRCH) {
      return absl::UnavailableError(absl::StrCat("the exporting process ", pid, " is gone"));
    }
    if (n < 0 && errno == EPERM) {
      return absl::PermissionDeniedError(absl::StrCat(
          "reading process ", pid, "'s fd registry needs ptrace rights over it"));
    }
    return stale();  // EFAULT: no slot there
  }
  if (published.nonce[0] != NonceWord(nonce, 0) || published.nonce[1] != NonceWord(nonce, 1) ||
      published.fd != static_cast<uint64_t>(fd) + 1) {
    return stale();
  }
  return absl::OkStatus();
}

}  // namespace vmm
