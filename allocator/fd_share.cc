#include "allocator/fd_share.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "allocator/log.h"
#include "allocator/mutex.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

constexpr char kTokenMagic[8] = {'V', 'M', 'M', 'F', 'D', 'T', 'O', 'K'};
constexpr uint32_t kTokenVersion = 1;
constexpr char kRequestMagic[8] = {'V', 'M', 'M', 'F', 'D', 'R', 'E', 'Q'};
constexpr char kReplyMagic[8] = {'V', 'M', 'M', 'F', 'D', 'R', 'S', 'P'};
// Fds per message (the kernel's limit, SCM_MAX_FD, is 253).
constexpr size_t kBatch = 250;
constexpr size_t kRequestEntry = 8 + 16;
constexpr size_t kMaxRequest = 8 + 4 + kBatch * kRequestEntry;
constexpr size_t kMaxReply = 8 + 4 + kBatch * 4;

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

// The abstract-namespace socket address of the server of process `pid`.
socklen_t ServerAddress(uint32_t pid, uint64_t server_id, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const std::string name = absl::StrFormat("vmm-fd-%u-%016x", pid, server_id);
  std::memcpy(addr->sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

absl::Status SendMessage(int sock, const uint8_t* data, size_t len, absl::Span<const int> fds) {
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
  while (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) {
    if (errno != EINTR) return Errno("sendmsg");
  }
  return absl::OkStatus();
}

// Receives one message (and the fds passed with it, close-on-exec). Returns its length;
// 0 means the peer closed the connection.
absl::StatusOr<size_t> ReceiveMessage(int sock, uint8_t* data, size_t cap,
                                      std::vector<UniqueFd>* fds) {
  iovec iov{data, cap};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(fds != nullptr ? CMSG_SPACE(sizeof(int) * kBatch) : 0);
  msg.msg_control = control.empty() ? nullptr : control.data();
  msg.msg_controllen = control.size();
  ssize_t got;
  while ((got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC)) < 0) {
    if (errno != EINTR) return Errno("recvmsg");
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
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    return absl::InternalError("fd transfer: message truncated");
  }
  return static_cast<size_t>(got);
}

void SetTimeouts(int sock, int seconds) {
  timeval tv{seconds, 0};
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
  return out;  // bytes 60..63 stay zero
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
  if (GetU32(&bytes[60]) != 0) return absl::InvalidArgumentError("fd token: reserved bytes set");
  FdToken t;
  t.pid = GetU32(&bytes[12]);
  t.boot_hash = GetU64(&bytes[16]);
  t.server_id = GetU64(&bytes[24]);
  t.key = GetU64(&bytes[32]);
  std::memcpy(t.nonce.data(), &bytes[40], 16);
  t.fd = GetU32(&bytes[56]);
  return t;
}

// --- The server -------------------------------------------------------------------------

class FdServer::Impl {
 public:
  // Starts listening; on failure the server stays unusable and Register() says why.
  Impl() : pid_(static_cast<uint32_t>(getpid())) {
    RandomBytes(reinterpret_cast<uint8_t*>(&server_id_), sizeof(server_id_));
    start_ = Start();
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
    RandomBytes(t.nonce.data(), t.nonce.size());
    MutexLock lock(&mu_);
    t.key = next_key_++;
    entries_[t.key] = Entry{std::move(fd), t.nonce};
    return t;
  }

  void Unregister(uint64_t key) {
    MutexLock lock(&mu_);
    entries_.erase(key);
  }

  size_t size() {
    MutexLock lock(&mu_);
    return entries_.size();
  }

  // A duplicate of the registered fd, or -1 with *err: ENOENT when the key or nonce does not
  // match, else the dup's errno (EMFILE: this process is out of fds).
  int Lookup(uint64_t key, const uint8_t* nonce, int* err) {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || std::memcmp(it->second.nonce.data(), nonce, 16) != 0) {
      *err = ENOENT;
      return -1;
    }
    const int fd = fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0);
    *err = fd < 0 ? errno : 0;
    return fd;
  }

  uint32_t pid() const { return pid_; }
  uint64_t server_id() const { return server_id_; }

 private:
  struct Entry {
    UniqueFd fd;
    std::array<uint8_t, 16> nonce;
  };

  absl::Status Start() {
    listen_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!listen_.valid()) return Errno("socket");
    sockaddr_un addr;
    const socklen_t len = ServerAddress(pid_, server_id_, &addr);
    if (bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) return Errno("bind");
    if (listen(listen_.get(), 64) != 0) return Errno("listen");
    std::thread([this] { Serve(); }).detach();  // lives as long as the process
    return absl::OkStatus();
  }

  void Serve() {
    for (;;) {
      UniqueFd conn(accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!conn.valid()) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        LogError(absl::StrCat("fd server stopped: ", Errno("accept4").message()));
        return;
      }
      if (!PeerAllowed(conn.get())) continue;
      SetTimeouts(conn.get(), 5);
      absl::Status served = Answer(conn.get());
      if (!served.ok()) LogWarning(absl::StrCat("fd server: ", served.message()));
    }
  }

  // Only the same user (or root) may fetch fds.
  static bool PeerAllowed(int conn) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
    return cred.uid == getuid() || cred.uid == 0;
  }

  // Answers requests on one connection until the peer closes it.
  absl::Status Answer(int conn) {
    std::vector<uint8_t> request(kMaxRequest);
    for (;;) {
      VMM_ASSIGN_OR_RETURN(size_t len,
                           ReceiveMessage(conn, request.data(), request.size(), nullptr));
      if (len == 0) return absl::OkStatus();
      if (len < 12 || std::memcmp(request.data(), kRequestMagic, 8) != 0) {
        return absl::InvalidArgumentError("malformed request");
      }
      const uint32_t count = GetU32(&request[8]);
      if (count > kBatch || len != 12 + count * kRequestEntry) {
        return absl::InvalidArgumentError("malformed request length");
      }
      std::vector<uint8_t> reply(12 + 4 * count);
      std::memcpy(reply.data(), kReplyMagic, 8);
      PutU32(&reply[8], count);
      std::vector<UniqueFd> owned;
      std::vector<int> fds;
      for (uint32_t i = 0; i < count; ++i) {
        const uint8_t* entry = &request[12 + i * kRequestEntry];
        int err = 0;
        const int fd = Lookup(GetU64(entry), entry + 8, &err);
        PutU32(&reply[12 + 4 * i], ReplyCode(fd, err));
        if (fd >= 0) {
          owned.emplace_back(fd);
          fds.push_back(fd);
        }
      }
      VMM_RETURN_IF_ERROR(SendMessage(conn, reply.data(), reply.size(), fds));
    }
  }

  const uint32_t pid_;
  uint64_t server_id_ = 0;
  UniqueFd listen_;
  absl::Status start_;
  Mutex mu_;
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

