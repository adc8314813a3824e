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
//
// The same 64 bytes, of kind kSendHold, are the tickets of the send ledger (send_ledger.h): its
// key and nonce name a hold in the exporter's SendLedger, a registry apart from the fds, which
// the server consults only for ack requests (fd_share_internal.h). A ticket never fetches an
// fd and an fd token is never acknowledged: each client refuses the other kind before it sends
// anything (InvalidArgument), and the server looks each request's keys up only in its own
// registry, where the random nonce of the other would not match.
#ifndef VMM_ALLOCATOR_FD_SHARE_H_
#define VMM_ALLOCATOR_FD_SHARE_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/unique_fd.h"

namespace vmm {

// Encoding (64 bytes, little endian): "VMMFDTOK" | version u32 (2) | pid u32 | boot hash u64 |
// server id u64 | key u64 | nonce 16 | fd u32 | kind u8 | slots file's fd + 1 (24 bits; 0 in
// a ticket).
// What a receiver reports to the sender about a send (send_ledger.h), one request kind each.
enum class SendReport : uint8_t {
  kImported,   // mapped: the sender may drop what it held for the send
  kReleased,   // unmapped, never forwarded: no mapping of this send is left here
  kForwarded,  // unmapped, but it was sent on (or left mapped): importers are not counted
};

struct FdToken {
  // What the key names in the exporter: a registered fd (FetchFds), or a hold of its send
  // ledger (AckSend, send_ledger.h). Fd tokens have kind 0, the byte they always had there.
  enum class Kind : uint8_t { kFd = 0, kSendHold = 1 };

  uint32_t pid = 0;         // exporting process
  uint64_t boot_hash = 0;   // machine identity (boot id)
  uint64_t server_id = 0;   // random per FdServer start: names its socket
  uint64_t key = 0;         // registry key in that server
  std::array<uint8_t, 16> nonce{};  // random per registration
  uint32_t fd = 0;          // the fd number in the exporter (for kPidfd); 0 in a ticket
  Kind kind = Kind::kFd;
  // The number of the exporter's fd slots file (fd_slots.h: what a kPidfd fetch checks the fd
  // it took against); -1 in a ticket. Encoded in 24 bits.
  int32_t slots_fd = -1;

  std::array<uint8_t, 64> Encode() const;
  // InvalidArgument when the bytes are not a token (wrong length, magic, version or kind).
  // Canonical: a token decodes only from the bytes it encodes to.
  static absl::StatusOr<FdToken> Decode(absl::Span<const uint8_t> bytes);
};

enum class FdFetch { kSocket, kPidfd };

// The process's server of registered fds (a thread, started on first use, restarted in a
// forked child). It serves every connection at once from one poll loop, closes a connection
// that sends no request within 2 s, closes the one idle longest after a fetch when all 32 are
// open and another client waits, and keeps serving when accept fails for want of fds
// (fd_share_internal.h has its limits and wire format). It also answers the acks of the send
// ledger (send_ledger.h) and, while the ledger holds anything, wakes at least once a second to
// end the holds whose lease is over; it calls the ledger with none of its own locks held.
class FdServer {
 public:
  static FdServer& Get();

  // Takes `fd` over (making it close-on-exec) and returns the token that fetches it.
  absl::StatusOr<FdToken> Register(UniqueFd fd);
  // Closes the fd; later fetches of its token fail as stale.
  void Unregister(uint64_t key);
  // Registers the fd of `key` afresh (a new key and nonce, and a new fd number for the same
  // file, the old one closed): later fetches of the old token fail as stale. NotFound if `key`
  // is not registered; the dup's error if it fails (the old registration stays).
  absl::StatusOr<FdToken> Rekey(uint64_t key);
  // Registered fds (for tests and stats).
  size_t size();
  // A duplicate of the fd `token` names if this process registered it, else -1 with *err
  // (when given) ENOENT, or the dup's errno when it failed (EMFILE: out of fds).
  int LookupLocal(const FdToken& token, int* err = nullptr);

  // A token that addresses this server (its pid, boot hash and server id; key 0), starting
  // the server if needed: the send ledger's tickets carry it. Errors: those of starting it
  // (the failed system call's).
  absl::StatusOr<FdToken> Address();
  // Makes the serving loop read the send ledger's next deadline now, when a hold that ends
  // sooner than any other was made (the loop may be blocked with no deadline to wait for).
  void WakeForLedger();

  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

 private:
  FdServer() = default;
  class Impl;
  Impl* impl();
  Impl* impl_ = nullptr;
};

// Fetches the fds named by `tokens` (in order). Errors: InvalidArgument (tokens from another
// machine, or a send ticket among them), Unavailable (exporter gone, it closed the connection without answering, or it
// could not duplicate the fd for lack of its own fds: the message says which),
// DeadlineExceeded (the exporter did not answer within 10 s), NotFound (stale or forged token),
// FailedPrecondition (kPidfd: a token naming no slots file, fd_slots.h),
// PermissionDenied (the exporter runs as another user and refused), or the system call's
// error; those of the socket name the exporter's pid. The connection to an exporter is kept
// for later fetches (a few exporters' at most, never shared with a fork()ed child); one that
// the exporter has closed meanwhile is replaced by a new one, once per fetch.
absl::StatusOr<std::vector<UniqueFd>> FetchFds(absl::Span<const FdToken> tokens,
                                               FdFetch how = FdFetch::kSocket);

// This machine's boot identity, as carried in tokens.
uint64_t BootHash();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_SHARE_H_
