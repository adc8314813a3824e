#include "allocator/fd_share.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <iterator>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "allocator/log.h"
#include "allocator/fd_share_internal.h"
#include "allocator/fd_slots.h"
#include "allocator/fork_guard.h"
#include "allocator/mutex.h"
#include "allocator/send_ledger.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

using fd_share_internal::FdRequestEntry;
using fd_share_internal::kMaxRequestSize;
using fd_share_internal::kRequestEntrySize;
using fd_share_internal::kRequestHeaderSize;
using fd_share_internal::RandomBytes;

constexpr char kTokenMagic[8] = {'V', 'M', 'M', 'F', 'D', 'T', 'O', 'K'};
constexpr uint32_t kTokenVersion = 2;  // 2: the slots file's number in the last bytes
constexpr char kRequestMagic[8] = {'V', 'M', 'M', 'F', 'D', 'R', 'E', 'Q'};
constexpr char kReplyMagic[8] = {'V', 'M', 'M', 'F', 'D', 'R', 'S', 'P'};
constexpr char kErrorReplyMagic[8] = {'V', 'M', 'M', 'F', 'D', 'E', 'R', 'R'};
// The report requests, by SendReport: magic, and what errors call them.
struct ReportKind {
  char magic[8];
  const char* name;
};
constexpr ReportKind kReportKinds[] = {
    {{'V', 'M', 'M', 'A', 'C', 'K', 'R', 'Q'}, "ack request"},     // kImported
    {{'V', 'M', 'M', 'R', 'E', 'L', 'R', 'Q'}, "release report"},  // kReleased
    {{'V', 'M', 'M', 'F', 'W', 'D', 'R', 'Q'}, "forward report"},  // kForwarded
};
const ReportKind& KindOf(SendReport report) {
  return kReportKinds[static_cast<size_t>(report)];
}
constexpr char kAckReplyMagic[8] = {'V', 'M', 'M', 'A', 'C', 'K', 'R', 'S'};
constexpr size_t kMaxErrorMessage = 512;
constexpr size_t kBatch = fd_share_internal::kMaxTokensPerRequest;
constexpr size_t kMaxReply = 8 + 4 + kBatch * 4;

using Clock = std::chrono::steady_clock;
using fd_share_internal::kMaxConnections;
using fd_share_internal::kRequestDeadline;

// The idle deadline of the server's connections: kRequestDeadline, unless a test set another
// (fd_share_internal::SetRequestDeadlineForTesting).
std::atomic<int64_t> request_deadline_ms{kRequestDeadline.count()};
std::chrono::milliseconds RequestDeadline() {
  return std::chrono::milliseconds(request_deadline_ms.load(std::memory_order_relaxed));
}

// What this process's server has done with connections (fd_share_internal::
// ServerConnectionCounts), counted by its serving thread.
struct ServerCounters {
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> evicted{0};
};
ServerCounters server_counts;

// A reply entry: kOk, kUnknown (stale or forged token), or kDupFailed with the errno of the
// exporter's failed dup in the upper 16 bits (its own fds ran out: EMFILE, ENFILE).
enum FetchStatus : uint32_t { kOk = 0, kUnknown = 1, kDupFailed = 2 };

// The reply entry for a lookup that gave `fd`, or -1 with `err` (ENOENT: no such token).
uint32_t ReplyCode(int fd, int err) {
  if (fd >= 0) return kOk;
  if (err == ENOENT) return kUnknown;
  return kDupFailed | (static_cast<uint32_t>(err & 0xffff) << 16);
}

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

absl::Status Errno(absl::string_view call) { return absl::ErrnoToStatus(errno, call); }

// The abstract-namespace socket address of the server of process `pid`.
socklen_t ServerAddress(uint32_t pid, uint64_t server_id, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const std::string name = fd_share_internal::ServerSocketName(pid, server_id);
  std::memcpy(addr->sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// The error of a failed send or receive on a socket, by meaning: DeadlineExceeded when the
// socket's timeout passed (or, with MSG_DONTWAIT, nothing could be done now), Unavailable when
// the peer closed the connection, else the system call's error.
absl::Status SocketError(absl::string_view call) {
  const int err = errno;
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return absl::DeadlineExceededError(absl::StrCat(call, ": timed out"));
  }
  if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) {
    return absl::UnavailableError(absl::StrCat(call, ": the peer closed the connection"));
  }
  return absl::ErrnoToStatus(err, call);
}

// Sends one message with `fds` (SCM_RIGHTS). `flags` adds to MSG_NOSIGNAL (the server passes
// MSG_DONTWAIT). Errors as SocketError.
absl::Status SendMessage(int sock, const uint8_t* data, size_t len, absl::Span<const int> fds,
                         int flags = 0) {
  iovec iov{const_cast<uint8_t*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  while (sendmsg(sock, &msg, MSG_NOSIGNAL | flags) < 0) {
    if (errno != EINTR) return SocketError("sendmsg");
  }
  return absl::OkStatus();
}

// Receives one message (and the fds passed with it, close-on-exec; closed when `fds` is null).
// Returns its length; 0 means the peer closed the connection. InvalidArgument when the message
// is longer than `cap` or carries more fds than kBatch; socket errors as SocketError.
absl::StatusOr<size_t> ReceiveMessage(int sock, uint8_t* data, size_t cap,
                                      std::vector<UniqueFd>* fds, int flags = 0) {
  iovec iov{data, cap};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(fds != nullptr ? CMSG_SPACE(sizeof(int) * kBatch) : 0);
  msg.msg_control = control.empty() ? nullptr : control.data();
  msg.msg_controllen = control.size();
  ssize_t got;
  while ((got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags)) < 0) {
    if (errno != EINTR) return SocketError("recvmsg");
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (fds != nullptr) {
        fds->emplace_back(fd);
      } else {
        close(fd);
      }
    }
  }
  if ((msg.msg_flags & MSG_TRUNC) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("message longer than ", cap, " bytes"));
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    return absl::InvalidArgumentError("message with fds that were not asked for");
  }
  return static_cast<size_t>(got);
}

void SetTimeouts(int sock, std::chrono::milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

}  // namespace

uint64_t BootHash() {
  static const uint64_t hash = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string id;
    std::getline(in, id);
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (char c : id) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    return h;
  }();
  return hash;
}

std::array<uint8_t, 64> FdToken::Encode() const {
  std::array<uint8_t, 64> out{};
  std::memcpy(out.data(), kTokenMagic, 8);
  PutU32(&out[8], kTokenVersion);
  PutU32(&out[12], pid);
  PutU64(&out[16], boot_hash);
  PutU64(&out[24], server_id);
  PutU64(&out[32], key);
  std::memcpy(&out[40], nonce.data(), 16);
  PutU32(&out[56], fd);
  out[60] = static_cast<uint8_t>(kind);
  // The slots file's number + 1 (0: none), in 24 bits.
  const uint32_t slots = static_cast<uint32_t>(slots_fd + 1);
  out[61] = static_cast<uint8_t>(slots);
  out[62] = static_cast<uint8_t>(slots >> 8);
  out[63] = static_cast<uint8_t>(slots >> 16);
  return out;
}

absl::StatusOr<FdToken> FdToken::Decode(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("fd token is ", bytes.size(), " bytes, expected 64"));
  }
  if (std::memcmp(bytes.data(), kTokenMagic, 8) != 0) {
    return absl::InvalidArgumentError("not a vmm fd token (bad magic)");
  }
  if (GetU32(&bytes[8]) != kTokenVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported fd token version ", GetU32(&bytes[8])));
  }
  if (bytes[60] > static_cast<uint8_t>(FdToken::Kind::kSendHold)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown fd token kind ", bytes[60]));
  }
  FdToken t;
  t.pid = GetU32(&bytes[12]);
  t.boot_hash = GetU64(&bytes[16]);
  t.server_id = GetU64(&bytes[24]);
  t.key = GetU64(&bytes[32]);
  std::memcpy(t.nonce.data(), &bytes[40], 16);
  t.fd = GetU32(&bytes[56]);
  t.kind = static_cast<FdToken::Kind>(bytes[60]);
  t.slots_fd = static_cast<int32_t>(bytes[61] | (uint32_t{bytes[62]} << 8) |
                                    (uint32_t{bytes[63]} << 16)) -
               1;
  return t;
}