namespace {
Mutex server_mu;
}  // namespace

FdServer& FdServer::Get() {
  static auto* server = new FdServer();
  return *server;
}

FdServer::Impl* FdServer::impl() {
  MutexLock lock(&server_mu);
  // A forked child has the parent's object but not its thread or socket: start afresh.
  if (impl_ == nullptr || impl_->pid() != static_cast<uint32_t>(getpid())) impl_ = new Impl();
  return impl_;
}

absl::StatusOr<FdToken> FdServer::Register(UniqueFd fd) {
  return impl()->Register(std::move(fd));
}
void FdServer::Unregister(uint64_t key) { impl()->Unregister(key); }
size_t FdServer::size() { return impl()->size(); }

// --- The client -------------------------------------------------------------------------

namespace {

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

// The error of a failed lookup of handle `index` (ReplyCode's entry `code`).
absl::Status LookupFailed(size_t index, uint32_t pid, uint32_t code) {
  if ((code & 0xffff) == kDupFailed) return ExporterCouldNotDup(index, pid, code >> 16);
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

// Fetches one batch of tokens of one server over `sock`.
absl::Status FetchBatch(int sock, absl::Span<const FdToken> tokens, size_t first_index,
                        std::vector<UniqueFd>* out) {
  std::vector<uint8_t> request(12 + tokens.size() * kRequestEntry);
  std::memcpy(request.data(), kRequestMagic, 8);
  PutU32(&request[8], static_cast<uint32_t>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) {
    PutU64(&request[12 + i * kRequestEntry], tokens[i].key);
    std::memcpy(&request[12 + i * kRequestEntry + 8], tokens[i].nonce.data(), 16);
  }
  VMM_RETURN_IF_ERROR(SendMessage(sock, request.data(), request.size(), {}));
  std::vector<uint8_t> reply(kMaxReply);
  std::vector<UniqueFd> fds;
  VMM_ASSIGN_OR_RETURN(size_t len, ReceiveMessage(sock, reply.data(), reply.size(), &fds));
  if (len != 12 + 4 * tokens.size() || std::memcmp(reply.data(), kReplyMagic, 8) != 0) {
    return absl::InternalError("fd transfer: malformed reply from the exporter");
  }
  size_t next_fd = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint32_t code = GetU32(&reply[12 + 4 * i]);
    if (code != kOk) return LookupFailed(first_index + i, tokens[i].pid, code);
    if (next_fd >= fds.size()) return absl::InternalError("fd transfer: fds missing in reply");
    out->push_back(std::move(fds[next_fd++]));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<UniqueFd>> FetchBySocket(absl::Span<const FdToken> tokens) {
  std::vector<UniqueFd> out;
  for (size_t start = 0; start < tokens.size();) {
    // A run of tokens served by the same process.
    size_t end = start + 1;
    while (end < tokens.size() && tokens[end].pid == tokens[start].pid &&
           tokens[end].server_id == tokens[start].server_id) {
      ++end;
    }
    UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!sock.valid()) return Errno("socket");
    SetTimeouts(sock.get(), 10);
    sockaddr_un addr;
    const socklen_t len = ServerAddress(tokens[start].pid, tokens[start].server_id, &addr);
    if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      if (errno == ECONNREFUSED || errno == ENOENT) {
        return absl::UnavailableError(absl::StrCat(
            "the exporting process ", tokens[start].pid,
            " is gone (or no longer serves its fds): its memory cannot be imported"));
      }
      return Errno("connect");
    }
    for (size_t b = start; b < end; b += kBatch) {
      const size_t n = std::min(kBatch, end - b);
      VMM_RETURN_IF_ERROR(RefusedOrCause(
          tokens[start].pid, FetchBatch(sock.get(), tokens.subspan(b, n), b, &out)));
    }
    start = end;
  }
  return out;
}

absl::StatusOr<std::vector<UniqueFd>> FetchByPidfd(absl::Span<const FdToken> tokens) {
  std::vector<UniqueFd> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    UniqueFd pidfd(static_cast<int>(syscall(SYS_pidfd_open, tokens[i].pid, 0)));
    if (!pidfd.valid()) {
      if (errno == ESRCH) {
        return absl::UnavailableError(
            absl::StrCat("the exporting process ", tokens[i].pid, " is gone"));
      }
      return Errno("pidfd_open");
    }
    UniqueFd fd(static_cast<int>(syscall(SYS_pidfd_getfd, pidfd.get(), tokens[i].fd, 0)));
    if (!fd.valid()) {
      if (errno == EPERM) {
        return absl::PermissionDeniedError(
            "pidfd_getfd needs ptrace rights over the exporter; use the socket transport");
      }
      if (errno == EBADF) return Stale(i, tokens[i].pid);
      return Errno("pidfd_getfd");
    }
    out.push_back(std::move(fd));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<UniqueFd>> FetchFds(absl::Span<const FdToken> tokens, FdFetch how) {
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
      if (fd < 0) return LookupFailed(i, tokens[i].pid, ReplyCode(fd, err));
      out.emplace_back(fd);
    }
    return out;
  }
  return how == FdFetch::kPidfd ? FetchByPidfd(tokens) : FetchBySocket(tokens);
}

int FdServer::LookupLocal(const FdToken& token, int* err) {
  Impl* server = impl();
  int ignored = 0;
  if (err == nullptr) err = &ignored;
  if (token.server_id != server->server_id()) {
    *err = ENOENT;
    return -1;
  }
  return server->Lookup(token.key, token.nonce.data(), err);
}

}  // namespace vmm
