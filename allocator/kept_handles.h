// kept_handles.h: what an import keeps of the handles it mapped, so that the importing process
// can describe the same memory to a third one (ReExportImport, sharing.h).
//
// Once an import is mapped the mapping alone holds the memory: the exporter may free it or
// exit. To send the buffer on, the importer needs a handle of its own for every piece, and
// the only time it can get one is the import (a mapping gives none back: on CUDA,
// cuMemRetainAllocationHandle gives a handle the driver refuses to export). What is kept
// depends on the handle type:
//   - POSIX fd: the fd the import fetched from the exporter. A re-export registers a duplicate
//     of it with this process's FdServer (fd_share.h). No driver call: the CUDA driver refuses
//     to export a handle the process imported (cuMemExportToShareableHandle gives
//     CUDA_ERROR_INVALID_VALUE on driver 580), but the fetched fd is the exporter's own export
//     and imports anywhere, also after the exporter freed the memory.
//   - fabric: the imported physical handle, which a re-export passes to Driver::Export. The
//     host backend exports it (the handle then names this process's file); where the driver
//     refuses, the re-export fails with FailedPrecondition saying so.
// Either way the fd or handle also holds the memory, so it must go when the mapping does:
// Release, called after the mapping is unmapped, unregisters the re-exported fds, releases the
// imported handles and closes the fds. A descriptor made by a re-export is then stale, as a
// pool's is once its chunk is released.
//
// Cost: one fd per POSIX-fd piece for the life of the mapping (and, on the host backend, one
// per kept fabric handle, the allocation's file). The POSIX fds kept are capped process-wide
// (KeptFdCap: a quarter of the soft RLIMIT_NOFILE read once, at least 64), so that a process
// holding many small imports does not run out of fds: an import whose fds would pass the cap
// keeps none (its fetched fds close once mapped, as for any import that is not sent on) and
// cannot be sent on (Describe is FailedPrecondition saying so). Fabric handles are not fds
// and are not capped.
//
// A forked child: fork() copies every kept fd, and a copy holds the exporter's memory (on the
// GPU) for the child's life, after this process closed the import. So the child closes its
// copies at the fork (a pthread_atfork handler); it may still close an import its parent made,
// but not send it on (Describe is FailedPrecondition saying so). With PyTorch's allocator a
// forked child cannot send a CUDA tensor at all. Fabric handles are not fds and stay.
//
// Thread safety: thread safe (one mutex, a leaf apart from the driver and the FdServer). The
// mutex is held across fork() (fork_guard.h, ForkLevel::kImports).
#ifndef VMM_ALLOCATOR_KEPT_HANDLES_H_
#define VMM_ALLOCATOR_KEPT_HANDLES_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/descriptor.h"
#include "allocator/driver.h"
#include "allocator/fork_guard.h"
#include "allocator/mutex.h"
#include "allocator/unique_fd.h"

namespace vmm {

class KeptHandles {
 public:
  // For the `pieces` pieces of one mapping made through `driver`, imported as `type`. For
  // POSIX fds, takes `pieces` of the process's kept-fd cap, or, past the cap, keeps no fds.
  KeptHandles(Driver* driver, HandleType type, size_t pieces = 0);
  // Release()s what is still kept (errors are logged).
  ~KeptHandles();
  KeptHandles(const KeptHandles&) = delete;
  KeptHandles& operator=(const KeptHandles&) = delete;

  // Keeps what a re-export of the next mapped piece needs, from `fetched` (what the import was
  // given) and `imported` (the driver's handle, now mapped). An imported handle that is not
  // needed is released at once (the mapping holds the memory); the error of that release is
  // returned (the piece is kept either way).
  absl::Status Add(ShareableHandle fetched, PhysHandle imported);

  // The 64-byte descriptor handles of the pieces, in order: encoded FdTokens of this process's
  // FdServer, or fabric handles the driver exported. Made on the first call and cached; later
  // calls make no driver call and register nothing. On failure nothing new stays registered
  // and the next call tries again. Errors: FailedPrecondition (handle type none; the driver
  // refuses to export a handle this process imported; already released; POSIX fds not kept,
  // the process's kept-fd cap being reached at import; POSIX fds closed in a forked child),
  // the driver's export
  // error, the FdServer's (Unavailable when it cannot listen), the dup's (ResourceExhausted
  // out of fds).
  absl::StatusOr<std::vector<BufferDescriptor::Handle>> Describe();

  // Unregisters the re-exported fds, releases the kept imported handles and closes the kept
  // fds. Call after the mapping is unmapped. Returns the first Release error; idempotent.
  absl::Status Release();

  HandleType type() const { return type_; }
  // Pieces kept (tests).
  size_t size() const;
  // Whether the POSIX fds were kept (false past the cap; true for other handle types).
  bool keeps_fds() const { return keeps_fds_; }

  // The most POSIX fds kept by all the imports of this process together: a quarter of the
  // soft RLIMIT_NOFILE when first asked, at least 64 (unlimited: no cap).
  static size_t KeptFdCap();
  // The POSIX fds kept now, process-wide (tests).
  static size_t KeptFdsInUse();
  // Replaces the cap (0: back to KeptFdCap's); for tests, which reach it without using up
  // the process's fds. Imports made before keep what they took.
  static void SetKeptFdCapForTesting(size_t cap);

 private:
  struct Piece {
    UniqueFd fd;             // kPosixFd: the fetched fd
    PhysHandle handle = 0;   // kFabric: the imported handle (released by Release)
  };
  // The descriptor handle of `piece`; for fds, its FdServer key is appended to `keys`.
  absl::StatusOr<BufferDescriptor::Handle> DescribePiece(const Piece& piece,
                                                         std::vector<uint64_t>& keys)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Driver* const driver_;
  const HandleType type_;
  // Slots of the kept-fd cap this mapping holds (returned by Release), and whether the POSIX
  // fds are kept (set by the constructor only).
  size_t fd_slots_ = 0;
  bool keeps_fds_ = true;
  mutable Mutex mu_;
  std::vector<Piece> pieces_ ABSL_GUARDED_BY(mu_);
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  // What Describe made: the handles, and the FdServer keys to unregister (POSIX fd).
  std::optional<std::vector<BufferDescriptor::Handle>> described_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> fd_keys_ ABSL_GUARDED_BY(mu_);
  // Set in a forked child whose copies of the kept fds were closed at the fork.
  bool fds_closed_at_fork_ ABSL_GUARDED_BY(mu_) = false;
  static void CloseFdsInChild(KeptHandles& kept);
  ForkRegistration fork_{
      ForkLevel::kImports,
      LockWithChild<KeptHandles, &KeptHandles::mu_, &CloseFdsInChild>(this)};  // last
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_KEPT_HANDLES_H_