namespace fd_share_internal {

void RandomBytes(uint8_t* out, size_t n) {
  while (n > 0) {
    const ssize_t got = getrandom(out, n, 0);
    if (got <= 0) {
      if (errno == EINTR) continue;
      LogError("getrandom failed; using a weaker source");
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(rand());  // NOLINT
      return;
    }
    out += got;
    n -= static_cast<size_t>(got);
  }
}

std::string ServerSocketName(uint32_t pid, uint64_t server_id) {
  return absl::StrFormat("vmm-fd-%u-%016x", pid, server_id);
}

namespace {

// A request of `magic` for `entries` (fetch and ack requests share the layout).
std::vector<uint8_t> EncodeRequest(const char (&magic)[8],
                                   absl::Span<const FdRequestEntry> entries) {
  std::vector<uint8_t> out(kRequestHeaderSize + entries.size() * kRequestEntrySize);
  std::memcpy(out.data(), magic, 8);
  PutU32(&out[8], static_cast<uint32_t>(entries.size()));
  for (size_t i = 0; i < entries.size(); ++i) {
    uint8_t* entry = &out[kRequestHeaderSize + i * kRequestEntrySize];
    PutU64(entry, entries[i].key);
    std::memcpy(entry + 8, entries[i].nonce.data(), 16);
  }
  return out;
}

// Reads a request of `magic`; `what` names it in errors ("fd request").
absl::StatusOr<std::vector<FdRequestEntry>> DecodeRequest(const char (&magic)[8],
                                                          absl::string_view what,
                                                          absl::Span<const uint8_t> bytes) {
  if (bytes.size() < kRequestHeaderSize) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of ", bytes.size(),
                                                   " bytes is shorter than its ",
                                                   kRequestHeaderSize, "-byte header"));
  }
  if (std::memcmp(bytes.data(), magic, 8) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("not a vmm ", what, " (bad magic)"));
  }
  const uint32_t count = GetU32(&bytes[8]);
  if (count == 0 || count > fd_share_internal::kMaxTokensPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " for ", count, " tokens (1 to ",
                     fd_share_internal::kMaxTokensPerRequest, " per request)"));
  }
  if (bytes.size() != kRequestHeaderSize + size_t{count} * kRequestEntrySize) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of ", bytes.size(),
                                                   " bytes does not hold its ", count,
                                                   " tokens"));
  }
  std::vector<FdRequestEntry> entries(count);
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* entry = &bytes[kRequestHeaderSize + i * kRequestEntrySize];
    entries[i].key = GetU64(entry);
    std::memcpy(entries[i].nonce.data(), entry + 8, 16);
  }
  return entries;
}

}  // namespace

std::vector<uint8_t> EncodeFdRequest(absl::Span<const FdRequestEntry> entries) {
  return EncodeRequest(kRequestMagic, entries);
}

absl::StatusOr<std::vector<FdRequestEntry>> DecodeFdRequest(absl::Span<const uint8_t> bytes) {
  return DecodeRequest(kRequestMagic, "fd request", bytes);
}

std::vector<uint8_t> EncodeAckRequest(absl::Span<const FdRequestEntry> entries,
                                      SendReport report) {
  return EncodeRequest(KindOf(report).magic, entries);
}

absl::StatusOr<std::vector<FdRequestEntry>> DecodeAckRequest(absl::Span<const uint8_t> bytes) {
  const ReportKind& kind = KindOf(AckRequestKind(bytes).value_or(SendReport::kImported));
  return DecodeRequest(kind.magic, kind.name, bytes);
}

std::optional<SendReport> AckRequestKind(absl::Span<const uint8_t> bytes) {
  if (bytes.size() < 8) return std::nullopt;
  for (size_t i = 0; i < std::size(kReportKinds); ++i) {
    if (std::memcmp(bytes.data(), kReportKinds[i].magic, 8) == 0) {
      return static_cast<SendReport>(i);
    }
  }
  return std::nullopt;
}

std::vector<uint8_t> EncodeAckReply(const std::vector<bool>& acknowledged) {
  std::vector<uint8_t> out(12 + 4 * acknowledged.size());
  std::memcpy(out.data(), kAckReplyMagic, 8);
  PutU32(&out[8], static_cast<uint32_t>(acknowledged.size()));
  for (size_t i = 0; i < acknowledged.size(); ++i) {
    PutU32(&out[12 + 4 * i], acknowledged[i] ? kAckOk : kAckUnknown);
  }
  return out;
}

absl::StatusOr<std::vector<bool>> DecodeAckReply(absl::Span<const uint8_t> bytes,
                                                 size_t count) {
  if (bytes.size() < 12 || std::memcmp(bytes.data(), kAckReplyMagic, 8) != 0) {
    return absl::InvalidArgumentError("not a vmm ack reply (bad magic or short)");
  }
  if (GetU32(&bytes[8]) != count || bytes.size() != 12 + 4 * count) {
    return absl::InvalidArgumentError(absl::StrCat("ack reply of ", bytes.size(),
                                                   " bytes does not answer ", count,
                                                   " entries"));
  }
  std::vector<bool> acknowledged(count);
  for (size_t i = 0; i < count; ++i) {
    const uint32_t status = GetU32(&bytes[12 + 4 * i]);
    if (status != kAckOk && status != kAckUnknown) {
      return absl::InvalidArgumentError(absl::StrCat("ack reply: unknown status ", status));
    }
    acknowledged[i] = status == kAckOk;
  }
  return acknowledged;
}

std::vector<uint8_t> EncodeFdErrorReply(const absl::Status& error) {
  const absl::string_view message = error.message().substr(0, kMaxErrorMessage);
  std::vector<uint8_t> out(12 + message.size());
  std::memcpy(out.data(), kErrorReplyMagic, 8);
  PutU32(&out[8], static_cast<uint32_t>(error.code()));
  if (!message.empty()) std::memcpy(out.data() + 12, message.data(), message.size());
  return out;
}

std::optional<absl::Status> DecodeFdErrorReply(absl::Span<const uint8_t> bytes) {
  if (bytes.size() < 12 || std::memcmp(bytes.data(), kErrorReplyMagic, 8) != 0) {
    return std::nullopt;
  }
  const uint32_t code = GetU32(&bytes[8]);
  const absl::string_view message(reinterpret_cast<const char*>(bytes.data()) + 12,
                                  std::min(bytes.size() - 12, kMaxErrorMessage));
  // A code this build does not know (or OK, which is no error) reads as kUnknown.
  const bool known = code > 0 && code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated);
  return absl::Status(known ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                      message);
}

}  // namespace fd_share_internal

// --- The server -------------------------------------------------------------------------

class FdServer::Impl {
 public:
  // Starts listening; on failure the server stays unusable and Register() says why.
  Impl() : pid_(static_cast<uint32_t>(getpid())) {
    server_counts.accepted.store(0, std::memory_order_relaxed);  // not the forked parent's
    server_counts.evicted.store(0, std::memory_order_relaxed);
    RandomBytes(reinterpret_cast<uint8_t*>(&server_id_), sizeof(server_id_));
    // Keys start anywhere below 2^63 (never 0, and no wrap): a forked child's server does not
    // give its own registrations keys that an export registry inherited from its parent
    // holds, and could unregister.
    RandomBytes(reinterpret_cast<uint8_t*>(&next_key_), sizeof(next_key_));
    next_key_ = (next_key_ >> 1) | 1;
    start_ = Start();
    // Never destroyed (a forked child abandons its parent's), so registered for good.
    AtForkForever(ForkLevel::kFdRegistry, LockWithChild<Impl, &Impl::mu_, &CloseInChild>(this));
  }

