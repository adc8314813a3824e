// fd_share.h: moving POSIX file descriptors of exported memory between processes.
//
// A POSIX-fd descriptor (descriptor.h) does not carry fds, which cannot travel as bytes.
// Each of its 64-byte handles is an FdToken naming an fd that the exporting process holds in
// its FdServer. The importer fetches the fds when it imports:
//   - FdFetch::kSocket (default): over a Unix socket to the exporter's FdServer thread, the
//     fds passed with SCM_RIGHTS. Works without ptrace rights; the server only answers
//     processes of the same user (or root) and only tokens whose random nonce matches.
//   - FdFetch::kPidfd: pidfd_open + pidfd_getfd on the exporter's fd number, where ptrace
//     rights allow; it trusts the fd number in the token, so use it only between cooperating
//     processes.
// Like a fabric handle, a token pins nothing: the exporter unregisters an fd when it releases
// the memory, and a later fetch fails cleanly as stale (NotFound). If the exporter has
// exited, or cannot duplicate the fd because its own fds ran out, the fetch fails with
// Unavailable saying which. An exporter of another user refuses: PermissionDenied saying so.
// Tokens from another machine (boot id) are refused.
#ifndef VMM_ALLOCATOR_FD_SHARE_H_
#define VMM_ALLOCATOR_FD_SHARE_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/unique_fd.h"

namespace vmm {

struct FdToken {
  uint32_t pid = 0;         // exporting process
  uint64_t boot_hash = 0;   // machine identity (boot id)
  uint64_t server_id = 0;   // random per FdServer start: names its socket
  uint64_t key = 0;         // registry key in that server
  std::array<uint8_t, 16> nonce{};  // random per registration
  uint32_t fd = 0;          // the fd number in the exporter (for kPidfd)

  std::array<uint8_t, 64> Encode() const;
  // InvalidArgument when the bytes are not a token (wrong magic, version or reserved bytes).
  static absl::StatusOr<FdToken> Decode(absl::Span<const uint8_t> bytes);
};

enum class FdFetch { kSocket, kPidfd };

// The process's server of registered fds (a thread, started on first use, restarted in a
// forked child). It serves every connection at once from one poll loop, closes a connection
// that sends no request within 2 s, and keeps serving when accept fails for want of fds
// (fd_share_internal.h has its limits and wire format).
class FdServer {
 public:
  static FdServer& Get();

  // Takes `fd` over (making it close-on-exec) and returns the token that fetches it.
  absl::StatusOr<FdToken> Register(UniqueFd fd);
  // Closes the fd; later fetches of its token fail as stale.
  void Unregister(uint64_t key);
  // Registered fds (for tests and stats).
  size_t size();
  // A duplicate of the fd `token` names if this process registered it, else -1 with *err
  // (when given) ENOENT, or the dup's errno when it failed (EMFILE: out of fds).
  int LookupLocal(const FdToken& token, int* err = nullptr);

  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

 private:
  FdServer() = default;
  class Impl;
  Impl* impl();
  Impl* impl_ = nullptr;
};

// Fetches the fds named by `tokens` (in order). Errors: InvalidArgument (tokens from another
// machine), Unavailable (exporter gone, it closed the connection without answering, or it
// could not duplicate the fd for lack of its own fds: the message says which),
// DeadlineExceeded (the exporter did not answer within 10 s), NotFound (stale or forged token),
// PermissionDenied (the exporter runs as another user and refused), or the system call's
// error; those of the socket name the exporter's pid.
absl::StatusOr<std::vector<UniqueFd>> FetchFds(absl::Span<const FdToken> tokens,
                                               FdFetch how = FdFetch::kSocket);

// This machine's boot identity, as carried in tokens.
uint64_t BootHash();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_SHARE_H_
