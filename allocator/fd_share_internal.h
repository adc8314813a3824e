// fd_share_internal.h: the fd server's wire format and its socket client, for fd_share.cc, its
// tests and the request fuzzer (tests/fd_request_fuzzer.cc). Not an interface: use fd_share.h.
//
// A request is one SOCK_SEQPACKET message:
//   "VMMFDREQ" | count (u32, 1..kMaxTokensPerRequest) | count x (key u64 | nonce 16 bytes)
// (little endian). The server answers each request with one reply message (fd_share.cc), or,
// for a request it cannot read, with an error message and then closes the connection.
//
// An ack request (send_ledger.h: the receiver has imported what a ticket held) has the same
// shape with its own magic, its entries naming holds of the exporter's send ledger:
//   "VMMACKRQ" | count (u32, 1..kMaxTokensPerRequest) | count x (key u64 | nonce 16 bytes)
// and is answered with one message, one status per entry (kAckOk, or kAckUnknown: no such
// hold, whether stale, already acknowledged, expired or forged):
//   "VMMACKRS" | count (u32) | count x status (u32)
// A receiver's later reports on the same sends (SendReport) have the same shape and reply
// with their own magic: "VMMRELRQ" (kReleased: it unmapped the memory) and "VMMFWDRQ"
// (kForwarded: it unmapped it but had sent it on). A connection may send requests of every
// kind, one at a time, under the same deadline.
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

// One token of a request: what the server needs to find and check a registered fd (or, in an
// ack request, a hold of the send ledger).
struct FdRequestEntry {
  uint64_t key = 0;
  std::array<uint8_t, 16> nonce{};

  bool operator==(const FdRequestEntry& other) const {
    return key == other.key && nonce == other.nonce;
  }
};

// The server's limits: a connection is closed when no request arrives within
// kRequestDeadline of its accept or of its last reply, and at most kMaxConnections are open at
// once. Importers keep their connections between fetches (FetchFds), so when all are open and
// a client waits, the connection idle longest since its last reply to a fetch is closed to
// make room (its importer reconnects when it next fetches); with none such, later clients wait
// in the listen backlog until one closes. A connection not answered yet, or whose last request
// was an ack or report, is never closed for another.
inline constexpr std::chrono::milliseconds kRequestDeadline = std::chrono::seconds(2);
inline constexpr size_t kMaxConnections = 32;

// The bytes of a request for `entries` (at most kMaxTokensPerRequest of them).
std::vector<uint8_t> EncodeFdRequest(absl::Span<const FdRequestEntry> entries);

// Reads one request message. InvalidArgument, saying what is wrong, when the bytes are not
// exactly a request of 1..kMaxTokensPerRequest tokens (wrong magic, count out of range, length
// not matching the count). Pure: a request decodes to entries that encode to the same bytes.
absl::StatusOr<std::vector<FdRequestEntry>> DecodeFdRequest(absl::Span<const uint8_t> bytes);

// The bytes of a report request of kind `report` (kImported: an ack) for `entries` (at most
// kMaxTokensPerRequest of them).
std::vector<uint8_t> EncodeAckRequest(absl::Span<const FdRequestEntry> entries,
                                      SendReport report = SendReport::kImported);

// Reads one report request of any kind, as strictly as DecodeFdRequest (InvalidArgument
// saying what is wrong; a request decodes to entries that encode, with its kind
// (AckRequestKind), to the same bytes).
absl::StatusOr<std::vector<FdRequestEntry>> DecodeAckRequest(absl::Span<const uint8_t> bytes);

// The kind of report request `bytes` begins with, by its magic; nullopt for any other
// message (which decoder the server uses).
std::optional<SendReport> AckRequestKind(absl::Span<const uint8_t> bytes);
// Whether `bytes` begins with a report request's magic.
inline bool IsAckRequest(absl::Span<const uint8_t> bytes) {
  return AckRequestKind(bytes).has_value();
}

// The statuses of an ack reply's entries.
inline constexpr uint32_t kAckOk = 0;
inline constexpr uint32_t kAckUnknown = 1;

// The ack reply for `acknowledged` (one flag per entry of the request).
std::vector<uint8_t> EncodeAckReply(const std::vector<bool>& acknowledged);
// Reads the reply to an ack request of `count` entries: for each, whether the hold was
// acknowledged. InvalidArgument when the bytes are not such a reply (magic, count, length, a
// status other than kAckOk or kAckUnknown).
absl::StatusOr<std::vector<bool>> DecodeAckReply(absl::Span<const uint8_t> bytes, size_t count);

// The server's answer to a request it cannot read, before it closes the connection:
//   "VMMFDERR" | code (u32, an absl::StatusCode) | message (the rest, at most 512 bytes).
std::vector<uint8_t> EncodeFdErrorReply(const absl::Status& error);
// The error an error reply carries; nullopt when `bytes` is not an error reply.
std::optional<absl::Status> DecodeFdErrorReply(absl::Span<const uint8_t> bytes);

// FetchFds over the exporter's socket, also for tokens of this very process (FetchFds serves
// those locally), with `timeout` for connecting and for each reply. Errors as FetchFds.
absl::StatusOr<std::vector<UniqueFd>> FetchFdsBySocket(absl::Span<const FdToken> tokens,
                                                       std::chrono::milliseconds timeout);

// Acknowledges the holds `entries` to the fd server of process `pid` with id `server_id`: one
// connection, one request per kMaxTokensPerRequest entries, `timeout` for connecting and for
// each reply. For each entry, whether the exporter knew the hold. Errors (each naming the
// pid): Unavailable (the exporter is gone, or closed the connection without answering),
// DeadlineExceeded, PermissionDenied (it runs as another user and refused), the code of its
// error reply, Internal (a malformed reply), or the system call's error.
absl::StatusOr<std::vector<bool>> AckBySocket(uint32_t pid, uint64_t server_id,
                                              absl::Span<const FdRequestEntry> entries,
                                              std::chrono::milliseconds timeout,
                                              SendReport report = SendReport::kImported);

// What this process's fd server has done with connections since it started (tests): accepted
// them, and closed them to make room for a waiting client.
struct ServerConnectionCounts {
  uint64_t accepted = 0;
  uint64_t evicted = 0;
};
ServerConnectionCounts GetServerConnectionCounts();

// How many connections to fd servers this process keeps for later fetches (tests).
size_t CachedConnections();

// Makes this process's fd server close connections that idle for `deadline` (instead of
// kRequestDeadline) from their next accept or reply on (tests).
void SetRequestDeadlineForTesting(std::chrono::milliseconds deadline);

// Fills `out` with `n` random bytes (getrandom; a weaker source, with an error logged, if it
// fails): the nonces of fds and holds, and server ids.
void RandomBytes(uint8_t* out, size_t n);

// The abstract Unix socket address (without its leading NUL byte) of the fd server of process
// `pid` with id `server_id`.
std::string ServerSocketName(uint32_t pid, uint64_t server_id);

}  // namespace fd_share_internal
}  // namespace vmm

#endif  // VMM_ALLOCATOR_FD_SHARE_INTERNAL_H_