  absl::StatusOr<FdToken> Register(UniqueFd fd) {
    VMM_RETURN_IF_ERROR(start_);
    if (!fd.valid()) return absl::InvalidArgumentError("FdServer::Register: no fd");
    // Children started later must not inherit it (a driver may export without CLOEXEC).
    if (fcntl(fd.get(), F_SETFD, FD_CLOEXEC) != 0) return Errno("fcntl(F_SETFD, FD_CLOEXEC)");
    FdToken t;
    t.pid = pid_;
    t.boot_hash = BootHash();
    t.server_id = server_id_;
    t.fd = static_cast<uint32_t>(fd.get());
    t.slots_fd = slots_ ? slots_->fd() : -1;
    RandomBytes(t.nonce.data(), t.nonce.size());
    MutexLock lock(&mu_);
    t.key = next_key_++;
    if (slots_) VMM_RETURN_IF_ERROR(slots_->Publish(fd.get(), t.key, t.nonce));
    entries_[t.key] = Entry{std::move(fd), t.nonce};
    return t;
  }

  void Unregister(uint64_t key) {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return;
    Forget(it);
  }

  absl::StatusOr<FdToken> Rekey(uint64_t key) {
    VMM_RETURN_IF_ERROR(start_);
    FdToken t;
    t.pid = pid_;
    t.boot_hash = BootHash();
    t.server_id = server_id_;
    t.slots_fd = slots_ ? slots_->fd() : -1;
    RandomBytes(t.nonce.data(), t.nonce.size());
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      return absl::NotFoundError(absl::StrCat("no fd registered under key ", key));
    }
    // A new fd number too: a pidfd_getfd fetch names the fd by number alone.
    const int moved = fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0);
    if (moved < 0) return Errno("fcntl(F_DUPFD_CLOEXEC)");
    Entry entry{UniqueFd(moved), t.nonce};
    t.key = next_key_++;
    // The new number's slot first: if that fails, the new number closes and the old stays.
    if (slots_) VMM_RETURN_IF_ERROR(slots_->Publish(moved, t.key, t.nonce));
    Forget(it);  // the old number's slot cleared, then the number closed
    t.fd = static_cast<uint32_t>(entry.fd.get());
    entries_[t.key] = std::move(entry);
    return t;
  }

  size_t size() {
    MutexLock lock(&mu_);
    return entries_.size();
  }

  // A duplicate of the registered fd, or -1 with `*err` ENOENT when the key or nonce does not
  // match, or the errno of the failed duplication.
  int Lookup(uint64_t key, const uint8_t* nonce, int* err) {
    MutexLock lock(&mu_);
    return LookupLocked(key, nonce, err);
  }
  int LookupLocked(uint64_t key, const uint8_t* nonce, int* err)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = entries_.find(key);
    if (it == entries_.end() || std::memcmp(it->second.nonce.data(), nonce, 16) != 0) {
      *err = ENOENT;
      return -1;
    }
    const int fd = fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0);
    *err = fd < 0 ? errno : 0;
    return fd;
  }

  absl::StatusOr<FdToken> Address() {
    VMM_RETURN_IF_ERROR(start_);
    FdToken t;
    t.pid = pid_;
    t.boot_hash = BootHash();
    t.server_id = server_id_;
    return t;
  }

  // Makes poll return (best effort: a counter already full will still wake it).
  void Wake() {
    if (!wake_.valid()) return;
    const uint64_t one = 1;
    while (write(wake_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }

  uint32_t pid() const { return pid_; }
  uint64_t server_id() const { return server_id_; }

 private:
  // mu_ is held across fork(), so that a child finds the registry whole. A forked child never
  // serves its parent's fds (FdServer::impl() makes the child a server of its own), and its
  // copies would keep them open: a CUDA allocation exported as an fd stays
  // on the GPU while any copy of that fd is open, so memory the parent released would stay
  // held until every child forked meanwhile (a DataLoader worker) exited. The child closes
  // them at once, with the slots file, the listening socket and the wake-up eventfd (whose
  // copies would let importers connect to a server that never answers) and the connections the
  // parent's serving thread had accepted and the fds kept open after their registration ended
  // (both in open_fds_). Fds being sent are duplicated, sent and closed under mu_ (Answer),
  // so none is in flight at the fork. Only the child's copies close: nothing is
  // written (the slots file is shared with the parent).
  static void CloseInChild(Impl& self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    self.entries_.clear();
    for (const int fd : self.open_fds_) close(fd);
    self.open_fds_.clear();
    self.slots_.reset();
    self.listen_.reset();
    self.wake_.reset();
  }

  struct Entry {
    UniqueFd fd;
    std::array<uint8_t, 16> nonce;
  };

  // An accepted connection's socket (AcceptPending), whose number open_fds_ lists while it is
  // open, so that a forked child closes its copy (CloseInChild): importers that keep a
  // connection to this process would otherwise not see it close when this process exits.
  class ConnFd {
   public:
    ConnFd(Impl* owner, UniqueFd fd) : owner_(owner), fd_(std::move(fd)) {}  // listed already
    ConnFd(ConnFd&& other) noexcept : owner_(other.owner_), fd_(std::move(other.fd_)) {}
    ConnFd& operator=(ConnFd&& other) noexcept {
      if (this != &other) {
        Close();
        owner_ = other.owner_;
        fd_ = std::move(other.fd_);
      }
      return *this;
    }
    ~ConnFd() { Close(); }
    int get() const { return fd_.get(); }

   private:
    // Unlisted and closed under the registry's lock, so that no fork() comes between.
    void Close() {
      if (!fd_.valid()) return;
      MutexLock lock(&owner_->mu_);
      owner_->open_fds_.erase(fd_.get());
      fd_.reset();
    }
    Impl* owner_;
    UniqueFd fd_;
  };

  // One client connection: its socket, when its next request must have arrived, and, while it
  // may be closed to make room for a waiting client, since when it has been idle.
  struct Connection {
    ConnFd fd;
    Clock::time_point deadline;
    // Set when its last reply answered a fetch: importers keep such a connection for their
    // next fetch and reconnect when they find it closed (fd_share.cc's ConnectionCache). Unset
    // while it has not been answered (its first request may be on its way) and after an ack or
    // report (those clients do not reconnect).
    std::optional<Clock::time_point> idle_since;
  };

  // When to try accept4 again after it failed for want of fds, buffers or memory (or for an
  // unexpected reason): a pause of 10 ms that doubles up to 200 ms while failures last (1 s
  // for unexpected errors), so that a process out of fds neither spins nor stops serving.
  // Says once per run of failures what happened, and when accepting works again. Used by the
  // serving thread only.
  class AcceptBackoff {
   public:
    bool Ready(Clock::time_point now) const { return now >= resume_; }
    Clock::time_point resume() const { return resume_; }

    void Failed(int err, Clock::time_point now) {
      const bool transient = err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
      pause_ = transient ? std::min(pause_ * 2, kMaxPause) : std::chrono::milliseconds(1000);
      resume_ = now + pause_;
      if (failures_++ == 0) {
        LogError(absl::StrCat("fd server: cannot accept a connection (",
                              absl::ErrnoToStatus(err, "accept4").message(), "); retrying in ",
                              pause_.count(), " ms and on: importers of this process's memory "
                              "wait until it succeeds"));
      }
    }

    void Succeeded() {
      if (failures_ == 0) return;
      LogWarning(absl::StrCat("fd server: accepting connections again after ", failures_,
                              " failed attempts"));
      failures_ = 0;
      pause_ = kFirstPause / 2;
    }

   private:
    static constexpr std::chrono::milliseconds kFirstPause{10};
    static constexpr std::chrono::milliseconds kMaxPause{200};
    std::chrono::milliseconds pause_ = kFirstPause / 2;
    Clock::time_point resume_;
    uint64_t failures_ = 0;
  };

  absl::Status Start() {
    // Without a slots file the server still serves sockets; pidfd fetches of its tokens are
    // refused (they could not be checked).
    absl::StatusOr<FdSlots> slots = FdSlots::Create(server_id_);
    if (slots.ok() && slots->fd() + 1 >= (1 << 24)) {
      slots = absl::ResourceExhaustedError(absl::StrCat(
          "the fd slots file's number ", slots->fd(), " does not fit a token (24 bits)"));
    }
    if (slots.ok()) {
      slots_.emplace(*std::move(slots));
    } else {
      LogError(absl::StrCat("fd server: no slots file (", slots.status().message(),
                            "): pidfd fetches of its fds are refused"));
    }
    listen_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listen_.valid()) return Errno("socket");
    sockaddr_un addr;
    const socklen_t len = ServerAddress(pid_, server_id_, &addr);
    if (bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) return Errno("bind");
    if (listen(listen_.get(), 64) != 0) return Errno("listen");
    wake_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_.valid()) return Errno("eventfd");
    std::thread([this] { Serve(); }).detach();  // lives as long as the process
    return absl::OkStatus();
  }

  // The serving loop, for the life of the process; nothing ends it. One thread polls the
  // listening socket (while not backing off, and below kMaxConnections or with a connection
  // that may be closed to make room: AcceptPending), the wake-up eventfd
  // and every connection, answers each request as it arrives and closes connections that hang
  // up, fail, send what is not a request, or miss their deadline. Only poll blocks, so no
  // client delays another. While the send ledger holds anything, poll waits at most until
  // its next deadline and never more than a second, and each turn ends the holds whose lease
  // is over (their releases are queued for the ledger's release thread: they may be slow).
  void Serve() {
    std::vector<Connection> conns;
    AcceptBackoff backoff;
    std::vector<uint8_t> request(kMaxRequestSize);
    std::vector<pollfd> polled;
    SendLedger& ledger = SendLedger::Get();
    for (;;) {
      ledger.ExpireDue(SendLedger::RunOn::kReleaseThread);
      const int ledger_timeout = LedgerTimeout(ledger.NextDeadline());
      Clock::time_point now = Clock::now();
      CloseLate(&conns, now);
      const bool accepting =
          backoff.Ready(now) && (conns.size() < kMaxConnections || AnyEvictable(conns));
      polled.clear();
      polled.push_back(pollfd{accepting ? listen_.get() : -1, POLLIN, 0});  // -1: skipped
      polled.push_back(pollfd{wake_.get(), POLLIN, 0});
      for (const Connection& c : conns) polled.push_back(pollfd{c.fd.get(), POLLIN, 0});
      int timeout = PollTimeout(conns, backoff, now);
      if (ledger_timeout >= 0 && (timeout < 0 || ledger_timeout < timeout)) {
        timeout = ledger_timeout;
      }
      if (poll(polled.data(), polled.size(), timeout) < 0) {
        if (errno != EINTR) {
          LogWarningOnce("fd-server-poll", Errno("fd server: poll").message());
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        continue;
      }
      if ((polled[1].revents & POLLIN) != 0) {
        uint64_t count = 0;
        while (read(wake_.get(), &count, sizeof(count)) < 0 && errno == EINTR) {
        }
      }
      // From the back, so that closing a connection (moving the last one into its place)
      // leaves the entries still to visit where they were.
      for (size_t i = conns.size(); i-- > 0;) {
        if (polled[i + kFirstConnection].revents == 0 || ServeRequest(conns[i], request)) {
          continue;
        }
        conns[i] = std::move(conns.back());
        conns.pop_back();
      }
      if ((polled[0].revents & POLLIN) != 0) AcceptPending(&conns, &backoff);
    }
  }

  // Where the connections start in the polled set (after the listening socket and the
  // wake-up eventfd).
  static constexpr size_t kFirstConnection = 2;

  // Milliseconds poll may wait for the send ledger's next deadline `due`: until it, at most a
  // second (so a hold is never missed for long); -1 when the ledger holds nothing.
  static int LedgerTimeout(absl::Time due) {
    if (due == absl::InfiniteFuture()) return -1;
    const absl::Duration left = due - absl::Now();
    if (left <= absl::ZeroDuration()) return 0;
    if (left >= absl::Seconds(1)) return 1000;
    return static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))));
  }

  // Closes the connections whose deadline has passed.
  static void CloseLate(std::vector<Connection>* conns, Clock::time_point now) {
    conns->erase(std::remove_if(conns->begin(), conns->end(),
                                [now](const Connection& c) { return c.deadline <= now; }),
                 conns->end());
  }

  // Milliseconds until the earliest deadline or the end of an accept pause; -1: none.
  static int PollTimeout(const std::vector<Connection>& conns, const AcceptBackoff& backoff,
                         Clock::time_point now) {
    std::optional<Clock::time_point> wake;
    if (!backoff.Ready(now)) wake = backoff.resume();
    for (const Connection& c : conns) {
      if (!wake.has_value() || c.deadline < *wake) wake = c.deadline;
    }
    if (!wake.has_value()) return -1;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count();
    return static_cast<int>(std::max<int64_t>(0, ms));
  }

  // Accepts waiting connections. At the cap, a client that waits gets the place of the
  // connection idle longest after a fetch (CloseLongestIdle); with none, it waits in the
  // backlog until a connection closes. EINTR and ECONNABORTED retry at once; any other failure
  // (EMFILE, ENFILE, ENOBUFS, ENOMEM, or unexpected) pauses accepting (AcceptBackoff) and
  // leaves the connection waiting in the backlog.
  void AcceptPending(std::vector<Connection>* conns, AcceptBackoff* backoff) {
    for (;;) {
      if (conns->size() >= kMaxConnections && (!ClientWaiting() || !CloseLongestIdle(conns))) {
        return;
      }
      int err = 0;
      UniqueFd accepted;
      {
        MutexLock lock(&mu_);  // accepted and listed with no fork() between (ConnFd)
        const int fd = accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        err = fd < 0 ? errno : 0;
        if (fd >= 0) open_fds_.insert(fd);
        accepted.reset(fd);
      }
      ConnFd conn(this, std::move(accepted));
      if (conn.get() < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK) return;  // none waiting
        if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
        backoff->Failed(err, Clock::now());
        return;
      }
      backoff->Succeeded();
      if (!PeerAllowed(conn.get())) continue;
      server_counts.accepted.fetch_add(1, std::memory_order_relaxed);
      conns->push_back(Connection{std::move(conn), Clock::now() + RequestDeadline(), {}});
    }
  }

  // Whether some connection may be closed to make room (Connection::idle_since).
  static bool AnyEvictable(const std::vector<Connection>& conns) {
    return std::any_of(conns.begin(), conns.end(),
                       [](const Connection& c) { return c.idle_since.has_value(); });
  }

  // Whether a client waits in the listen backlog.
  bool ClientWaiting() const {
    pollfd p{listen_.get(), POLLIN, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
  }

  // Closes the connection idle longest among those that may be closed to make room and have
  // no request waiting (one that has is no longer idle: it is skipped, and served on the next
  // turn). False when there is none. A request that arrives just as its connection closes is
  // lost with it: its importer finds the connection reset and reconnects.
  static bool CloseLongestIdle(std::vector<Connection>* conns) {
    for (;;) {
      auto longest = conns->end();
      for (auto it = conns->begin(); it != conns->end(); ++it) {
        if (it->idle_since.has_value() &&
            (longest == conns->end() || *it->idle_since < *longest->idle_since)) {
          longest = it;
        }
      }
      if (longest == conns->end()) return false;
      pollfd p{longest->fd.get(), POLLIN, 0};
      if (poll(&p, 1, 0) != 0) {  // a request (or its hang-up) is waiting, or poll failed
        longest->idle_since.reset();
        continue;
      }
      *longest = std::move(conns->back());
      conns->pop_back();
      server_counts.evicted.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
  }

  // Only the same user (or root) may fetch fds.
  static bool PeerAllowed(int conn) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
    return cred.uid == getuid() || cred.uid == 0;
  }

  // Reads and answers one request (a fetch or an ack) of a connection that poll found ready,
  // renewing its deadline. False when the connection is to be closed: the peer closed it or
  // it failed, or it sent something that is not a request (answered first with an error
  // reply).
  bool ServeRequest(Connection& conn, std::vector<uint8_t>& request) {
    absl::StatusOr<size_t> len =
        ReceiveMessage(conn.fd.get(), request.data(), request.size(), nullptr, MSG_DONTWAIT);
    if (!len.ok()) {
      if (len.status().code() == absl::StatusCode::kDeadlineExceeded) return true;  // none yet
      // Too long, or with fds: not a request.
      if (len.status().code() == absl::StatusCode::kInvalidArgument) {
        RefuseRequest(conn.fd.get(), "fd request", len.status());
      }
      return false;
    }
    if (*len == 0) return false;  // closed by the peer
    const absl::Span<const uint8_t> bytes = absl::MakeConstSpan(request.data(), *len);
    const std::optional<SendReport> report = fd_share_internal::AckRequestKind(bytes);
    const bool ack = report.has_value();
    absl::StatusOr<std::vector<FdRequestEntry>> entries =
        ack ? fd_share_internal::DecodeAckRequest(bytes)
            : fd_share_internal::DecodeFdRequest(bytes);
    if (!entries.ok()) {
      RefuseRequest(conn.fd.get(), ack ? "ack request" : "fd request", entries.status());
      return false;
    }
    const absl::Status sent =
        ack ? AnswerAcks(conn.fd.get(), *entries, *report) : Answer(conn.fd.get(), *entries);
    if (!sent.ok()) {
      // The client not reading its replies (DeadlineExceeded) or gone is its own affair.
      if (sent.code() != absl::StatusCode::kDeadlineExceeded &&
          sent.code() != absl::StatusCode::kUnavailable) {
        LogWarning(absl::StrCat("fd server: cannot send a reply: ", sent.message()));
      }
      return false;
    }
    const Clock::time_point answered = Clock::now();
    conn.deadline = answered + RequestDeadline();
    conn.idle_since = ack ? std::nullopt : std::optional<Clock::time_point>(answered);
    return true;
  }

  // Tells the client why its `what` ("fd request") cannot be read (best effort: it may be
  // gone).
  static void RefuseRequest(int conn, absl::string_view what, const absl::Status& why) {
    const std::vector<uint8_t> reply = fd_share_internal::EncodeFdErrorReply(
        absl::Status(why.code(), absl::StrCat(what, ": ", why.message())));
    SendMessage(conn, reply.data(), reply.size(), {}, MSG_DONTWAIT).IgnoreError();
  }

  // Sends the reply to one request: each token's status, and the fds found, in order.
  absl::Status Answer(int conn, absl::Span<const FdRequestEntry> entries) {
    const uint32_t count = static_cast<uint32_t>(entries.size());
    std::vector<uint8_t> reply(12 + 4 * count);
    std::memcpy(reply.data(), kReplyMagic, 8);
    PutU32(&reply[8], count);
    std::vector<UniqueFd> owned;
    std::vector<int> fds;
    // The duplicates live only under the registry's lock (sent without waiting, then closed):
    // a fork() meanwhile would leave the child copies that nothing closes.
    MutexLock lock(&mu_);
    for (uint32_t i = 0; i < count; ++i) {
      int err = 0;
      const int fd = LookupLocked(entries[i].key, entries[i].nonce.data(), &err);
      PutU32(&reply[12 + 4 * i], ReplyCode(fd, err));
      if (fd >= 0) {
        owned.emplace_back(fd);
        fds.push_back(fd);
      }
    }
    absl::Status sent = SendMessage(conn, reply.data(), reply.size(), fds, MSG_DONTWAIT);
    owned.clear();
    return sent;
  }

  // Acknowledges each hold of an ack request to the send ledger, in order, then sends the
  // reply. Their releases are queued for the ledger's release thread (they may be slow, and
  // may register or unregister fds), so the reply does not wait for them.
  static absl::Status AnswerAcks(int conn, absl::Span<const FdRequestEntry> entries,
                                 SendReport report) {
    std::vector<bool> acknowledged(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      acknowledged[i] = SendLedger::Get()
                            .Report(entries[i].key, entries[i].nonce, report,
                                    SendLedger::RunOn::kReleaseThread)
                            .ok();
    }
    const std::vector<uint8_t> reply = fd_share_internal::EncodeAckReply(acknowledged);
    return SendMessage(conn, reply.data(), reply.size(), {}, MSG_DONTWAIT);
  }

  // Ends the registration at `it`: its slot cleared, then its fd closed (fd_slots.h). If the
  // slot cannot be cleared, the fd is left open rather than closed, so that its number, which
  // a token names, is taken by no other file.
  void Forget(absl::flat_hash_map<uint64_t, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (absl::Status cleared = slots_ ? slots_->Withdraw(it->second.fd.get()) : absl::OkStatus();
        !cleared.ok()) {
      LogError(absl::StrCat("ending an fd registration: ", cleared.message(),
                            "; its fd is kept open"));
      open_fds_.insert(it->second.fd.release());
    }
    entries_.erase(it);
  }

  const uint32_t pid_;
  uint64_t server_id_ = 0;
  UniqueFd listen_;
  UniqueFd wake_;  // an eventfd: written to make poll return (WakeForLedger)
  absl::Status start_;
  // Guards the registry; the serving thread's state is its own. Held across fork()
  // (ForkLevel::kFdRegistry): a forked child closes its copies of the registered fds
  // (CloseInChild) and never uses its parent's server (FdServer::impl() makes the child's own).
  Mutex mu_;
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;  // set at random by the constructor; never 0
  // The slot of each registered fd, where a pidfd_getfd fetch checks it (fd_slots.h); made by
  // Start(), and written under mu_.
  std::optional<FdSlots> slots_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Fds the server holds open outside entries_, which a forked child closes (CloseInChild):
  // the serving thread's open connections (ConnFd), and fds whose registration ended but whose
  // slot could not be cleared (Forget), kept open for the life of the process.
  absl::flat_hash_set<int> open_fds_ ABSL_GUARDED_BY(mu_);
};

