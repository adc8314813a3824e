// fd_share_internal.h: the fd server's wire format and its socket client, for fd_share.cc, its
// tests and the request fuzzer (tests/fd_request_fuzzer.cc). Not an interface: use fd_share.h.
//
// A request is one SOCK_SEQPACKET message:
//   "VMMFDREQ" | count (u32, 1..kMaxTokensPerRequest) | count x (key u64 | nonce 16 bytes)
// (little endian). The server answers each request with one reply message (fd_share.cc), or,
// for a request it cannot read, with an error message and then closes the connection.
#ifndef VMM_ALLOCATOR_FD_SHARE_INTERNAL_H_
#define VMM_ALLOCATOR_FD_SHARE_INTERNAL_H_

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/fd_share.h"
#include "allocator/unique_fd.h"

namespace vmm {
namespace fd_share_internal {

// Tokens (and so fds) per request: one message's fds stay under the kernel's SCM_MAX_FD (253).
inline constexpr size_t kMaxTokensPerRequest = 250;
inline constexpr size_t kRequestHeaderSize = 8 + 4;
inline constexpr size_t kRequestEntrySize = 8 + 16;
inline constexpr size_t kMaxRequestSize =
    kRequestHeaderSize + kMaxTokensPerRequest * kRequestEntrySize;

// One token of a request: what the server needs to find and check a registered fd.
struct FdRequestEntry {
  uint64_t key = 0;
  std::array<uint8_t, 16> nonce{};

  bool operator==(const FdRequestEntry& other) const {
    return key == other.key && nonce == other.nonce;
  }
};

// The server's limits: a connection is closed when no request arrives within
// kRequestDeadline of its accept or of its last reply, and at most kMaxConnections are open at
// once (later clients wait in the listen backlog until one closes).
inline constexpr std::chrono::milliseconds kRequestDeadline = std::chrono::seconds(2);
inline constexpr size_t kMaxConnections = 32;

// The bytes of a request for `entries` (at most kMaxTokensPerRequest of them).
std::vector<uint8_t> EncodeFdRequest(absl::Span<const FdRequestEntry> entries);

// Reads one request message. InvalidArgument, saying what is wrong, when the bytes are not
// exactly a request of 1..kMaxTokensPerRequest tokens (wrong magic, count out of range, length
// not matching the count). Pure: a request decodes to entries that encode to the same bytes.
absl::StatusOr<std::vector<FdRequestEntry>> DecodeFdRequest(absl::Span<const uint8_t> bytes);

// The server's answer to a request it cannot read, before it closes the connection:
//   "VMMFDERR" | code (u32, an absl::StatusCode) | message (the rest, at most 512 bytes).
std::vector<uint8_t> EncodeFdErrorReply(const absl::Status& error);
// The error an error reply carries; nullopt when `bytes` is not an error reply.
std::optional<absl::Status> DecodeFdErrorReply(absl::Span<const uint8_t> bytes);

// FetchFds over the exporter's socket, also for tokens of this very process (FetchFds serves
// those locally), with `timeout` for connecting and for each reply. Errors as FetchFds.
absl::StatusOr<std::vector<UniqueFd>> FetchFdsBySocket(absl::Span<const FdToken> tokens,
                                                       std::chrono::milliseconds timeout);

// The abstract Unix socket address (without its leading NUL byte) of the fd server of process
// `pid` with id `server_id`.
std::string ServerSocketName(uint32_t pid, uint64_t server_id);

}  // namespace fd_share_internal
}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_SHARE_INTERNAL_H_
