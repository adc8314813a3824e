// The fd server under hostile and unlucky clients, in this process over loopback Unix sockets:
// accept failing for lack of fds, idle and slow clients, malformed requests (fetches and acks),
// the connection cap; the importer's errors when a server never answers or hangs up; the
// token's kinds and the ack request's encoding; the importer's kept connections, with this
// program run as an exporter in a process of its own (FdExporterHelper.Serve). Each test is
// bounded (a few seconds at most); the server's limits are fd_share_internal::kRequestDeadline
// and kMaxConnections.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "allocator/fd_share.h"
#include "allocator/fd_share_internal.h"
#include "allocator/fd_slots.h"
#include "allocator/send_ledger.h"
#include "allocator/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/sanitizers.h"
#include "tests/subprocess.h"

#if VMM_UNDER_TSAN
// A forked child here starts threads (its own fd server's): ThreadSanitizer refuses that in a
// child forked from a process with threads unless told to go on (it cannot follow them; the
// child's own checks still run). TSAN_OPTIONS from the environment still apply on top.
extern "C" const char* __tsan_default_options() { return "die_after_fork=0"; }
#endif

namespace vmm {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kReplyMagic[] = "VMMFDRSP";

// Registers a memfd holding `marker` with the process's server and returns its token.
FdToken RegisterMarked(uint8_t marker) {
  UniqueFd fd(memfd_create("fd_share_test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(pwrite(fd.get(), &marker, 1, 0), 1);
  absl::StatusOr<FdToken> token = FdServer::Get().Register(std::move(fd));
  EXPECT_OK(token);
  return token.ok() ? *token : FdToken{};
}

// The byte at offset 0 of `fd`, or -1.
int FirstByte(const UniqueFd& fd) {
  uint8_t byte = 0;
  return pread(fd.get(), &byte, 1, 0) == 1 ? byte : -1;
}

fd_share_internal::FdRequestEntry EntryOf(const FdToken& token) {
  return fd_share_internal::FdRequestEntry{token.key, token.nonce};
}

// Fetches `token` over the socket (never the local shortcut) and checks the fd's marker;
// returns how long it took.
Clock::duration FetchAndCheck(const FdToken& token, uint8_t marker, milliseconds timeout) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::vector<UniqueFd>> fds =
      fd_share_internal::FetchFdsBySocket({token}, timeout);
  const Clock::duration took = Clock::now() - start;
  EXPECT_OK(fds);
  if (fds.ok() && fds->size() == 1) {
    EXPECT_EQ(FirstByte((*fds)[0]), marker);
  } else if (fds.ok()) {
    ADD_FAILURE() << fds->size() << " fds for one token";
  }
  return took;
}

// A hand-driven client of a server at (pid, server_id): sends raw messages, reads raw replies.
class RawClient {
 public:
  RawClient(uint32_t pid, uint64_t server_id)
      : sock_(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) {
    EXPECT_TRUE(sock_.valid());
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = fd_share_internal::ServerSocketName(pid, server_id);
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    len_ = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    addr_ = addr;
  }
  // A client of this process's server.
  explicit RawClient(const FdToken& token) : RawClient(token.pid, token.server_id) {}

  bool Connect() {
    return connect(sock_.get(), reinterpret_cast<const sockaddr*>(&addr_), len_) == 0;
  }
  bool Send(const std::vector<uint8_t>& bytes) {
    return send(sock_.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  // The next message (fds passed with it are closed); empty when the server closed the
  // connection; DeadlineExceeded when nothing came within `timeout`.
  absl::StatusOr<std::vector<uint8_t>> Receive(milliseconds timeout) {
    timeval tv{static_cast<time_t>(timeout.count() / 1000),
               static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
    setsockopt(sock_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    std::vector<uint8_t> data(4096);
    std::vector<char> control(CMSG_SPACE(sizeof(int) * 253));
    iovec iov{data.data(), data.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    const ssize_t got = recvmsg(sock_.get(), &msg, MSG_CMSG_CLOEXEC);
    if (got < 0) {
      return absl::DeadlineExceededError(absl::StrCat("recvmsg: ", std::strerror(errno)));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        close(fd);
      }
    }
    data.resize(static_cast<size_t>(got));
    return data;
  }
  int fd() const { return sock_.get(); }

 private:
  UniqueFd sock_;
  sockaddr_un addr_{};
  socklen_t len_ = 0;
};

// Whether `reply` is a successful answer to a one-token request.
::testing::AssertionResult IsOkReply(const absl::StatusOr<std::vector<uint8_t>>& reply) {
  if (!reply.ok()) return ::testing::AssertionFailure() << reply.status();
  if (reply->size() != 16 || std::memcmp(reply->data(), kReplyMagic, 8) != 0) {
    return ::testing::AssertionFailure() << "not a one-token reply (" << reply->size()
                                         << " bytes)";
  }
  if ((*reply)[12] != 0) return ::testing::AssertionFailure() << "the token was not found";
  return ::testing::AssertionSuccess();
}

TEST(FdServerTest, AnIdleClientDelaysNoFetch) {
  const FdToken token = RegisterMarked(11);
  RawClient idle(token);
  ASSERT_TRUE(idle.Connect());
  std::this_thread::sleep_for(milliseconds(100));  // the server has accepted it
  const Clock::duration took = FetchAndCheck(token, 11, milliseconds(3000));
  EXPECT_LT(took, milliseconds(1000));
  FdServer::Get().Unregister(token.key);
}

TEST(FdServerTest, ASlowClientDelaysNoFetch) {
  const FdToken token = RegisterMarked(12);
  // A request every 200 ms on one connection, for 2 s (a request is one message: a client
  // cannot send part of one, so "slow" means requests that trickle in).
  std::atomic<int> answered{0};
  std::thread slow([&] {
    RawClient client(token);
    if (!client.Connect()) return;
    for (int i = 0; i < 10; ++i) {
      if (!client.Send(fd_share_internal::EncodeFdRequest({EntryOf(token)}))) return;
      if (IsOkReply(client.Receive(milliseconds(3000)))) ++answered;
      std::this_thread::sleep_for(milliseconds(200));
    }
  });
  std::this_thread::sleep_for(milliseconds(300));  // the slow client is being served
  const Clock::duration took = FetchAndCheck(token, 12, milliseconds(4000));
  EXPECT_LT(took, milliseconds(1000));
  slow.join();
  EXPECT_EQ(answered.load(), 10) << "the slow client is served too";
  FdServer::Get().Unregister(token.key);
}


// Sends each of `malformed` on a connection of its own to the server of `token`: each gets an
// InvalidArgument error reply that says `what`, then its connection is closed.
void ExpectErrorRepliesAndClose(const FdToken& token,
                                const std::vector<std::vector<uint8_t>>& malformed,
                                const std::string& what) {
  for (const std::vector<uint8_t>& request : malformed) {
    SCOPED_TRACE(absl::StrCat(request.size(), "-byte request"));
    RawClient bad(token);
    ASSERT_TRUE(bad.Connect());
    ASSERT_TRUE(bad.Send(request));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> reply, bad.Receive(milliseconds(2000)));
    std::optional<absl::Status> error = fd_share_internal::DecodeFdErrorReply(reply);
    ASSERT_TRUE(error.has_value()) << "no error reply (" << reply.size() << " bytes)";
    EXPECT_THAT(*error, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> after, bad.Receive(milliseconds(2000)));
    EXPECT_TRUE(after.empty()) << "the connection is closed after the error";
  }
}

TEST(FdServerTest, AMalformedRequestGetsAnErrorAndOnlyItsConnectionCloses) {
  const FdToken token = RegisterMarked(13);
  RawClient other(token);
  ASSERT_TRUE(other.Connect());
  const std::vector<std::vector<uint8_t>> malformed = {
      {'h', 'e', 'l', 'l', 'o'},
      {'V', 'M', 'M', 'F', 'D', 'R', 'E', 'Q', 0, 0, 0, 0},             // no tokens
      {'V', 'M', 'M', 'F', 'D', 'R', 'E', 'Q', 2, 0, 0, 0, 1, 2, 3},    // short of its count
      std::vector<uint8_t>(fd_share_internal::kMaxRequestSize + 1, 'x'),  // too long
  };
  ExpectErrorRepliesAndClose(token, malformed, "fd request");
  // The other connection, open all along, is still served; so are new ones.
  ASSERT_TRUE(other.Send(fd_share_internal::EncodeFdRequest({EntryOf(token)})));
  EXPECT_TRUE(IsOkReply(other.Receive(milliseconds(2000))));
  EXPECT_LT(FetchAndCheck(token, 13, milliseconds(3000)), milliseconds(1000));
  FdServer::Get().Unregister(token.key);
}

TEST(FdServerTest, AMalformedAckRequestGetsAnErrorAndItsConnectionCloses) {
  const FdToken token = RegisterMarked(17);
  const std::vector<std::vector<uint8_t>> malformed = {
      {'V', 'M', 'M', 'A', 'C', 'K', 'R', 'Q'},                        // no count
      {'V', 'M', 'M', 'A', 'C', 'K', 'R', 'Q', 0, 0, 0, 0},             // no tokens
      {'V', 'M', 'M', 'A', 'C', 'K', 'R', 'Q', 1, 0, 0, 0, 1, 2, 3},    // short of its count
      {'V', 'M', 'M', 'A', 'C', 'K', 'R', 'Q', 251, 0, 0, 0},           // more than a request
  };
  ExpectErrorRepliesAndClose(token, malformed, "ack request");
  EXPECT_LT(FetchAndCheck(token, 17, milliseconds(3000)), milliseconds(1000));
  FdServer::Get().Unregister(token.key);
}

TEST(FdServerTest, OneConnectionMayAckAndFetchInTurn) {
  const FdToken token = RegisterMarked(18);
  std::atomic<int> released{0};
  ASSERT_OK_AND_ASSIGN(const SendLedger::Ticket bytes,
                       SendLedger::Get().Hold(1, [&released] { ++released; }));
  ASSERT_OK_AND_ASSIGN(const FdToken ticket, FdToken::Decode(bytes));
  EXPECT_EQ(ticket.kind, FdToken::Kind::kSendHold);
  EXPECT_EQ(ticket.pid, token.pid);
  EXPECT_EQ(ticket.server_id, token.server_id);
  RawClient client(token);
  ASSERT_TRUE(client.Connect());
  // An fd's key and nonce name no hold, a hold's name no fd; the hold is acknowledged once.
  ASSERT_TRUE(client.Send(fd_share_internal::EncodeAckRequest(
      {EntryOf(token), EntryOf(ticket), EntryOf(ticket)})));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> reply, client.Receive(milliseconds(2000)));
  ASSERT_OK_AND_ASSIGN(std::vector<bool> acked, fd_share_internal::DecodeAckReply(reply, 3));
  EXPECT_EQ(acked, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);  // the release thread
  EXPECT_EQ(released.load(), 1);
  ASSERT_TRUE(client.Send(fd_share_internal::EncodeFdRequest({EntryOf(ticket)})));
  ASSERT_OK_AND_ASSIGN(reply, client.Receive(milliseconds(2000)));
  ASSERT_EQ(reply.size(), 16u);
  EXPECT_EQ(reply[12], 1) << "a hold's key and nonce fetch nothing";
  ASSERT_TRUE(client.Send(fd_share_internal::EncodeFdRequest({EntryOf(token)})));
  EXPECT_TRUE(IsOkReply(client.Receive(milliseconds(2000))));
  FdServer::Get().Unregister(token.key);
}

TEST(FdServerTest, AckBySocketBatchesAndNamesAGoneExporter) {
  std::atomic<int> released{0};
  std::vector<fd_share_internal::FdRequestEntry> entries;
  FdToken first;
  for (int i = 0; i < 600; ++i) {  // three requests on one connection
    ASSERT_OK_AND_ASSIGN(const SendLedger::Ticket bytes,
                         SendLedger::Get().Hold(1, [&released] { ++released; }));
    ASSERT_OK_AND_ASSIGN(first, FdToken::Decode(bytes));
    entries.push_back(EntryOf(first));
  }
  ASSERT_OK_AND_ASSIGN(std::vector<bool> acked,
                       fd_share_internal::AckBySocket(first.pid, first.server_id, entries,
                                                      milliseconds(5000)));
  EXPECT_EQ(std::count(acked.begin(), acked.end(), true), 600);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);  // the release thread
  EXPECT_EQ(released.load(), 600);
  EXPECT_THAT(fd_share_internal::AckBySocket(first.pid, 0xdeadu, entries, milliseconds(500)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is gone")));
}

TEST(FdServerTest, AnIdleConnectionIsClosedAfterTheRequestDeadline) {
  const FdToken token = RegisterMarked(14);
  RawClient idle(token);
  ASSERT_TRUE(idle.Connect());
  const Clock::time_point start = Clock::now();
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> reply,
                       idle.Receive(fd_share_internal::kRequestDeadline + milliseconds(1500)));
  EXPECT_TRUE(reply.empty()) << "closed without a reply";
  EXPECT_GE(Clock::now() - start, fd_share_internal::kRequestDeadline - milliseconds(100));
  FdServer::Get().Unregister(token.key);
}

// Connections that were never answered are not closed to make room (their first request may
// be on its way): a client beyond the cap waits for their deadline.
TEST(FdServerTest, BeyondTheConnectionCapClientsWaitForAFreeSlot) {
  const FdToken token = RegisterMarked(15);
  std::vector<RawClient> idle;
  idle.reserve(fd_share_internal::kMaxConnections);
  for (size_t i = 0; i < fd_share_internal::kMaxConnections; ++i) {
    idle.emplace_back(token);
    ASSERT_TRUE(idle.back().Connect());
  }
  std::this_thread::sleep_for(milliseconds(100));
  // Served once the idle connections pass their deadline.
  const Clock::duration took =
      FetchAndCheck(token, 15, fd_share_internal::kRequestDeadline + milliseconds(2000));
  EXPECT_LT(took, fd_share_internal::kRequestDeadline + milliseconds(1000));
  FdServer::Get().Unregister(token.key);
}

// A stand-in server at an address of this process, which accepts and then either holds each
// connection without answering or closes it at once.
class FakeServer {
 public:
  explicit FakeServer(bool hang_up) : sock_(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) {
    token_.pid = static_cast<uint32_t>(getpid());
    token_.boot_hash = BootHash();
    token_.server_id = 0x5eed0000u + static_cast<uint64_t>(hang_up);
    token_.key = 1;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = fd_share_internal::ServerSocketName(token_.pid, token_.server_id);
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    EXPECT_EQ(bind(sock_.get(), reinterpret_cast<const sockaddr*>(&addr), len), 0);
    EXPECT_EQ(listen(sock_.get(), 4), 0);
    thread_ = std::thread([this, hang_up] {
      UniqueFd conn(accept4(sock_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (hang_up) conn.reset();
      while (!done_.load()) std::this_thread::sleep_for(milliseconds(10));
    });
  }
  ~FakeServer() {
    done_.store(true);
    thread_.join();
  }
  const FdToken& token() const { return token_; }

 private:
  UniqueFd sock_;
  FdToken token_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

TEST(FdFetchTest, AServerThatNeverAnswersIsDeadlineExceededNamingThePid) {
  FakeServer silent(/*hang_up=*/false);
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::vector<UniqueFd>> fds =
      fd_share_internal::FetchFdsBySocket({silent.token()}, milliseconds(300));
  EXPECT_THAT(fds, StatusIs(absl::StatusCode::kDeadlineExceeded,
                            HasSubstr(absl::StrCat("process ", getpid()))));
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
}

TEST(FdFetchTest, AServerThatHangsUpIsUnavailableNamingThePid) {
  FakeServer rude(/*hang_up=*/true);
  absl::StatusOr<std::vector<UniqueFd>> fds =
      fd_share_internal::FetchFdsBySocket({rude.token()}, milliseconds(2000));
  EXPECT_THAT(fds, StatusIs(absl::StatusCode::kUnavailable,
                            HasSubstr(absl::StrCat("process ", getpid()))));
}

TEST(FdFetchTest, NoServerIsUnavailable) {
  FdToken token;
  token.pid = static_cast<uint32_t>(getpid());
  token.boot_hash = BootHash();
  token.server_id = 0xdeadu;
  EXPECT_THAT(fd_share_internal::FetchFdsBySocket({token}, milliseconds(500)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is gone")));
}

TEST(FdTokenTest, KindsRoundTripAndUnknownKindsAreRefused) {
  FdToken token;
  token.pid = 7;
  token.key = 9;
  token.fd = 3;
  for (FdToken::Kind kind : {FdToken::Kind::kFd, FdToken::Kind::kSendHold}) {
    // The slots file's number, none (a ticket's) to the largest 24 bits hold.
    for (int32_t slots_fd : {-1, 0, 5, (1 << 24) - 2}) {
      token.kind = kind;
      token.slots_fd = slots_fd;
      const std::array<uint8_t, 64> bytes = token.Encode();
      EXPECT_EQ(bytes[60], static_cast<uint8_t>(kind));
      ASSERT_OK_AND_ASSIGN(const FdToken decoded, FdToken::Decode(bytes));
      EXPECT_EQ(decoded.kind, kind);
      EXPECT_EQ(decoded.slots_fd, slots_fd);
      EXPECT_EQ(decoded.Encode(), bytes);
    }
  }
  std::array<uint8_t, 64> bytes = token.Encode();
  bytes[60] = 2;
  EXPECT_THAT(FdToken::Decode(bytes), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("kind")));
}

TEST(AckRequestTest, RoundTripsAndIsStrict) {
  const std::vector<fd_share_internal::FdRequestEntry> entries = {
      {1, {}}, {~uint64_t{0}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}}};
  const std::vector<uint8_t> bytes = fd_share_internal::EncodeAckRequest(entries);
  EXPECT_TRUE(fd_share_internal::IsAckRequest(bytes));
  EXPECT_FALSE(fd_share_internal::IsAckRequest(fd_share_internal::EncodeFdRequest(entries)));
  ASSERT_OK_AND_ASSIGN(const auto decoded, fd_share_internal::DecodeAckRequest(bytes));
  EXPECT_EQ(decoded, entries);
  // A fetch request is not an ack request, nor the other way round.
  EXPECT_THAT(fd_share_internal::DecodeAckRequest(fd_share_internal::EncodeFdRequest(entries)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
  EXPECT_THAT(fd_share_internal::DecodeFdRequest(bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_THAT(fd_share_internal::DecodeAckRequest(longer),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Replies: the statuses read back; another count or status is refused.
  const std::vector<uint8_t> reply = fd_share_internal::EncodeAckReply({true, false});
  ASSERT_OK_AND_ASSIGN(const std::vector<bool> acked,
                       fd_share_internal::DecodeAckReply(reply, 2));
  EXPECT_EQ(acked, (std::vector<bool>{true, false}));
  EXPECT_THAT(fd_share_internal::DecodeAckReply(reply, 3),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<uint8_t> odd = reply;
  odd[12] = 7;
  EXPECT_THAT(fd_share_internal::DecodeAckReply(odd, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("status")));
}

// --- Report requests of every kind, and re-keyed fds ------------------------------------------

TEST(AckRequestTest, EveryReportKindHasItsMagicAndRoundTrips) {
  using fd_share_internal::AckRequestKind;
  const std::vector<fd_share_internal::FdRequestEntry> entries = {
      {7, {}}, {~uint64_t{0}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}}};
  struct Case {
    SendReport report;
    const char* magic;
  };
  for (const Case& c : {Case{SendReport::kImported, "VMMACKRQ"},
                        Case{SendReport::kReleased, "VMMRELRQ"},
                        Case{SendReport::kForwarded, "VMMFWDRQ"}}) {
    SCOPED_TRACE(c.magic);
    const std::vector<uint8_t> bytes = fd_share_internal::EncodeAckRequest(entries, c.report);
    ASSERT_GE(bytes.size(), 8u);
    EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 8), c.magic);
    EXPECT_EQ(AckRequestKind(bytes), c.report);
    EXPECT_TRUE(fd_share_internal::IsAckRequest(bytes));
    ASSERT_OK_AND_ASSIGN(const auto decoded, fd_share_internal::DecodeAckRequest(bytes));
    EXPECT_EQ(decoded, entries);
    EXPECT_EQ(fd_share_internal::EncodeAckRequest(decoded, c.report), bytes);
    // The same entries under another kind are other bytes: the kind is not lost.
    for (SendReport other :
         {SendReport::kImported, SendReport::kReleased, SendReport::kForwarded}) {
      if (other != c.report) {
        EXPECT_NE(fd_share_internal::EncodeAckRequest(entries, other), bytes);
      }
    }
    EXPECT_THAT(fd_share_internal::DecodeFdRequest(bytes),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
  }
  EXPECT_EQ(fd_share_internal::EncodeAckRequest(entries),
            fd_share_internal::EncodeAckRequest(entries, SendReport::kImported))
      << "an ack by default";
  // Other messages are no report request.
  EXPECT_EQ(AckRequestKind(fd_share_internal::EncodeFdRequest(entries)), std::nullopt);
  const std::vector<uint8_t> short_magic = {'V', 'M', 'M', 'R', 'E', 'L', 'R'};
  EXPECT_EQ(AckRequestKind(short_magic), std::nullopt);
  EXPECT_FALSE(fd_share_internal::IsAckRequest(short_magic));
  const std::vector<uint8_t> near_miss = {'V', 'M', 'M', 'R', 'E', 'L', 'R', 'X', 1, 0, 0, 0};
  EXPECT_EQ(AckRequestKind(near_miss), std::nullopt);
  EXPECT_EQ(AckRequestKind({}), std::nullopt);
}

TEST(AckRequestTest, MalformedReportsAreRefusedNamingTheirKind) {
  const std::vector<fd_share_internal::FdRequestEntry> one = {{1, {}}};
  struct Case {
    SendReport report;
    const char* what;
  };
  for (const Case& c : {Case{SendReport::kReleased, "release report"},
                        Case{SendReport::kForwarded, "forward report"}}) {
    SCOPED_TRACE(c.what);
    const std::vector<uint8_t> good = fd_share_internal::EncodeAckRequest(one, c.report);
    std::vector<uint8_t> longer = good;
    longer.push_back(0);
    std::vector<uint8_t> no_tokens(good.begin(), good.begin() + 8);
    no_tokens.insert(no_tokens.end(), {0, 0, 0, 0});
    std::vector<uint8_t> too_many(good.begin(), good.begin() + 8);
    too_many.insert(too_many.end(), {251, 0, 0, 0});
    const std::vector<uint8_t> header_only(good.begin(), good.begin() + 8);
    for (const std::vector<uint8_t>& bad : {longer, no_tokens, too_many, header_only}) {
      EXPECT_THAT(fd_share_internal::DecodeAckRequest(bad),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.what)))
          << bad.size() << " bytes";
    }
  }
}

TEST(FdServerTest, AMalformedReportGetsAnErrorAndItsConnectionCloses) {
  const FdToken token = RegisterMarked(19);
  ExpectErrorRepliesAndClose(
      token,
      {{'V', 'M', 'M', 'R', 'E', 'L', 'R', 'Q', 0, 0, 0, 0},
       {'V', 'M', 'M', 'R', 'E', 'L', 'R', 'Q', 1, 0, 0, 0, 1, 2, 3}},
      "release report");
  ExpectErrorRepliesAndClose(token, {{'V', 'M', 'M', 'F', 'W', 'D', 'R', 'Q', 0, 0, 0, 0}},
                             "forward report");
  EXPECT_LT(FetchAndCheck(token, 19, milliseconds(3000)), milliseconds(1000));
  FdServer::Get().Unregister(token.key);
}

// One connection acks, reports and fetches in turn; each report reaches the ledger as its kind.
TEST(FdServerTest, OneConnectionMayAckReportAndFetchInTurn) {
  const FdToken token = RegisterMarked(20);
  std::atomic<int> released{0};
  std::atomic<int> settled_true{0};
  std::atomic<int> settled_false{0};
  std::vector<FdToken> tickets;
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(const SendLedger::Ticket bytes,
                         SendLedger::Get().Hold(
                             1, [&released] { ++released; },
                             [&](bool r) { ++(r ? settled_true : settled_false); }));
    ASSERT_OK_AND_ASSIGN(const FdToken ticket, FdToken::Decode(bytes));
    tickets.push_back(ticket);
  }
  RawClient client(token);
  ASSERT_TRUE(client.Connect());
  auto exchange = [&](const std::vector<uint8_t>& request, size_t count) {
    EXPECT_TRUE(client.Send(request));
    absl::StatusOr<std::vector<uint8_t>> reply = client.Receive(milliseconds(2000));
    EXPECT_OK(reply);
    absl::StatusOr<std::vector<bool>> done =
        reply.ok() ? fd_share_internal::DecodeAckReply(*reply, count)
                   : absl::StatusOr<std::vector<bool>>(reply.status());
    EXPECT_OK(done);
    return done.ok() ? *done : std::vector<bool>{};
  };
  EXPECT_EQ(exchange(fd_share_internal::EncodeAckRequest(
                         {EntryOf(tickets[0]), EntryOf(tickets[1])}),
                     2),
            (std::vector<bool>{true, true}));
  // An fd's key names no hold, for a report either.
  EXPECT_EQ(exchange(fd_share_internal::EncodeAckRequest(
                         {EntryOf(token), EntryOf(tickets[0])}, SendReport::kReleased),
                     2),
            (std::vector<bool>{false, true}));
  EXPECT_EQ(exchange(fd_share_internal::EncodeAckRequest({EntryOf(tickets[1]), EntryOf(tickets[0])},
                                                         SendReport::kForwarded),
                     2),
            (std::vector<bool>{true, false}));
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_EQ(released.load(), 2);
  EXPECT_EQ(settled_true.load(), 1);
  EXPECT_EQ(settled_false.load(), 1);
  ASSERT_TRUE(client.Send(fd_share_internal::EncodeFdRequest({EntryOf(token)})));
  EXPECT_TRUE(IsOkReply(client.Receive(milliseconds(2000))));
  FdServer::Get().Unregister(token.key);
}

TEST(FdServerTest, RekeyGivesTheSameFileANewTokenAndTheOldOneGoesStale) {
  const FdToken old_token = RegisterMarked(21);
  const size_t registered = FdServer::Get().size();
  ASSERT_OK_AND_ASSIGN(const FdToken new_token, FdServer::Get().Rekey(old_token.key));
  EXPECT_EQ(FdServer::Get().size(), registered) << "the same fd, not another";
  EXPECT_NE(new_token.key, old_token.key);
  EXPECT_NE(new_token.nonce, old_token.nonce);
  EXPECT_EQ(new_token.pid, old_token.pid);
  EXPECT_EQ(new_token.boot_hash, old_token.boot_hash);
  EXPECT_EQ(new_token.server_id, old_token.server_id);
  EXPECT_NE(new_token.fd, old_token.fd) << "a new number: pidfd_getfd fetches by number";
  EXPECT_EQ(new_token.kind, FdToken::Kind::kFd);
  // The new token fetches the file, locally and over the socket; the old one nothing.
  EXPECT_LT(FetchAndCheck(new_token, 21, milliseconds(3000)), milliseconds(1000));
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> local, FetchFds({new_token}));
  ASSERT_EQ(local.size(), 1u);
  EXPECT_EQ(FirstByte(local[0]), 21);
  EXPECT_THAT(fd_share_internal::FetchFdsBySocket({old_token}, milliseconds(3000)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")));
  EXPECT_THAT(FetchFds({old_token}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")));
  EXPECT_EQ(FdServer::Get().LookupLocal(old_token), -1);
  // The old token's key, a key never given and a token of an old nonce are no longer there.
  EXPECT_THAT(FdServer::Get().Rekey(old_token.key), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(FdServer::Get().Rekey(~uint64_t{0}), StatusIs(absl::StatusCode::kNotFound));
  FdToken old_nonce = new_token;
  old_nonce.nonce = old_token.nonce;
  EXPECT_THAT(FetchFds({old_nonce}), StatusIs(absl::StatusCode::kNotFound));
  // Re-keyed again, then unregistered: nothing is left.
  ASSERT_OK_AND_ASSIGN(const FdToken third, FdServer::Get().Rekey(new_token.key));
  EXPECT_THAT(FetchFds({new_token}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_LT(FetchAndCheck(third, 21, milliseconds(3000)), milliseconds(1000));
  FdServer::Get().Unregister(third.key);
  EXPECT_EQ(FdServer::Get().size(), registered - 1);
  EXPECT_THAT(FetchFds({third}), StatusIs(absl::StatusCode::kNotFound));
}

// Whether an open fd of this process is a copy of `file` (the same device and inode) or the
// listening socket of the fd server named `server_name`: 1 and 2 for those, else 0.
int HoldsFileOrServer(const struct stat& file, const std::string& server_name) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 9;
  int found = 0;
  while (dirent* e = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd == dirfd(dir)) continue;
    struct stat st;
    if (fstat(fd, &st) != 0) continue;
    if (st.st_dev == file.st_dev && st.st_ino == file.st_ino) found = 1;
    sockaddr_un addr{};
    socklen_t len = sizeof(addr);
    if (found == 0 && S_ISSOCK(st.st_mode) &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
        len > offsetof(sockaddr_un, sun_path) + 1 && addr.sun_path[0] == '\0' &&
        std::string(addr.sun_path + 1, len - offsetof(sockaddr_un, sun_path) - 1) ==
            server_name) {
      found = 2;
    }
  }
  closedir(dir);
  return found;
}

TEST(FdServerTest, AForkedChildKeepsNoCopyOfItsParentsServerFds) {
  const FdToken token = RegisterMarked(33);
  ASSERT_GE(token.slots_fd, 0);
  struct stat registered, slots;
  ASSERT_EQ(fstat(static_cast<int>(token.fd), &registered), 0);
  ASSERT_EQ(fstat(token.slots_fd, &slots), 0);
  const std::string server = fd_share_internal::ServerSocketName(token.pid, token.server_id);
  ASSERT_EQ(HoldsFileOrServer(registered, server), 1) << "the check sees the parent's own";
  // A fetch over the socket first: the server then holds an accepted connection, whose name
  // is the server's too.
  EXPECT_LT(FetchAndCheck(token, 33, milliseconds(3000)), milliseconds(1000));
  const int code = InForkedChild([&] {
    // A copy of the registered fd would keep its memory (a CUDA allocation) held after the
    // parent releases it; of the listening socket, let importers connect to no server.
    if (const int held = HoldsFileOrServer(registered, server); held != 0) return held;
    if (HoldsFileOrServer(slots, server) == 1) return 3;
    // The child's own server registers and serves.
    UniqueFd fd(memfd_create("fd_share_test", MFD_CLOEXEC));
    const uint8_t marker = 34;
    if (pwrite(fd.get(), &marker, 1, 0) != 1) return 4;
    absl::StatusOr<FdToken> own = FdServer::Get().Register(std::move(fd));
    if (!own.ok() || own->pid == token.pid) return 5;
    absl::StatusOr<std::vector<UniqueFd>> fetched =
        fd_share_internal::FetchFdsBySocket({*own}, milliseconds(3000));
    if (!fetched.ok() || fetched->size() != 1 || FirstByte((*fetched)[0]) != marker) return 6;
    return 0;
  });
  EXPECT_EQ(code, 0) << "1: the registered fd, 2: the listening socket or an accepted "
                        "connection, 3: the slots file are still open in the child; 4-6: the "
                        "child's own server failed";
  // The parent's server lost nothing: it still serves the token, over its socket and locally.
  EXPECT_LT(FetchAndCheck(token, 33, milliseconds(3000)), milliseconds(1000));
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> local, FetchFds({token}));
  ASSERT_EQ(local.size(), 1u);
  EXPECT_EQ(FirstByte(local[0]), 33);
  FdServer::Get().Unregister(token.key);
}

// --- Kept connections, with an exporter in a process of its own ------------------------------

// Run in a process of its own by Exporter (with FD_SHARE_TEST_EXPORTER set): registers an fd
// holding kExportedMarker, prints its token, then answers each line of its input with the
// counts of its server, until its input ends; a line "renew" instead ends the registration
// and registers a new fd holding kRenewedMarker, whose token it prints.
// FD_SHARE_TEST_DEADLINE_MS sets the server's idle deadline.
constexpr uint8_t kExportedMarker = 42;
constexpr uint8_t kRenewedMarker = 43;

void PrintToken(const FdToken& token) {
  const std::array<uint8_t, 64> bytes = token.Encode();
  std::printf("token=%s\n", absl::BytesToHexString(absl::string_view(
                                reinterpret_cast<const char*>(bytes.data()), bytes.size()))
                                .c_str());
  std::fflush(stdout);
}

TEST(FdExporterHelper, Serve) {
  if (std::getenv("FD_SHARE_TEST_EXPORTER") == nullptr) GTEST_SKIP();
  int deadline_ms = 0;
  const char* deadline = std::getenv("FD_SHARE_TEST_DEADLINE_MS");
  if (deadline != nullptr && absl::SimpleAtoi(deadline, &deadline_ms)) {
    fd_share_internal::SetRequestDeadlineForTesting(milliseconds(deadline_ms));
  }
  FdToken token = RegisterMarked(kExportedMarker);
  PrintToken(token);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "renew") {
      FdServer::Get().Unregister(token.key);  // closes its fd
      token = RegisterMarked(kRenewedMarker);
      PrintToken(token);
      continue;
    }
    const fd_share_internal::ServerConnectionCounts counts =
        fd_share_internal::GetServerConnectionCounts();
    std::printf("accepted=%llu evicted=%llu\n",
                static_cast<unsigned long long>(counts.accepted),
                static_cast<unsigned long long>(counts.evicted));
    std::fflush(stdout);
  }
}

// This test program as an exporter of one fd (FdExporterHelper.Serve) in a process of its own.
class Exporter {
 public:
  explicit Exporter(milliseconds deadline = fd_share_internal::kRequestDeadline)
      : process_({"/proc/self/exe", "--gtest_filter=FdExporterHelper.Serve"},
                 {"FD_SHARE_TEST_EXPORTER=1",
                  absl::StrCat("FD_SHARE_TEST_DEADLINE_MS=", deadline.count()),
                  "GTEST_OUTPUT=", "TEST_PREMATURE_EXIT_FILE="}) {
    EXPECT_TRUE(process_.started());
    token_ = ReadToken();
  }

  const FdToken& token() const { return token_; }

  // Ends its registration and registers another fd (kRenewedMarker); the new token.
  FdToken Renew() {
    process_.WriteLine("renew");
    token_ = ReadToken();
    return token_;
  }

  // The counts of its server now.
  fd_share_internal::ServerConnectionCounts Counts() {
    process_.WriteLine("counts");
    const std::string line = LineStartingWith("accepted=");
    fd_share_internal::ServerConnectionCounts counts;
    unsigned long long accepted = 0, evicted = 0;
    EXPECT_EQ(std::sscanf(line.c_str(), "accepted=%llu evicted=%llu", &accepted, &evicted), 2)
        << line;
    counts.accepted = accepted;
    counts.evicted = evicted;
    return counts;
  }

  // Ends it (its input ends); its exit code.
  int Exit() {
    EndUnreaped();
    return process_.Wait();
  }

  // Ends it and waits until it has exited, without reaping it (Exit reaps it).
  void EndUnreaped() {
    process_.CloseInput();
    process_.ReadAll();
    siginfo_t info{};
    EXPECT_EQ(waitid(P_PID, static_cast<id_t>(token_.pid), &info, WEXITED | WNOWAIT), 0);
  }

 private:
  // The token it prints next.
  FdToken ReadToken() {
    const std::string line = LineStartingWith("token=");
    const std::string bytes = absl::HexStringToBytes(line.substr(line.find('=') + 1));
    absl::StatusOr<FdToken> token = FdToken::Decode(
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    EXPECT_OK(token);
    return token.ok() ? *token : FdToken{};
  }

  // Its next line of output that starts with `prefix` (gtest's lines come between); "" at
  // the end of its output.
  std::string LineStartingWith(const std::string& prefix) {
    for (std::string line = process_.ReadLine(); !line.empty(); line = process_.ReadLine()) {
      if (absl::StartsWith(line, prefix)) return line;
    }
    ADD_FAILURE() << "the exporter ended without printing " << prefix;
    return "";
  }

  Subprocess process_;
  FdToken token_;
};

// Fetches the exporter's fd with FetchFds (over its socket: another process) and checks it.
::testing::AssertionResult FetchesExported(const Exporter& exporter) {
  absl::StatusOr<std::vector<UniqueFd>> fds = FetchFds({exporter.token()});
  if (!fds.ok()) return ::testing::AssertionFailure() << fds.status();
  if (fds->size() != 1 || FirstByte((*fds)[0]) != kExportedMarker) {
    return ::testing::AssertionFailure() << "not the exported fd";
  }
  return ::testing::AssertionSuccess();
}

// pidfd_getfd takes an fd by its number, and the exporter gives a closed number to the next
// file it opens: a token whose registration ended fetches nothing, rather than the file that
// took its number, and a token with another number (its key and nonce a live registration's)
// fetches no other file of the exporter's (fd_slots.h).
TEST(FdConnectionTest, APidfdFetchTakesNoFileThatTookTheTokensNumber) {
  Exporter exporter;
  const FdToken old_token = exporter.token();
  absl::StatusOr<std::vector<UniqueFd>> first = FetchFds({old_token}, FdFetch::kPidfd);
  if (absl::IsPermissionDenied(first.status())) {
    GTEST_SKIP() << "no ptrace rights here: " << first.status();
  }
  ASSERT_OK(first);
  ASSERT_EQ(first->size(), 1u);
  EXPECT_EQ(FirstByte((*first)[0]), kExportedMarker);
  const FdToken new_token = exporter.Renew();
  ASSERT_EQ(new_token.fd, old_token.fd) << "the new file takes the freed number";
  EXPECT_THAT(FetchFds({old_token}, FdFetch::kPidfd),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")));
  EXPECT_THAT(FetchFds({old_token}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")));
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> renewed, FetchFds({new_token}, FdFetch::kPidfd));
  ASSERT_EQ(renewed.size(), 1u);
  EXPECT_EQ(FirstByte(renewed[0]), kRenewedMarker);
  // Several tokens of one exporter in one fetch (its pidfd and slots file opened once): each
  // is checked.
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> twice,
                       FetchFds({new_token, new_token}, FdFetch::kPidfd));
  ASSERT_EQ(twice.size(), 2u);
  EXPECT_EQ(FirstByte(twice[1]), kRenewedMarker);
  EXPECT_THAT(FetchFds({new_token, new_token, old_token}, FdFetch::kPidfd),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("handle 2")));
  // Its standard streams, and one number past every fd it has.
  for (uint32_t fd : {0u, 1u, 2u, new_token.fd + 100}) {
    FdToken forged = new_token;
    forged.fd = fd;
    EXPECT_THAT(FetchFds({forged}, FdFetch::kPidfd), StatusIs(absl::StatusCode::kNotFound))
        << "fd " << fd;
  }
  // Another key (the old registration's, none, one never given), another slots file (the
  // token's own fd, a standard stream), no slots file: nothing to check the fd against.
  for (uint64_t key : {old_token.key, uint64_t{0}, uint64_t{12345}}) {
    FdToken forged = new_token;
    forged.key = key;
    EXPECT_THAT(FetchFds({forged}, FdFetch::kPidfd), StatusIs(absl::StatusCode::kNotFound))
        << "key " << key;
  }
  for (int32_t slots_fd : {static_cast<int32_t>(new_token.fd), 0}) {
    FdToken forged = new_token;
    forged.slots_fd = slots_fd;
    EXPECT_THAT(FetchFds({forged}, FdFetch::kPidfd), StatusIs(absl::StatusCode::kNotFound))
        << "slots file " << slots_fd;
  }
  // Key 0 and a zero nonce: what a free slot holds (zeros), for any number of the exporter's.
  for (uint32_t fd : {0u, 1u, 2u, new_token.fd}) {
    FdToken forged = new_token;
    forged.key = 0;
    forged.nonce = {};
    forged.fd = fd;
    EXPECT_THAT(FetchFds({forged}, FdFetch::kPidfd), StatusIs(absl::StatusCode::kNotFound))
        << "fd " << fd;
  }
  FdToken no_slots = new_token;
  no_slots.slots_fd = -1;
  EXPECT_THAT(FetchFds({no_slots}, FdFetch::kPidfd),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("socket transport")));
  EXPECT_EQ(exporter.Exit(), 0);
}

// An exporter that has exited is Unavailable by pidfd as by socket, reaped or not (pidfd_open
// of an exited process that is not reaped yet succeeds, and pidfd_getfd then fails).
TEST(FdConnectionTest, APidfdFetchFromAnExporterThatExitedIsUnavailable) {
  Exporter exporter;
  absl::StatusOr<std::vector<UniqueFd>> first = FetchFds({exporter.token()}, FdFetch::kPidfd);
  if (absl::IsPermissionDenied(first.status())) {
    GTEST_SKIP() << "no ptrace rights here: " << first.status();
  }
  ASSERT_OK(first);
  exporter.EndUnreaped();
  EXPECT_THAT(FetchFds({exporter.token()}, FdFetch::kPidfd),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is gone")));
  EXPECT_EQ(exporter.Exit(), 0);
  EXPECT_THAT(FetchFds({exporter.token()}, FdFetch::kPidfd),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is gone")));
}

// The slots file answers only for its own process and server, and only while the slot holds
// the registration: a forked child shares its parent's slots file, so a token naming the
// child must not pass against the parent's slots; a file that is not a slots file passes
// nothing, whatever reading it does.
TEST(FdSlotsTest, ASlotAnswersForItsProcessServerAndRegistrationOnly) {
  constexpr uint64_t kServer = 0x5e5e5e5e;
  ASSERT_OK_AND_ASSIGN(FdSlots slots, FdSlots::Create(kServer));
  // The importer's copy of the file (as pidfd_getfd gives it).
  const UniqueFd copy(fcntl(slots.fd(), F_DUPFD_CLOEXEC, 0));
  ASSERT_TRUE(copy.valid());
  FdNonce nonce{};
  nonce.fill(7);
  const uint32_t pid = static_cast<uint32_t>(getpid());
  const SlotClaim claim{pid, kServer, 5, 42, nonce};
  EXPECT_THAT(CheckSlot(copy, claim), StatusIs(absl::StatusCode::kNotFound)) << "not yet";
  const SlotClaim zeros_claim{pid, kServer, 5, 0, FdNonce{}};
  EXPECT_THAT(CheckSlot(copy, zeros_claim), StatusIs(absl::StatusCode::kNotFound))
      << "a free slot reads as zeros: key 0 and a zero nonce match none"; 
  ASSERT_OK(slots.Publish(5, 42, nonce));
  EXPECT_OK(CheckSlot(copy, claim));
  // Another pid (a forked child's), server, fd, key, nonce, or an fd past the slots.
  SlotClaim others[6] = {claim, claim, claim, claim, claim, claim};
  others[0].pid = pid + 1;
  others[1].server_id = kServer + 1;
  others[2].fd = 6;
  others[3].key = 43;
  others[4].nonce[15] = 8;
  others[5].fd = FdSlots::kMaxSlots;
  for (const SlotClaim& other : others) {
    EXPECT_THAT(CheckSlot(copy, other), StatusIs(absl::StatusCode::kNotFound)) << &other - others;
  }
  ASSERT_OK(slots.Withdraw(5));
  EXPECT_THAT(CheckSlot(copy, claim), StatusIs(absl::StatusCode::kNotFound)) << "withdrawn";
  EXPECT_THAT(slots.Publish(FdSlots::kMaxSlots, 1, nonce),
              StatusIs(absl::StatusCode::kResourceExhausted));
  // Files of other kinds: a pipe, a directory, a memfd of zeros, /proc/self/mem (EIO).
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  const UniqueFd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  const UniqueFd dir(open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const UniqueFd zeros(memfd_create("zeros", MFD_CLOEXEC));
  ASSERT_EQ(ftruncate(zeros.get(), 256 << 20), 0);
  const UniqueFd mem(open("/proc/self/mem", O_RDONLY | O_CLOEXEC));
  for (const UniqueFd* file : {&read_end, &dir, &zeros, &mem}) {
    EXPECT_THAT(CheckSlot(*file, claim), StatusIs(absl::StatusCode::kNotFound));
  }
}

TEST(FdConnectionTest, ManyFetchesFromOneExporterUseOneConnection) {
  Exporter exporter;
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(FetchesExported(exporter)) << "fetch " << i;
  EXPECT_EQ(exporter.Counts().accepted, 1u);
  EXPECT_EQ(exporter.Exit(), 0);
}

TEST(FdConnectionTest, AConnectionTheExporterClosedIsReplacedTransparently) {
  Exporter exporter(/*deadline=*/milliseconds(200));
  ASSERT_TRUE(FetchesExported(exporter));
  const size_t kept = fd_share_internal::CachedConnections();
  EXPECT_GE(kept, 1u);
  std::this_thread::sleep_for(milliseconds(600));  // the exporter closes the idle connection
  // The kept connection is found closed and replaced; the new one is kept in turn.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(FetchesExported(exporter)) << "fetch " << i;
  EXPECT_EQ(exporter.Counts().accepted, 2u);
  EXPECT_EQ(fd_share_internal::CachedConnections(), kept);
  EXPECT_EQ(exporter.Exit(), 0);
}

TEST(FdConnectionTest, AnExporterThatExitedIsUnavailableAtOnce) {
  Exporter exporter;
  ASSERT_TRUE(FetchesExported(exporter));
  ASSERT_TRUE(FetchesExported(exporter));
  EXPECT_EQ(exporter.Counts().accepted, 1u);
  const size_t kept = fd_share_internal::CachedConnections();
  ASSERT_EQ(exporter.Exit(), 0);
  // The kept connection is found closed, and a new one finds no server: no waiting, no retry.
  const Clock::time_point start = Clock::now();
  EXPECT_THAT(FetchFds({exporter.token()}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is gone")));
  EXPECT_LT(Clock::now() - start, milliseconds(500));
  EXPECT_EQ(fd_share_internal::CachedConnections(), kept - 1) << "its socket is closed";
  EXPECT_THAT(FetchFds({exporter.token()}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is gone")));
}

TEST(FdConnectionTest, AForkedChildUsesConnectionsOfItsOwn) {
  Exporter exporter;
  ASSERT_TRUE(FetchesExported(exporter));
  ASSERT_GE(fd_share_internal::CachedConnections(), 1u);
  const int code = InForkedChild([&] {
    if (fd_share_internal::CachedConnections() != 0) return 1;  // the parent's, closed
    if (!FetchesExported(exporter)) return 2;
    if (!FetchesExported(exporter)) return 3;
    return 0;
  });
  EXPECT_EQ(code, 0);
  // The child connected once; the parent's connection is still its own, and still works.
  EXPECT_EQ(exporter.Counts().accepted, 2u);
  ASSERT_TRUE(FetchesExported(exporter));
  EXPECT_EQ(exporter.Counts().accepted, 2u);
  EXPECT_EQ(exporter.Exit(), 0);
}

TEST(FdConnectionTest, BeyondTheConnectionCapTheLongestIdleConnectionMakesRoom) {
  Exporter exporter;
  const FdToken& token = exporter.token();
  // Clients that fetched once and keep their connections, as importers do.
  std::vector<RawClient> idle;
  idle.reserve(fd_share_internal::kMaxConnections);
  for (size_t i = 0; i < fd_share_internal::kMaxConnections; ++i) {
    idle.emplace_back(token);
    ASSERT_TRUE(idle.back().Connect());
    ASSERT_TRUE(idle.back().Send(fd_share_internal::EncodeFdRequest({EntryOf(token)})));
    ASSERT_TRUE(IsOkReply(idle.back().Receive(milliseconds(2000))));
  }
  const Clock::time_point start = Clock::now();
  ASSERT_TRUE(FetchesExported(exporter));
  EXPECT_LT(Clock::now() - start, milliseconds(500)) << "well within the idle deadline";
  const fd_share_internal::ServerConnectionCounts counts = exporter.Counts();
  EXPECT_EQ(counts.accepted, fd_share_internal::kMaxConnections + 1);
  EXPECT_EQ(counts.evicted, 1u);
  // The one idle longest was closed; the others are still served.
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> closed, idle.front().Receive(milliseconds(500)));
  EXPECT_TRUE(closed.empty());
  ASSERT_TRUE(idle.back().Send(fd_share_internal::EncodeFdRequest({EntryOf(token)})));
  EXPECT_TRUE(IsOkReply(idle.back().Receive(milliseconds(2000))));
  EXPECT_EQ(exporter.Exit(), 0);
}

// The highest fd open in this process.
int HighestOpenFd() {
  int highest = 2;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  return highest;
}

// Runs last in this file: before accept errors were retried, it stopped the server for good.
TEST(FdServerTest, AcceptFailingForLackOfFdsIsRetried) {
  const FdToken token = RegisterMarked(16);
  RawClient client(token);  // its socket exists before the process runs out of fds
  // Lower the fd limit just above what is open, and fill the rest.
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(HighestOpenFd() + 8);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  // Twice, taking also the fds that the server closes meanwhile (connections of earlier
  // tests), so that none is free when the client connects.
  std::vector<UniqueFd> filler;
  int full_errno = 0;
  for (int round = 0; round < 2; ++round) {
    for (;;) {
      UniqueFd fd(fcntl(client.fd(), F_DUPFD_CLOEXEC, 0));
      if (!fd.valid()) break;
      filler.push_back(std::move(fd));
    }
    full_errno = errno;
    std::this_thread::sleep_for(milliseconds(50));
  }
  // The server's accept4 of this connection fails with EMFILE (connect takes no new fd here).
  const bool connected = client.Connect();
  const bool sent =
      connected && client.Send(fd_share_internal::EncodeFdRequest({EntryOf(token)}));
  std::this_thread::sleep_for(milliseconds(300));
  filler.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_EQ(full_errno, EMFILE);
  ASSERT_TRUE(connected);
  ASSERT_TRUE(sent);
  // The waiting client is answered once fds are free again, and later fetches work.
  EXPECT_TRUE(IsOkReply(client.Receive(milliseconds(2000))));
  EXPECT_LT(FetchAndCheck(token, 16, milliseconds(2000)), milliseconds(1000));
  FdServer::Get().Unregister(token.key);
}

}  // namespace
}  // namespace vmm