namespace {
// Held across fork() (fork_guard.h): a forked child takes it to make its own server.
ABSL_CONST_INIT Mutex server_mu;
const bool server_mu_held_across_fork = [] {
  AtForkForever(ForkLevel::kFdServer, ForkHandlers::Lock(&server_mu));
  return true;
}();
}  // namespace

FdServer& FdServer::Get() {
  static auto* server = new FdServer();
  return *server;
}

FdServer::Impl* FdServer::impl() {
  (void)server_mu_held_across_fork;
  MutexLock lock(&server_mu);
  // A forked child has the parent's object but not its thread or socket: start afresh.
  if (impl_ == nullptr || impl_->pid() != static_cast<uint32_t>(getpid())) impl_ = new Impl();
  return impl_;
}

absl::StatusOr<FdToken> FdServer::Register(UniqueFd fd) {
  return impl()->Register(std::move(fd));
}
void FdServer::Unregister(uint64_t key) { impl()->Unregister(key); }
absl::StatusOr<FdToken> FdServer::Rekey(uint64_t key) { return impl()->Rekey(key); }
size_t FdServer::size() { return impl()->size(); }
absl::StatusOr<FdToken> FdServer::Address() { return impl()->Address(); }
void FdServer::WakeForLedger() { impl()->Wake(); }

// --- The client -------------------------------------------------------------------------

namespace {

// How long an importer waits to connect and for each reply.
constexpr std::chrono::milliseconds kFetchTimeout = std::chrono::seconds(10);

absl::Status Stale(size_t index, uint32_t pid) {
  return absl::NotFoundError(absl::StrCat(
      "stale or forged handle ", index, ": process ", pid,
      " holds no such memory (it was released, or the handle was not exported there)"));
}

// The exporter holds the memory but could not duplicate its fd (its own fds ran out): no
// fault of the handle, and it may work once the exporter has closed some.
absl::Status ExporterCouldNotDup(size_t index, uint32_t pid, int err) {
  return absl::UnavailableError(absl::StrCat(
      "the exporting process (pid ", pid, ") could not duplicate the fd of handle ", index, ": ",
      std::strerror(err), " (the exporter's own resources; retry once it has freed some)"));
}

// The outcome of token `index` (exported by process `pid`) as the server's reply states it
// (ReplyCode's entry): the one place that reads a reply's per-token status.
absl::Status TokenStatus(uint32_t status, size_t index, uint32_t pid) {
  if (status == kOk) return absl::OkStatus();
  if ((status & 0xffff) == kDupFailed) return ExporterCouldNotDup(index, pid, status >> 16);
  return Stale(index, pid);
}

// The server answers only processes of its own user (or root) and closes the connection on
// any other. When an exchange with `pid` failed and that process runs as another user, that
// is why: PermissionDenied saying so; else `cause`.
absl::Status RefusedOrCause(uint32_t pid, absl::Status cause) {
  struct stat st;
  const std::string proc = absl::StrCat("/proc/", pid);
  if (cause.ok() || geteuid() == 0 || ::stat(proc.c_str(), &st) != 0 || st.st_uid == geteuid()) {
    return cause;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the exporting process (pid ", pid, ") refused: not the same user (it runs as uid ",
      st.st_uid, ", this process as uid ", geteuid(),
      "); fds are served only to the same user or root (", cause.message(), ")"));
}

// The importer's error when the exchange with process `pid`'s server failed: it did not
// answer in time (DeadlineExceeded), it closed the connection (Unavailable), or the system
// call's own error.
absl::Status ExchangeError(const absl::Status& error, uint32_t pid,
                           std::chrono::milliseconds timeout) {
  switch (error.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return absl::DeadlineExceededError(absl::StrCat(
          "the exporting process ", pid, " did not answer the fd request within ",
          timeout.count(), " ms (it may be stopped, or its fd server overloaded): ",
          error.message()));
    case absl::StatusCode::kUnavailable:
      return absl::UnavailableError(absl::StrCat(
          "the exporting process ", pid, " closed the connection without answering (it exited, "
          "or no longer serves its fds): its memory cannot be imported (", error.message(), ")"));
    default:
      return absl::Status(error.code(), absl::StrCat("fetching fds from process ", pid, ": ",
                                                     error.message()));
  }
}

// Reads the reply to a request for `tokens` (of process `pid`; the first is token
// `first_index` of the fetch) and appends its fds to `out`.
absl::Status ReadReply(absl::Span<const uint8_t> reply, absl::Span<const FdToken> tokens,
                       size_t first_index, uint32_t pid, std::vector<UniqueFd>& fds,
                       std::vector<UniqueFd>* out) {
  if (std::optional<absl::Status> refused = fd_share_internal::DecodeFdErrorReply(reply)) {
    return absl::Status(refused->code(), absl::StrCat("the exporting process ", pid,
                                                      " refused the fd request: ",
                                                      refused->message()));
  }
  if (reply.size() != 12 + 4 * tokens.size() || std::memcmp(reply.data(), kReplyMagic, 8) != 0 ||
      GetU32(&reply[8]) != tokens.size()) {
    return absl::InternalError(
        absl::StrCat("fd transfer: malformed reply from the exporting process ", pid));
  }
  size_t next_fd = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    VMM_RETURN_IF_ERROR(TokenStatus(GetU32(&reply[12 + 4 * i]), first_index + i, pid));
    if (next_fd >= fds.size()) {
      return absl::InternalError(
          absl::StrCat("fd transfer: fds missing in the reply of process ", pid));
    }
    out->push_back(std::move(fds[next_fd++]));
  }
  return absl::OkStatus();
}

// A reply message and the fds passed with it.
struct Reply {
  std::vector<uint8_t> bytes;
  std::vector<UniqueFd> fds;
};

// Sends `request` over `sock` and receives its reply; the transport only (ReadReply reads the
// reply). Unavailable when the peer closed or reset the connection before answering (EPIPE,
// ECONNRESET or ENOTCONN, or end of stream), DeadlineExceeded when no reply came within the
// socket's timeout, else SocketError's and ReceiveMessage's errors.
absl::StatusOr<Reply> Exchange(int sock, const std::vector<uint8_t>& request) {
  VMM_RETURN_IF_ERROR(SendMessage(sock, request.data(), request.size(), {}));
  Reply reply;
  reply.bytes.resize(kMaxReply);
  VMM_ASSIGN_OR_RETURN(const size_t len,
                       ReceiveMessage(sock, reply.bytes.data(), reply.bytes.size(), &reply.fds));
  if (len == 0) return absl::UnavailableError("end of stream");
  reply.bytes.resize(len);
  return reply;
}

// The fetch request for `tokens`.
std::vector<uint8_t> FetchRequest(absl::Span<const FdToken> tokens) {
  std::vector<FdRequestEntry> entries(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    entries[i] = FdRequestEntry{tokens[i].key, tokens[i].nonce};
  }
  return fd_share_internal::EncodeFdRequest(entries);
}

// A socket connected to the fd server of process `pid` with id `server_id`, with `timeout`
// for sending and receiving on it. Unavailable when no such server listens (the process is
// gone, or no longer serves), else ExchangeError's errors.
absl::StatusOr<UniqueFd> ConnectToServer(uint32_t pid, uint64_t server_id,
                                         std::chrono::milliseconds timeout) {
  UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return Errno("socket");
  SetTimeouts(sock.get(), timeout);
  sockaddr_un addr;
  const socklen_t len = ServerAddress(pid, server_id, &addr);
  if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    if (errno == ECONNREFUSED || errno == ENOENT) {
      return absl::UnavailableError(absl::StrCat(
          "the exporting process ", pid,
          " is gone (or no longer serves its fds): its memory cannot be imported"));
    }
    return ExchangeError(SocketError("connect"), pid, timeout);
  }
  return sock;
}

// Connected sockets to fd servers, kept between fetches so that an importer connects (and the
// exporter accepts) once per exporter rather than once per fetch. A fetch takes a socket out
// for its own use and puts it back once it succeeded; fetches from one server at once use
// sockets of their own. At most kMaxCached are kept (beyond that the least recently used is
// closed), so a process holds at most that many fds for them, and a server at its connection
// cap may close one that idles (the fetch that finds it closed reconnects). Sockets are not
// shared with a fork()ed child: the lock is held across fork() (fork_guard.h,
// ForkLevel::kConnections), so the child never finds it held, and the child closes its copies
// at once. Thread safe.
class ConnectionCache {
 public:
  static constexpr size_t kMaxCached = 8;

  static ConnectionCache& Get() {
    static auto* cache = new ConnectionCache();  // never destroyed: fetches may run at exit
    return *cache;
  }

  // A kept socket to the server of process `pid` with id `server_id` (the one used last),
  // with `timeout` for sending and receiving on it; an invalid fd when none is kept.
  UniqueFd Take(uint32_t pid, uint64_t server_id, std::chrono::milliseconds timeout) {
    UniqueFd sock;
    std::chrono::milliseconds had{0};
    {
      MutexLock lock(&mu_);
      auto newest = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (it->pid == pid && it->server_id == server_id &&
            (newest == entries_.end() || it->last_used > newest->last_used)) {
          newest = it;
        }
      }
      if (newest == entries_.end()) return sock;
      sock = std::move(newest->sock);
      had = newest->timeout;
      *newest = std::move(entries_.back());
      entries_.pop_back();
    }
    if (had != timeout) SetTimeouts(sock.get(), timeout);
    return sock;
  }

  // Keeps `sock`, connected to that server with `timeout` set, for a later fetch; closes the
  // socket used least recently when that makes more than kMaxCached.
  void Put(uint32_t pid, uint64_t server_id, std::chrono::milliseconds timeout, UniqueFd sock) {
    UniqueFd evicted;  // closed once the lock is released
    MutexLock lock(&mu_);
    if (entries_.size() >= kMaxCached) {
      auto oldest = std::min_element(
          entries_.begin(), entries_.end(),
          [](const Entry& a, const Entry& b) { return a.last_used < b.last_used; });
      evicted = std::move(oldest->sock);
      *oldest = std::move(entries_.back());
      entries_.pop_back();
    }
    entries_.push_back(Entry{pid, server_id, timeout, ++uses_, std::move(sock)});
  }

  // Sockets kept now.
  size_t size() {
    MutexLock lock(&mu_);
    return entries_.size();
  }

 private:
  struct Entry {
    uint32_t pid;
    uint64_t server_id;
    std::chrono::milliseconds timeout;  // set on the socket
    uint64_t last_used;                 // uses_ when it was put back
    UniqueFd sock;
  };

  ConnectionCache() {
    AtForkForever(ForkLevel::kConnections,
                  LockWithChild<ConnectionCache, &ConnectionCache::mu_, &ForgetInChild>(this));
  }

  // The lock is held from before fork() to after it, in both processes. The parent's
  // connections are the parent's (a request of the child on one would mix with the parent's),
  // so the child closes its copies.
  static void ForgetInChild(ConnectionCache& cache) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    cache.entries_.clear();
  }

  Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t uses_ ABSL_GUARDED_BY(mu_) = 0;
};

// Whether an exchange failed because the peer closed or reset the connection (Exchange's
// Unavailable).
bool PeerClosed(const absl::Status& exchange) {
  return exchange.code() == absl::StatusCode::kUnavailable;
}

// Fetches `tokens`, all of one server (the first is token `first_index` of the fetch), into
// `out`, one request per kBatch tokens, over a kept connection when there is one
// (ConnectionCache), kept again once all succeeded. The server closes connections that idle
// (past its deadline, or to make room for another client), so when a connection that has
// answered before (a kept one, or one of this fetch) is found closed, the fetch goes on once
// on a new connection (fetching is idempotent). A new connection closed before any answer is
// the exporter's refusal or exit, and fails. Errors as FetchFds.
absl::Status FetchFromServer(absl::Span<const FdToken> tokens, size_t first_index,
                             std::chrono::milliseconds timeout, std::vector<UniqueFd>* out) {
  const uint32_t pid = tokens[0].pid;
  const uint64_t server_id = tokens[0].server_id;
  ConnectionCache& cache = ConnectionCache::Get();
  UniqueFd sock = cache.Take(pid, server_id, timeout);
  bool answered_before = sock.valid();
  bool reconnected = false;
  for (size_t b = 0; b < tokens.size();) {
    if (!sock.valid()) {
      VMM_ASSIGN_OR_RETURN(sock, ConnectToServer(pid, server_id, timeout));
      answered_before = false;
    }
    const size_t n = std::min(kBatch, tokens.size() - b);
    absl::StatusOr<Reply> reply = Exchange(sock.get(), FetchRequest(tokens.subspan(b, n)));
    if (!reply.ok()) {
      if (PeerClosed(reply.status()) && answered_before && !reconnected) {
        reconnected = true;
        sock.reset();
        continue;
      }
      return RefusedOrCause(pid, ExchangeError(reply.status(), pid, timeout));
    }
    VMM_RETURN_IF_ERROR(RefusedOrCause(
        pid, ReadReply(reply->bytes, tokens.subspan(b, n), first_index + b, pid, reply->fds,
                       out)));
    answered_before = true;
    reconnected = false;  // one reconnect per batch: a full server may close an idle one again
    b += n;
  }
  cache.Put(pid, server_id, timeout, std::move(sock));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<UniqueFd>> FetchBySocket(absl::Span<const FdToken> tokens,
                                                    std::chrono::milliseconds timeout) {
  std::vector<UniqueFd> out;
  for (size_t start = 0; start < tokens.size();) {
    // A run of tokens served by the same process.
    size_t end = start + 1;
    while (end < tokens.size() && tokens[end].pid == tokens[start].pid &&
           tokens[end].server_id == tokens[start].server_id) {
      ++end;
    }
    VMM_RETURN_IF_ERROR(
        FetchFromServer(tokens.subspan(start, end - start), start, timeout, &out));
    start = end;
  }
  return out;
}

absl::Status ExporterGone(uint32_t pid) {
  return absl::UnavailableError(absl::StrCat("the exporting process ", pid, " is gone"));
}

// Whether the process of `pidfd` has exited, waiting up to `wait_ms` for it (its pidfd polls
// readable then).
bool HasExited(const UniqueFd& pidfd, int wait_ms = 0) {
  pollfd p{pidfd.get(), POLLIN, 0};
  return poll(&p, 1, wait_ms) == 1 && (p.revents & POLLIN) != 0;
}

// pidfd_getfd of the fd numbered `number` in the process of `pidfd`: the fd, or the error for
// token `index`: Unavailable where the process has exited (whether or not it was reaped),
// NotFound where it has no such fd.
absl::StatusOr<UniqueFd> TakeFd(const UniqueFd& pidfd, uint32_t number, size_t index,
                                uint32_t pid) {
  UniqueFd fd(static_cast<int>(syscall(SYS_pidfd_getfd, pidfd.get(), number, 0)));
  if (fd.valid()) return fd;
  const int err = errno;
  if (err == ESRCH || HasExited(pidfd)) return ExporterGone(pid);
  if (err == EPERM) {
    return absl::PermissionDeniedError(
        "pidfd_getfd needs ptrace rights over the exporter; use the socket transport");
  }
  if (err == EBADF) return Stale(index, pid);
  errno = err;
  return Errno("pidfd_getfd");
}

// An exporter's pidfd and slots file (fd_slots.h), opened for the first of a run of tokens
// that name the same process, server and slots file, and kept for the rest of the run.
struct PidfdExporter {
  uint32_t pid = 0;
  uint64_t server_id = 0;
  int32_t slots_fd = -1;
  UniqueFd pidfd;
  UniqueFd slots;

  bool Serves(const FdToken& t) const {
    return pidfd.valid() && t.pid == pid && t.server_id == server_id && t.slots_fd == slots_fd;
  }
};

// Opens the exporter of token `index` for the tokens after it.
absl::StatusOr<PidfdExporter> OpenPidfdExporter(const FdToken& t, size_t index) {
  // Without its slots file a token cannot be checked.
  if (t.slots_fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "handle ", index, " names no fd slots file of process ", t.pid,
        ", against which a pidfd fetch checks the fd it takes: use the socket transport"));
  }
  PidfdExporter e{t.pid, t.server_id, t.slots_fd, UniqueFd(), UniqueFd()};
  e.pidfd.reset(static_cast<int>(syscall(SYS_pidfd_open, t.pid, 0)));
  if (!e.pidfd.valid()) {
    if (errno == ESRCH) return ExporterGone(t.pid);
    return Errno("pidfd_open");
  }
  // The slots file first: its server never closes it, so a process that lacks it is exiting
  // (its fds are closed before its pidfd polls readable: 100 ms for that) or the token is not
  // its.
  absl::StatusOr<UniqueFd> slots =
      TakeFd(e.pidfd, static_cast<uint32_t>(t.slots_fd), index, t.pid);
  if (absl::IsNotFound(slots.status()) && HasExited(e.pidfd, 100)) return ExporterGone(t.pid);
  VMM_RETURN_IF_ERROR(slots.status());
  e.slots = *std::move(slots);
  return e;
}

absl::StatusOr<std::vector<UniqueFd>> FetchByPidfd(absl::Span<const FdToken> tokens) {
  std::vector<UniqueFd> out;
  PidfdExporter exporter;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const FdToken& t = tokens[i];
    if (!exporter.Serves(t)) {
      VMM_ASSIGN_OR_RETURN(exporter, OpenPidfdExporter(t, i));
    }
    VMM_ASSIGN_OR_RETURN(UniqueFd fd, TakeFd(exporter.pidfd, t.fd, i, t.pid));
    // The number may have been closed and taken by another file since the token was made:
    // its slot, read after the fd was taken, says whether it is still the registration's.
    if (!CheckSlot(exporter.slots, SlotClaim{t.pid, t.server_id, t.fd, t.key, t.nonce}).ok()) {
      return HasExited(exporter.pidfd) ? ExporterGone(t.pid) : Stale(i, t.pid);
    }
    out.push_back(std::move(fd));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<UniqueFd>> FetchFds(absl::Span<const FdToken> tokens, FdFetch how) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i].kind != FdToken::Kind::kFd) {
      return absl::InvalidArgumentError(
          absl::StrCat("handle ", i, " is a send ticket, not an fd token: it names no fd"));
    }
  }
  for (const FdToken& t : tokens) {
    if (t.boot_hash != BootHash()) {
      return absl::InvalidArgumentError(
          "the handle comes from another machine: POSIX fd handles cannot cross machines "
          "(use fabric handles)");
    }
  }
  // Tokens of this very process need no transport.
  std::vector<UniqueFd> out;
  bool all_local = !tokens.empty();
  for (const FdToken& t : tokens) all_local &= t.pid == static_cast<uint32_t>(getpid());
  if (all_local) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      int err = 0;
      const int fd = FdServer::Get().LookupLocal(tokens[i], &err);
      if (fd < 0) return TokenStatus(ReplyCode(fd, err), i, tokens[i].pid);
      out.emplace_back(fd);
    }
    return out;
  }
  return how == FdFetch::kPidfd ? FetchByPidfd(tokens) : FetchBySocket(tokens, kFetchTimeout);
}

absl::StatusOr<std::vector<UniqueFd>> fd_share_internal::FetchFdsBySocket(
    absl::Span<const FdToken> tokens, std::chrono::milliseconds timeout) {
  return FetchBySocket(tokens, timeout);
}

// --- The ack client ---------------------------------------------------------------------

namespace {

// The error of an ack exchange with process `pid` that failed as `error`.
absl::Status AckExchangeError(const absl::Status& error, uint32_t pid,
                              std::chrono::milliseconds timeout) {
  switch (error.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return absl::DeadlineExceededError(absl::StrCat(
          "the exporting process ", pid, " did not answer the ack within ", timeout.count(),
          " ms: ", error.message()));
    case absl::StatusCode::kUnavailable:
      return absl::UnavailableError(absl::StrCat(
          "the exporting process ", pid, " closed the connection without answering the ack (",
          error.message(), ")"));
    default:
      return absl::Status(error.code(), absl::StrCat("acknowledging to process ", pid, ": ",
                                                     error.message()));
  }
}

// Sends one ack request of at most kBatch entries over `sock` and reads its reply into `out`.
absl::Status AckBatch(int sock, uint32_t pid, absl::Span<const FdRequestEntry> entries,
                      std::chrono::milliseconds timeout, SendReport report,
                      std::vector<bool>* out) {
  const std::vector<uint8_t> request = fd_share_internal::EncodeAckRequest(entries, report);
  const absl::Status sent = SendMessage(sock, request.data(), request.size(), {});
  if (!sent.ok()) return AckExchangeError(sent, pid, timeout);
  std::vector<uint8_t> reply(kMaxReply);
  const absl::StatusOr<size_t> len = ReceiveMessage(sock, reply.data(), reply.size(), nullptr);
  if (!len.ok()) return AckExchangeError(len.status(), pid, timeout);
  if (*len == 0) return AckExchangeError(absl::UnavailableError("end of stream"), pid, timeout);
  const absl::Span<const uint8_t> bytes = absl::MakeConstSpan(reply.data(), *len);
  if (std::optional<absl::Status> refused = fd_share_internal::DecodeFdErrorReply(bytes)) {
    return absl::Status(refused->code(), absl::StrCat("the exporting process ", pid,
                                                      " refused the ack: ",
                                                      refused->message()));
  }
  absl::StatusOr<std::vector<bool>> acknowledged =
      fd_share_internal::DecodeAckReply(bytes, entries.size());
  if (!acknowledged.ok()) {
    return absl::InternalError(absl::StrCat("malformed ack reply from the exporting process ",
                                            pid, ": ", acknowledged.status().message()));
  }
  out->insert(out->end(), acknowledged->begin(), acknowledged->end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<bool>> fd_share_internal::AckBySocket(
    uint32_t pid, uint64_t server_id, absl::Span<const FdRequestEntry> entries,
    std::chrono::milliseconds timeout, SendReport report) {
  std::vector<bool> out;
  if (entries.empty()) return out;
  absl::StatusOr<UniqueFd> sock = ConnectToServer(pid, server_id, timeout);
  if (!sock.ok()) {
    if (sock.status().code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(absl::StrCat(
          "the exporting process ", pid, " is gone (or no longer serves): nothing to "
          "acknowledge, it released what it held when it exited"));
    }
    return sock.status();
  }
  out.reserve(entries.size());
  for (size_t b = 0; b < entries.size(); b += kBatch) {
    const size_t n = std::min(kBatch, entries.size() - b);
    VMM_RETURN_IF_ERROR(
        RefusedOrCause(pid, AckBatch(sock->get(), pid, entries.subspan(b, n), timeout, report,
                                     &out)));
  }
  return out;
}

fd_share_internal::ServerConnectionCounts fd_share_internal::GetServerConnectionCounts() {
  return ServerConnectionCounts{server_counts.accepted.load(std::memory_order_relaxed),
                                server_counts.evicted.load(std::memory_order_relaxed)};
}

size_t fd_share_internal::CachedConnections() { return ConnectionCache::Get().size(); }

void fd_share_internal::SetRequestDeadlineForTesting(std::chrono::milliseconds deadline) {
  request_deadline_ms.store(deadline.count(), std::memory_order_relaxed);
}

int FdServer::LookupLocal(const FdToken& token, int* err) {
  Impl* server = impl();
  int ignored = 0;
  if (err == nullptr) err = &ignored;
  if (token.kind != FdToken::Kind::kFd || token.server_id != server->server_id()) {
    *err = ENOENT;
    return -1;
  }
  return server->Lookup(token.key, token.nonce.data(), err);
}

}  // namespace vmm
