// The send ledger: holds released exactly once when a receiver in another process acknowledges
// them or when their lease ends; stale, forged and foreign tickets; an exporter that is gone;
// releases that call back into the fd server; many holds; fork(); threads holding and
// acknowledging at once (run under ThreadSanitizer in CI). Receivers are forked children
// (which start no threads: the parent's fd server answers them), each reporting by its exit
// code. Every test leaves the process's ledger empty and its lease as it found them.
#include "allocator/capture_window.h"
#include "allocator/send_ledger.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "allocator/fd_share.h"
#include "allocator/fd_share_internal.h"
#include "allocator/mutex.h"
#include "allocator/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/hold_journal.h"
#include "tests/sanitizers.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;
using Ticket = SendLedger::Ticket;

// The exit code that reports `status` from a child: its code's number.
int CodeOf(const absl::Status& status) { return static_cast<int>(status.code()); }

// Acknowledges `ticket` from a forked child; the status code it got.
absl::StatusCode AckFromChild(const Ticket& ticket) {
  return static_cast<absl::StatusCode>(
      InForkedChild([&] { return CodeOf(AckSend(ticket)); }));
}

FdToken Decoded(const Ticket& ticket) {
  absl::StatusOr<FdToken> token = FdToken::Decode(ticket);
  EXPECT_OK(token);
  return token.ok() ? *token : FdToken{};
}

// Waits up to `timeout` for `condition`; whether it held.
template <typename F>
bool Eventually(F condition, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

class SendLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    lease_ = SendLedger::Get().lease();
    before_ = SendLedger::Get().GetStats();
    ASSERT_EQ(before_.held, 0u) << "an earlier test left holds";
  }
  void TearDown() override {
    SendLedger::Get().SetLease(lease_);
    EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
    EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, 0u)
        << "a test left an acknowledged hold waiting for its release report";
  }

  // A hold of `bytes` whose release counts into `runs`.
  Ticket HoldCounted(uint64_t bytes, std::atomic<int>* runs) {
    absl::StatusOr<Ticket> ticket = SendLedger::Get().Hold(bytes, [runs] { ++*runs; });
    EXPECT_OK(ticket);
    return ticket.ok() ? *ticket : Ticket{};
  }

  absl::Duration lease_;
  SendLedger::Stats before_;
};

TEST_F(SendLedgerTest, AnAckFromAnotherProcessRunsTheReleaseOnce) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(1000, &runs);
  SendLedger::Stats held = SendLedger::Get().GetStats();
  EXPECT_EQ(held.held, 1u);
  EXPECT_EQ(held.held_bytes, before_.held_bytes + 1000);
  EXPECT_GE(held.peak_held_bytes, held.held_bytes);
  EXPECT_EQ(held.holds, before_.holds + 1);
  EXPECT_NE(SendLedger::Get().NextDeadline(), absl::InfiniteFuture());

  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().GetStats().held, 0u) << "the hold ended before the reply";
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);  // the release thread
  EXPECT_EQ(runs.load(), 1);
  const SendLedger::Stats after = SendLedger::Get().GetStats();
  EXPECT_EQ(after.held, 0u);
  EXPECT_EQ(after.held_bytes, 0u);
  EXPECT_EQ(after.acked, before_.acked + 1);
  EXPECT_EQ(after.expired, before_.expired);
  EXPECT_EQ(SendLedger::Get().NextDeadline(), absl::InfiniteFuture());

  // A second ack is stale, from another process or from this one.
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kNotFound);
  EXPECT_THAT(AckSend(ticket), StatusIs(absl::StatusCode::kNotFound,
                                        HasSubstr("already acknowledged")));
  EXPECT_EQ(runs.load(), 1);
  EXPECT_EQ(SendLedger::Get().GetStats().acked, before_.acked + 1);
}

// While a graph is captured (capture_window.h) no release runs: an ack of this process
// queues its release for the release thread, which waits until the window closes.
TEST_F(SendLedgerTest, WhileACaptureWindowIsOpenReleasesWaitForIt) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(64, &runs);
  OpenCaptureWindow();
  EXPECT_OK(AckSend(ticket));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(runs.load(), 0) << "not on the acking thread, nor on the release thread yet";
  CloseCaptureWindow();
  EXPECT_TRUE(Eventually([&] { return runs.load() == 1; }, absl::Seconds(5)));
}

TEST_F(SendLedgerTest, AnAckOfThisProcessNeedsNoSocketAndTheSecondIsNotFound) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(64, &runs);
  EXPECT_OK(AckSend(ticket));
  EXPECT_EQ(runs.load(), 1);
  EXPECT_THAT(AckSend(ticket), StatusIs(absl::StatusCode::kNotFound));
  const FdToken token = Decoded(ticket);
  EXPECT_THAT(SendLedger::Get().Ack(token.key, token.nonce),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(runs.load(), 1);
}

TEST_F(SendLedgerTest, AForgedNonceIsNotFoundAndReleasesNothing) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(64, &runs);
  Ticket forged = ticket;
  forged[40] ^= 1;  // the nonce's first byte
  EXPECT_EQ(AckFromChild(forged), absl::StatusCode::kNotFound);
  EXPECT_THAT(AckSend(forged), StatusIs(absl::StatusCode::kNotFound));
  // A key that was never handed out reads the same.
  Ticket unknown = ticket;
  unknown[32] ^= 0x80;
  EXPECT_EQ(AckFromChild(unknown), absl::StatusCode::kNotFound);
  EXPECT_EQ(runs.load(), 0);
  EXPECT_EQ(SendLedger::Get().GetStats().held, 1u);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_EQ(runs.load(), 1);
}

TEST_F(SendLedgerTest, ALeaseEndsWithoutFurtherCalls) {
  std::atomic<int> runs{0};
  SendLedger::Get().SetLease(absl::Milliseconds(200));
  EXPECT_EQ(SendLedger::Get().lease(), absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  const Ticket ticket = HoldCounted(4096, &runs);
  SendLedger::Get().SetLease(lease_);  // later holds only
  EXPECT_LE(SendLedger::Get().NextDeadline(), start + absl::Milliseconds(300));
  // Nothing here calls the ledger: the fd server's loop ends the hold.
  EXPECT_TRUE(Eventually([&] { return runs.load() == 1; }, absl::Milliseconds(1500)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  const SendLedger::Stats after = SendLedger::Get().GetStats();
  EXPECT_EQ(after.expired, before_.expired + 1);
  EXPECT_EQ(after.acked, before_.acked);
  EXPECT_EQ(after.held_bytes, 0u);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kNotFound);
  EXPECT_EQ(runs.load(), 1);
}

TEST_F(SendLedgerTest, ExpireDueEndsOnlyHoldsPastTheirLease) {
  std::atomic<int> short_runs{0}, long_runs{0};
  SendLedger::Get().SetLease(absl::Milliseconds(50));
  HoldCounted(1, &short_runs);
  SendLedger::Get().SetLease(absl::Seconds(60));
  const Ticket long_held = HoldCounted(1, &long_runs);
  absl::SleepFor(absl::Milliseconds(60));
  SendLedger::Get().ExpireDue();  // returns 0 if the server's loop was first
  EXPECT_EQ(short_runs.load(), 1);
  EXPECT_EQ(long_runs.load(), 0);
  EXPECT_EQ(SendLedger::Get().ExpireDue(), 0u);
  EXPECT_OK(AckSend(long_held));
  EXPECT_EQ(long_runs.load(), 1);
}

TEST_F(SendLedgerTest, ALeaseThatIsNotPositiveIsRefused) {
  SendLedger::Get().SetLease(absl::ZeroDuration());
  SendLedger::Get().SetLease(absl::Seconds(-1));
  EXPECT_EQ(SendLedger::Get().lease(), lease_);
}

TEST_F(SendLedgerTest, AnExporterThatIsGoneIsUnavailableAtOnce) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(1, &runs);
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  FdToken token = Decoded(ticket);
  token.pid = static_cast<uint32_t>(gone);
  const absl::Time start = absl::Now();
  EXPECT_THAT(AckSend(token.Encode()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(absl::StrCat(gone))));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  EXPECT_EQ(runs.load(), 0);
  EXPECT_OK(AckSend(ticket));
}

TEST_F(SendLedgerTest, BytesThatAreNotATicketAreInvalidArgument) {
  const std::vector<uint8_t> garbage(64, 0xab);
  EXPECT_THAT(AckSend(garbage), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AckSend(std::vector<uint8_t>(10, 0)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AckSend({}), StatusIs(absl::StatusCode::kInvalidArgument));
  // An fd token is not a ticket, and a ticket does not fetch an fd.
  UniqueFd memfd(memfd_create("send_ledger_test", MFD_CLOEXEC));
  ASSERT_OK_AND_ASSIGN(FdToken fd_token, FdServer::Get().Register(std::move(memfd)));
  EXPECT_THAT(AckSend(fd_token.Encode()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fd token")));
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(1, &runs);
  EXPECT_THAT(FetchFds({Decoded(ticket)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("send ticket")));
  EXPECT_EQ(FdServer::Get().LookupLocal(Decoded(ticket)), -1);
  // A ticket of another machine.
  FdToken foreign = Decoded(ticket);
  foreign.boot_hash ^= 1;
  EXPECT_THAT(AckSend(foreign.Encode()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("another machine")));
  EXPECT_EQ(runs.load(), 0);
  EXPECT_OK(AckSend(ticket));
  FdServer::Get().Unregister(fd_token.key);
}

TEST_F(SendLedgerTest, WaitUntilEmptyReturnsWhenTheLastHoldIsAcked) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(1, &runs);
  std::thread acker([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_OK(AckSend(ticket));
  });
  const absl::Time start = absl::Now();
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(10)), 0u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(runs.load(), 1) << "the release has returned";
  acker.join();
}

TEST_F(SendLedgerTest, WaitUntilEmptyTimesOutWithHoldsLeft) {
  std::atomic<int> runs{0};
  const Ticket ticket = HoldCounted(1, &runs);
  const absl::Time start = absl::Now();
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Milliseconds(200)), 1u);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_OK(AckSend(ticket));
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::ZeroDuration()), 0u);
}

TEST_F(SendLedgerTest, AReleaseMayUseTheFdServerAndTheLedger) {
  // Each release registers and unregisters an fd and makes a hold of its own (acknowledged
  // below): the fd server's thread runs it for an ack and for a lease, holding no lock.
  std::atomic<int> runs{0};
  std::atomic<int> nested_runs{0};
  std::vector<Ticket> nested;
  Mutex nested_mu;
  auto release = [&] {
    UniqueFd memfd(memfd_create("send_ledger_test", MFD_CLOEXEC));
    absl::StatusOr<FdToken> token = FdServer::Get().Register(std::move(memfd));
    if (token.ok()) FdServer::Get().Unregister(token->key);
    absl::StatusOr<Ticket> inner = SendLedger::Get().Hold(1, [&] { ++nested_runs; });
    if (inner.ok()) {
      MutexLock lock(&nested_mu);
      nested.push_back(*inner);
    }
    ++runs;
  };
  ASSERT_OK_AND_ASSIGN(const Ticket acked, SendLedger::Get().Hold(1, release));
  EXPECT_EQ(AckFromChild(acked), absl::StatusCode::kOk);
  EXPECT_TRUE(Eventually([&] { return runs.load() == 1; }, absl::Milliseconds(5000)));

  SendLedger::Get().SetLease(absl::Milliseconds(100));
  ASSERT_OK(SendLedger::Get().Hold(1, release).status());
  SendLedger::Get().SetLease(lease_);
  EXPECT_TRUE(Eventually([&] { return runs.load() == 2; }, absl::Milliseconds(1500)));

  std::vector<Ticket> inner;
  {
    MutexLock lock(&nested_mu);
    inner = nested;
  }
  ASSERT_EQ(inner.size(), 2u);
  EXPECT_OK(AckSends(inner));
  EXPECT_EQ(nested_runs.load(), 2);
}

TEST_F(SendLedgerTest, TenThousandHoldsAreAckedInBatches) {
  constexpr int kHolds = 10000;
  std::atomic<int> runs{0};
  std::vector<Ticket> tickets;
  tickets.reserve(kHolds);
  const absl::Time start = absl::Now();
  for (int i = 0; i < kHolds; ++i) tickets.push_back(HoldCounted(1024, &runs));
  const absl::Duration hold_time = absl::Now() - start;
  EXPECT_EQ(SendLedger::Get().GetStats().held_bytes, uint64_t{kHolds} * 1024);
  const absl::Time acked_at = absl::Now();
  EXPECT_EQ(InForkedChild([&] { return CodeOf(AckSends(tickets)); }), 0);
  const absl::Duration ack_time = absl::Now() - acked_at;
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);  // the release thread
  EXPECT_EQ(runs.load(), kHolds);
  const SendLedger::Stats after = SendLedger::Get().GetStats();
  EXPECT_EQ(after.held_bytes, 0u);
  EXPECT_GE(after.peak_held_bytes, uint64_t{kHolds} * 1024);
  EXPECT_EQ(after.acked, before_.acked + kHolds);
  EXPECT_LT(hold_time, absl::Seconds(5));
  EXPECT_LT(ack_time, absl::Seconds(5));
  std::printf("%d holds: made in %s, acknowledged from another process in %s\n", kHolds,
              absl::FormatDuration(hold_time).c_str(), absl::FormatDuration(ack_time).c_str());
}

TEST_F(SendLedgerTest, AckSendsReportsTheFirstFailureAndAcksTheRest) {
  std::atomic<int> runs{0};
  std::vector<Ticket> tickets = {HoldCounted(1, &runs), HoldCounted(1, &runs),
                                 HoldCounted(1, &runs)};
  tickets[1][40] ^= 1;  // forged
  tickets.push_back(Ticket{});  // not a ticket
  EXPECT_THAT(AckSends(tickets),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("2 of 4 tickets failed")));
  EXPECT_EQ(runs.load(), 2);
  tickets[1][40] ^= 1;
  EXPECT_OK(AckSends(absl::MakeConstSpan(tickets).subspan(1, 1)));
  EXPECT_EQ(runs.load(), 3);
  EXPECT_OK(AckSends({}));
}

TEST_F(SendLedgerTest, AForkedChildHasAnEmptyLedgerAndRunsNoReleaseOfItsParent) {
  // The parent's releases count, by the process that ran them, into memory the child shares.
  struct Runs {
    std::atomic<int> in_parent{0};
    std::atomic<int> in_child{0};
  };
  void* memory = mmap(nullptr, sizeof(Runs), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(memory, MAP_FAILED);
  Runs* runs = new (memory) Runs();
  const pid_t parent = getpid();
  auto count = [runs, parent] { ++(getpid() == parent ? runs->in_parent : runs->in_child); };
  SendLedger::Get().SetLease(absl::Milliseconds(100));
  ASSERT_OK_AND_ASSIGN(const Ticket expiring, SendLedger::Get().Hold(1 << 20, count));
  SendLedger::Get().SetLease(lease_);
  ASSERT_OK_AND_ASSIGN(const Ticket kept, SendLedger::Get().Hold(1 << 20, count));
  const FdToken token = Decoded(kept);
  // The parent's release thread runs (an ack through its own fd server starts it).
  std::atomic<int> started{0};
  ASSERT_OK_AND_ASSIGN(const Ticket starter,
                       SendLedger::Get().Hold(1, [&started] { ++started; }));
  const FdToken starter_token = Decoded(starter);
  ASSERT_OK(fd_share_internal::AckBySocket(starter_token.pid, starter_token.server_id,
                                           {{starter_token.key, starter_token.nonce}},
                                           std::chrono::milliseconds(5000))
                .status());
  EXPECT_TRUE(Eventually([&] { return started.load() == 1; }, absl::Milliseconds(5000)));
  const int code = InForkedChild([&] {
    SendLedger& ledger = SendLedger::Get();
    const SendLedger::Stats stats = ledger.GetStats();
    if (stats.held != 0 || stats.held_bytes != 0 || stats.holds != 0) return 1;
    if (ledger.NextDeadline() != absl::InfiniteFuture()) return 2;
    absl::SleepFor(absl::Milliseconds(150));  // past the first hold's lease
    if (ledger.ExpireDue() != 0) return 3;
    if (ledger.Ack(token.key, token.nonce).code() != absl::StatusCode::kNotFound) return 4;
    if (ledger.WaitUntilEmpty(absl::ZeroDuration()) != 0) return 5;
    // The child's own holds, acked through its own fd server, run on its own release thread
    // (not under ThreadSanitizer, which cannot follow threads started after this fork).
    if (VMM_UNDER_TSAN) return 0;
    std::atomic<int> child_runs{0};
    absl::StatusOr<Ticket> own = ledger.Hold(1, [&child_runs] { ++child_runs; });
    if (!own.ok()) return 6;
    const FdToken own_token = Decoded(*own);
    absl::StatusOr<std::vector<bool>> acked = fd_share_internal::AckBySocket(
        own_token.pid, own_token.server_id, {{own_token.key, own_token.nonce}},
        std::chrono::milliseconds(5000));
    if (!acked.ok() || acked->size() != 1 || !(*acked)[0]) return 7;
    if (ledger.WaitUntilEmpty(absl::Seconds(5)) != 0 || child_runs.load() != 1) return 8;
    return 0;
  });
  EXPECT_EQ(code, 0);
  // The parent's holds are still the parent's: one ends by its lease, one by an ack.
  EXPECT_TRUE(Eventually([&] { return runs->in_parent.load() == 1; }, absl::Milliseconds(1500)));
  EXPECT_OK(AckSend(kept));
  EXPECT_EQ(runs->in_parent.load(), 2);
  EXPECT_EQ(runs->in_child.load(), 0);
  EXPECT_THAT(AckSend(expiring), StatusIs(absl::StatusCode::kNotFound));
  munmap(memory, sizeof(Runs));
}

TEST_F(SendLedgerTest, ForkWhileOtherThreadsHoldAndAck) {
  std::atomic<bool> stop{false};
  std::atomic<int> runs{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        absl::StatusOr<Ticket> ticket = SendLedger::Get().Hold(8, [&] { ++runs; });
        if (ticket.ok()) {
          EXPECT_OK(AckSend(*ticket));
        }
      }
    });
  }
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(InForkedChild([] {
                const SendLedger::Stats stats = SendLedger::Get().GetStats();
                if (stats.held != 0 || stats.held_bytes != 0) return 1;
                return SendLedger::Get().WaitUntilEmpty(absl::ZeroDuration()) == 0 ? 0 : 2;
              }),
              0);
  }
  stop.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_GT(runs.load(), 0);
}

TEST_F(SendLedgerTest, AForkWaitsForARunningReleaseSoTheChildFindsItsLocksFree) {
  // A release that holds a lock of its own (as a pool's, taken by a deferred free) for a while.
  Mutex resource;
  std::atomic<bool> inside{false};
  ASSERT_OK_AND_ASSIGN(const Ticket ticket, SendLedger::Get().Hold(8, [&] {
    MutexLock lock(&resource);
    inside.store(true);
    absl::SleepFor(absl::Milliseconds(300));
  }));
  const FdToken token = Decoded(ticket);
  // Acknowledged from another thread through the socket: the release thread runs it.
  std::thread acker([&] {
    EXPECT_OK(fd_share_internal::AckBySocket(token.pid, token.server_id,
                                             {{token.key, token.nonce}},
                                             std::chrono::milliseconds(5000))
                  .status());
  });
  ASSERT_TRUE(Eventually([&] { return inside.load(); }, absl::Milliseconds(5000)));
  // fork() now waits for the release, so the child finds `resource` free.
  EXPECT_EQ(InForkedChild([&] { return resource.TryLock() ? 0 : 1; }), 0);
  acker.join();
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
}

TEST_F(SendLedgerTest, ThreadsHoldAndAckConcurrently) {
  constexpr int kThreads = 6;
  constexpr int kPerThread = 300;
  std::atomic<int> runs{0};
  std::atomic<bool> done{false};
  // A thread that keeps reading the ledger and ending due holds while the others work.
  std::thread observer([&] {
    while (!done.load()) {
      SendLedger::Get().ExpireDue();
      SendLedger::Get().NextDeadline();
      const SendLedger::Stats stats = SendLedger::Get().GetStats();
      EXPECT_LE(stats.held_bytes, stats.peak_held_bytes);
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Ticket> pending;
      for (int i = 0; i < kPerThread; ++i) {
        absl::StatusOr<Ticket> ticket = SendLedger::Get().Hold(16, [&] { ++runs; });
        ASSERT_OK(ticket);
        pending.push_back(*ticket);
        if (pending.size() < 10) continue;
        if (t % 2 == 0) {
          // Through this process's own fd server, as another process would.
          const FdToken first = Decoded(pending[0]);
          std::vector<fd_share_internal::FdRequestEntry> entries;
          for (const Ticket& p : pending) {
            const FdToken token = Decoded(p);
            entries.push_back({token.key, token.nonce});
          }
          absl::StatusOr<std::vector<bool>> acked = fd_share_internal::AckBySocket(
              first.pid, first.server_id, entries, std::chrono::milliseconds(5000));
          ASSERT_OK(acked);
          EXPECT_EQ(std::count(acked->begin(), acked->end(), true), 10);
        } else {
          EXPECT_OK(AckSends(pending));
        }
        pending.clear();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done.store(true);
  observer.join();
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_EQ(runs.load(), kThreads * kPerThread);
  const SendLedger::Stats after = SendLedger::Get().GetStats();
  EXPECT_EQ(after.held, 0u);
  EXPECT_EQ(after.held_bytes, 0u);
  EXPECT_EQ(after.acked, before_.acked + kThreads * kPerThread);
}

// A release the fd server ends runs on the ledger's release thread: a slow one (here 500 ms)
// delays neither the ack's reply nor another process's fd fetch meanwhile.
TEST_F(SendLedgerTest, ASlowReleaseDelaysNoFetch) {
  std::atomic<bool> started{false};
  std::atomic<bool> finished{false};
  ASSERT_OK_AND_ASSIGN(const Ticket ticket, SendLedger::Get().Hold(1, [&] {
    started = true;
    absl::SleepFor(absl::Milliseconds(500));
    finished = true;
  }));
  UniqueFd memfd(memfd_create("send_ledger_test", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid());
  ASSERT_OK_AND_ASSIGN(const FdToken fd_token, FdServer::Get().Register(std::move(memfd)));
  const absl::Time acked_at = absl::Now();
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  EXPECT_LT(absl::Now() - acked_at, absl::Milliseconds(400)) << "the reply waited for it";
  ASSERT_TRUE(Eventually([&] { return started.load(); }, absl::Seconds(5)));
  // A fetch over the socket, served by the server's thread like any other process's (a forked
  // child cannot ask here: fork() waits for a running release, see the test above).
  const absl::Time start = absl::Now();
  EXPECT_OK(FetchFds({fd_token}).status());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_FALSE(finished.load()) << "the release should still be running";
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u) << "it waits for releases";
  EXPECT_TRUE(finished.load());
  FdServer::Get().Unregister(fd_token.key);
}

// --- Settles: holds that wait for the receiver's release report -----------------------------

// Reports `report` on `ticket` from a forked child; the status code it got.
absl::StatusCode ReportFromChild(const Ticket& ticket, SendReport report) {
  return static_cast<absl::StatusCode>(
      InForkedChild([&] { return CodeOf(ReportSends({ticket}, report)); }));
}

using ::testing::ElementsAre;

TEST_F(SendLedgerTest, AnAckedSettledHoldWaitsForItsReleaseReport) {
  Journal journal;
  const Ticket ticket = HoldSettled(1000, &journal);
  EXPECT_EQ(SendLedger::Get().GetStats().held, 1u);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  // The ack ends what the sender waits for: WaitUntilEmpty returns once the release ran.
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(journal.entries(), ElementsAre("release"));
  SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.held, 0u);
  EXPECT_EQ(stats.held_bytes, 0u);
  EXPECT_EQ(stats.awaiting_release, 1u);
  EXPECT_EQ(stats.acked, before_.acked + 1);
  EXPECT_EQ(stats.released, before_.released);
  EXPECT_NE(SendLedger::Get().NextDeadline(), absl::InfiniteFuture()) << "its lease still runs";
  EXPECT_LE(SendLedger::Get().NextDeadline(), absl::Now() + send_ledger_internal::kReportWait)
      << "the release report is waited for kReportWait at most";

  EXPECT_EQ(ReportFromChild(ticket, SendReport::kReleased), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);  // the release thread
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
  stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.awaiting_release, 0u);
  EXPECT_EQ(stats.released, before_.released + 1);
  EXPECT_EQ(stats.acked, before_.acked + 1);
  EXPECT_EQ(stats.expired, before_.expired);
  EXPECT_EQ(SendLedger::Get().NextDeadline(), absl::InfiniteFuture());
  // The hold is gone: every later report is stale.
  EXPECT_EQ(ReportFromChild(ticket, SendReport::kReleased), absl::StatusCode::kNotFound);
  EXPECT_THAT(ReportSends({ticket}, SendReport::kForwarded),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kNotFound);
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
}

// A send whose message failed to pickle: its sender withdraws it, which releases and settles
// it as released at once (no receiver can map it); only once, and only by its own process.
TEST_F(SendLedgerTest, TheSenderWithdrawsASendThatNeverLeft) {
  Journal journal;
  const Ticket ticket = HoldSettled(1000, &journal);
  EXPECT_EQ(static_cast<absl::StatusCode>(
                InForkedChild([&] { return CodeOf(CancelSend(ticket)); })),
            absl::StatusCode::kFailedPrecondition)
      << "another process may not withdraw it";
  EXPECT_THAT(journal.entries(), ElementsAre());
  EXPECT_OK(CancelSend(ticket));
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
  const SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.held, 0u);
  EXPECT_EQ(stats.awaiting_release, 0u);
  EXPECT_EQ(stats.released, before_.released) << "no receiver reported";
  EXPECT_EQ(stats.acked, before_.acked) << "no receiver acknowledged";
  EXPECT_THAT(CancelSend(ticket), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(AckSend(ticket), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(CancelSend(std::vector<uint8_t>(10, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
}

// A send its receiver acknowledged cannot be withdrawn: the receiver maps the memory, so the
// hold waits for its release report as before.
TEST_F(SendLedgerTest, AnAcknowledgedSendCannotBeWithdrawn) {
  Journal journal;
  const Ticket ticket = HoldSettled(1000, &journal);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(journal.entries(), ElementsAre("release"));
  EXPECT_THAT(CancelSend(ticket), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(journal.entries(), ElementsAre("release")) << "not settled as released";
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, 1u);
  EXPECT_EQ(ReportFromChild(ticket, SendReport::kReleased), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
}

// At exit, the sends of a queue whose data the program gave up are withdrawn by the thread
// that made them (its feeder): that thread's unacknowledged holds end, settled as not
// released (their payloads left: the memory must not be reused); another thread's, and an
// acknowledged one of the same thread, are left as they are.
// The token is the thread's identity for WithdrawMadeBy: threads that run one after another
// (where a Linux thread id may come round again) and at once each get their own, from 1.
TEST_F(SendLedgerTest, ThreadTokensAreNeverReused) {
  constexpr int kOneAfterAnother = 2000;
  constexpr int kAtOnce = 16;
  std::vector<int64_t> tokens(kOneAfterAnother + kAtOnce, 0);
  for (int i = 0; i < kOneAfterAnother; ++i) {
    std::thread([&tokens, i] { tokens[i] = SendLedger::ThreadToken(); }).join();
  }
  std::vector<std::thread> together;
  for (int i = 0; i < kAtOnce; ++i) {
    together.emplace_back(
        [&tokens, i] { tokens[kOneAfterAnother + i] = SendLedger::ThreadToken(); });
  }
  for (std::thread& thread : together) thread.join();
  tokens.push_back(SendLedger::ThreadToken());
  absl::flat_hash_set<int64_t> distinct(tokens.begin(), tokens.end());
  EXPECT_EQ(distinct.size(), tokens.size());
  EXPECT_GE(*std::min_element(tokens.begin(), tokens.end()), 1);
}

TEST_F(SendLedgerTest, WithdrawingAThreadsSendsEndsOnlyItsUnacknowledgedHolds) {
  Journal feeder_journal, acked_journal, other_journal;
  std::vector<Ticket> feeder_tickets;
  Ticket acked{};
  int64_t feeder_id = 0;
  std::thread feeder([&] {
    feeder_id = SendLedger::ThreadToken();
    for (int i = 0; i < 3; ++i) feeder_tickets.push_back(HoldSettled(100, &feeder_journal));
    acked = HoldSettled(100, &acked_journal);
  });
  feeder.join();
  // A thread started once the feeder ended has a token of its own (its Linux thread id may be
  // the feeder's once ids come round): its sends are not the feeder's.
  Journal later_journal;
  Ticket later_ticket{};
  int64_t later_id = 0;
  std::thread later([&] {
    later_id = SendLedger::ThreadToken();
    later_ticket = HoldSettled(100, &later_journal);
  });
  later.join();
  EXPECT_NE(later_id, feeder_id);
  EXPECT_EQ(SendLedger::ThreadToken(), SendLedger::ThreadToken()) << "one token a thread";
  EXPECT_NE(SendLedger::ThreadToken(), feeder_id);
  const Ticket other = HoldSettled(100, &other_journal);  // this thread's
  EXPECT_EQ(AckFromChild(acked), absl::StatusCode::kOk);
  const absl::Time by = absl::Now() + absl::Seconds(5);  // the release thread runs it
  while (acked_journal.entries().empty() && absl::Now() < by) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_THAT(acked_journal.entries(), ElementsAre("release"));

  // Held: the feeder's 3 unacknowledged, the later thread's and this thread's.
  const int64_t feeder_and_later[] = {feeder_id, later_id};
  EXPECT_EQ(SendLedger::Get().HeldNotMadeBy({}), 5u);
  EXPECT_EQ(SendLedger::Get().HeldNotMadeBy(absl::MakeConstSpan(&feeder_id, 1)), 2u);
  EXPECT_EQ(SendLedger::Get().HeldNotMadeBy(feeder_and_later), 1u);
  EXPECT_EQ(SendLedger::Get().WithdrawMadeBy(feeder_id), 3u);
  EXPECT_EQ(SendLedger::Get().HeldNotMadeBy({}), 2u);
  EXPECT_THAT(feeder_journal.entries(),
              ElementsAre("release", "settle(false)", "release", "settle(false)", "release",
                          "settle(false)"));
  EXPECT_THAT(acked_journal.entries(), ElementsAre("release")) << "a receiver maps it";
  EXPECT_THAT(other_journal.entries(), ElementsAre());
  EXPECT_THAT(later_journal.entries(), ElementsAre());
  for (const Ticket& ticket : feeder_tickets) {
    EXPECT_THAT(CancelSend(ticket), StatusIs(absl::StatusCode::kNotFound));
  }
  EXPECT_EQ(SendLedger::Get().WithdrawMadeBy(feeder_id), 0u) << "nothing more to withdraw";
  EXPECT_EQ(SendLedger::Get().GetStats().held, 2u);
  EXPECT_OK(CancelSend(other));
  EXPECT_OK(CancelSend(later_ticket));
  EXPECT_EQ(ReportFromChild(acked, SendReport::kReleased), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
}

TEST_F(SendLedgerTest, ASecondAckIsRefusedAndSettlesAsNotReleased) {
  // Its payload was imported twice: the importers are no longer counted, so the memory must
  // not be reused (settle(false)), and the release does not run again.
  Journal journal;
  const Ticket ticket = HoldSettled(1000, &journal);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(journal.entries(), ElementsAre("release"));
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kNotFound);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);  // the release thread
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(false)"));
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, 0u);
  EXPECT_EQ(ReportFromChild(ticket, SendReport::kReleased), absl::StatusCode::kNotFound);
  EXPECT_THAT(AckSend(ticket), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(false)"));
}

TEST_F(SendLedgerTest, AForwardReportSettlesAsNotReleased) {
  Journal journal;
  const Ticket ticket = HoldSettled(1, &journal);
  EXPECT_OK(AckSend(ticket));
  EXPECT_THAT(journal.entries(), ElementsAre("release"));
  EXPECT_EQ(ReportFromChild(ticket, SendReport::kForwarded), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(false)"));
  const SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.released, before_.released) << "a forward is no release";
  EXPECT_EQ(stats.awaiting_release, 0u);
}

// A release report that overtakes the ack counts as both: the release, then the settle.
TEST_F(SendLedgerTest, AReportBeforeAnyAckRunsTheReleaseThenTheSettle) {
  Journal released_journal;
  Journal forwarded_journal;
  const Ticket released = HoldSettled(64, &released_journal);
  const Ticket forwarded = HoldSettled(64, &forwarded_journal);
  EXPECT_OK(ReportSends({released}, SendReport::kReleased));  // this process: no socket
  EXPECT_THAT(released_journal.entries(), ElementsAre("release", "settle(true)"));
  EXPECT_EQ(ReportFromChild(forwarded, SendReport::kForwarded), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(forwarded_journal.entries(), ElementsAre("release", "settle(false)"));
  const SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.acked, before_.acked + 2) << "a report implies the import";
  EXPECT_EQ(stats.released, before_.released + 1);
  EXPECT_EQ(stats.expired, before_.expired);
  EXPECT_EQ(stats.held, 0u);
  EXPECT_EQ(stats.held_bytes, 0u);
  EXPECT_EQ(stats.awaiting_release, 0u);
  // The ack that comes late finds nothing.
  EXPECT_THAT(AckSend(released), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(AckFromChild(forwarded), absl::StatusCode::kNotFound);
  EXPECT_EQ(released_journal.entries().size(), 2u);
  EXPECT_EQ(forwarded_journal.entries().size(), 2u);
}

// A hold without a settle ends with its ack; a release report before the ack ends it too.
TEST_F(SendLedgerTest, AHoldWithoutASettleEndsWithTheFirstReport) {
  std::atomic<int> runs{0};
  const Ticket acked = HoldCounted(1, &runs);
  EXPECT_OK(AckSend(acked));
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, 0u);
  EXPECT_THAT(ReportSends({acked}, SendReport::kReleased), StatusIs(absl::StatusCode::kNotFound));
  const Ticket reported = HoldCounted(1, &runs);
  EXPECT_OK(ReportSends({reported}, SendReport::kReleased));
  EXPECT_EQ(runs.load(), 2);
  EXPECT_THAT(AckSend(reported), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(runs.load(), 2);
}

TEST_F(SendLedgerTest, ALeaseEndingAfterTheAckSettlesAsNotReleased) {
  Journal journal;
  SendLedger::Get().SetLease(absl::Milliseconds(200));
  const Ticket ticket = HoldSettled(4096, &journal);
  SendLedger::Get().SetLease(lease_);
  EXPECT_OK(AckSend(ticket));
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, 1u);
  // Nothing here calls the ledger: the fd server's loop ends it.
  EXPECT_TRUE(Eventually([&] { return journal.entries().size() == 2; }, absl::Seconds(2)));
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(false)"))
      << "the release runs once; the lease settles as not released";
  const SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.expired, before_.expired) << "acknowledged in time: no expiry";
  EXPECT_EQ(stats.awaiting_release, 0u);
  EXPECT_EQ(stats.released, before_.released);
  EXPECT_EQ(ReportFromChild(ticket, SendReport::kReleased), absl::StatusCode::kNotFound);
}

TEST_F(SendLedgerTest, ALeaseEndingBeforeTheAckReleasesAndSettles) {
  Journal journal;
  SendLedger::Get().SetLease(absl::Milliseconds(100));
  const Ticket ticket = HoldSettled(4096, &journal);
  SendLedger::Get().SetLease(lease_);
  EXPECT_TRUE(Eventually([&] { return journal.entries().size() == 2; }, absl::Seconds(2)));
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(false)"));
  const SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.expired, before_.expired + 1);
  EXPECT_EQ(stats.acked, before_.acked);
  EXPECT_EQ(stats.held_bytes, 0u);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kNotFound);
}

TEST_F(SendLedgerTest, WaitUntilEmptyDoesNotWaitForAcknowledgedHolds) {
  Journal journal;
  const Ticket ticket = HoldSettled(1, &journal);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::ZeroDuration()), 1u) << "not yet acked";
  EXPECT_OK(AckSend(ticket));
  const absl::Time start = absl::Now();
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_OK(ReportSends({ticket}, SendReport::kReleased));
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
}

TEST_F(SendLedgerTest, ProgressCountsReleasesAndSettlesThatRan) {
  SendLedger& ledger = SendLedger::Get();
  Journal journal;
  const uint64_t start = ledger.Progress();
  const Ticket ticket = HoldSettled(1, &journal);
  EXPECT_EQ(ledger.Progress(), start) << "a hold is no progress";
  const absl::Time before_wait = absl::Now();
  EXPECT_FALSE(ledger.WaitForProgress(start, absl::Milliseconds(100)));
  EXPECT_GE(absl::Now() - before_wait, absl::Milliseconds(90));
  EXPECT_OK(AckSend(ticket));
  const uint64_t acked = ledger.Progress();
  EXPECT_GT(acked, start);
  EXPECT_TRUE(ledger.WaitForProgress(start, absl::ZeroDuration())) << "already passed";
  EXPECT_OK(ReportSends({ticket}, SendReport::kReleased));
  EXPECT_GT(ledger.Progress(), acked);
}

// A waiter wakes when a release runs on another thread (here the fd server's release thread,
// for an ack from another process), also with no timeout at all.
TEST_F(SendLedgerTest, WaitForProgressWakesWhenAnotherThreadMakesSome) {
  for (const absl::Duration timeout : {absl::Seconds(10), absl::InfiniteDuration()}) {
    SCOPED_TRACE(absl::FormatDuration(timeout));
    Journal journal;
    const Ticket ticket = HoldSettled(1, &journal);
    const uint64_t seen = SendLedger::Get().Progress();
    std::thread acker([&] {
      absl::SleepFor(absl::Milliseconds(100));
      EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
    });
    const absl::Time start = absl::Now();
    EXPECT_TRUE(SendLedger::Get().WaitForProgress(seen, timeout));
    const absl::Duration waited = absl::Now() - start;
    EXPECT_GE(waited, absl::Milliseconds(90)) << "returned before any progress";
    EXPECT_LT(waited, absl::Seconds(5));
    acker.join();
    // The ack was answered (and was progress) before its release ran on the release thread
    // (AnAckIsProgressBeforeItsReleaseRuns): wait for it, since it writes to `journal`, which
    // ends with this iteration (a release run after it hung on the dead journal's lock).
    EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(10)), 0u);
    EXPECT_OK(ReportSends({ticket}, SendReport::kReleased));
    EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
  }
}

// An ack from another process is progress at once, before its release has run on the release
// thread: a send budget's waiter needs only the ack, not a slow release (an unmap).
TEST_F(SendLedgerTest, AnAckIsProgressBeforeItsReleaseRuns) {
  SendLedger& ledger = SendLedger::Get();
  absl::Notification release_started, let_release_return;
  ASSERT_OK_AND_ASSIGN(const Ticket ticket, ledger.Hold(1, [&] {
    release_started.Notify();
    let_release_return.WaitForNotification();
  }));
  const uint64_t seen = ledger.Progress();
  ASSERT_EQ(ledger.RecentHeldBytes(absl::Hours(1)), 1u);
  EXPECT_EQ(AckFromChild(ticket), absl::StatusCode::kOk);
  ASSERT_TRUE(release_started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(ledger.WaitForProgress(seen, absl::ZeroDuration()))
      << "the ack was no progress until its release returned";
  EXPECT_EQ(ledger.RecentHeldBytes(absl::Hours(1)), 0u);
  let_release_return.Notify();
  EXPECT_EQ(ledger.WaitUntilEmpty(absl::Seconds(10)), 0u);
}

// Reports over the socket, as the receiver's background thread sends them: batched, of each
// kind, run on the exporter's release thread.
TEST_F(SendLedgerTest, ReportsThroughTheSocketSettleEveryHold) {
  constexpr int kHolds = 300;  // two requests on one connection
  std::atomic<int> releases{0}, settled_true{0}, settled_false{0};
  std::vector<fd_share_internal::FdRequestEntry> entries;
  FdToken first;
  for (int i = 0; i < kHolds; ++i) {
    ASSERT_OK_AND_ASSIGN(const Ticket ticket,
                         SendLedger::Get().Hold(
                             1, [&] { ++releases; },
                             [&](bool released) { ++(released ? settled_true : settled_false); }));
    first = Decoded(ticket);
    entries.push_back({first.key, first.nonce});
  }
  const auto half = absl::MakeConstSpan(entries).subspan(0, kHolds / 2);
  const auto rest = absl::MakeConstSpan(entries).subspan(kHolds / 2);
  auto report = [&](absl::Span<const fd_share_internal::FdRequestEntry> which,
                    SendReport kind) {
    absl::StatusOr<std::vector<bool>> done = fd_share_internal::AckBySocket(
        first.pid, first.server_id, which, std::chrono::milliseconds(5000), kind);
    EXPECT_OK(done);
    return done.ok() ? static_cast<int>(std::count(done->begin(), done->end(), true)) : -1;
  };
  EXPECT_EQ(report(entries, SendReport::kImported), kHolds);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_EQ(releases.load(), kHolds);
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, uint64_t{kHolds});
  EXPECT_EQ(report(half, SendReport::kReleased), kHolds / 2);
  EXPECT_EQ(report(rest, SendReport::kForwarded), kHolds - kHolds / 2);
  EXPECT_EQ(report(entries, SendReport::kReleased), 0) << "settled already";
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_EQ(settled_true.load(), kHolds / 2);
  EXPECT_EQ(settled_false.load(), kHolds - kHolds / 2);
  EXPECT_EQ(releases.load(), kHolds);
  const SendLedger::Stats stats = SendLedger::Get().GetStats();
  EXPECT_EQ(stats.released, before_.released + kHolds / 2);
  EXPECT_EQ(stats.awaiting_release, 0u);
}

// A forked child starts with no hold awaiting a report, and its reports on its parent's sends
// go to the parent.
TEST_F(SendLedgerTest, AForkedChildAwaitsNoReportOfItsParent) {
  Journal journal;
  const Ticket ticket = HoldSettled(1, &journal);
  EXPECT_OK(AckSend(ticket));
  EXPECT_EQ(InForkedChild([] {
              const SendLedger::Stats stats = SendLedger::Get().GetStats();
              return stats.awaiting_release == 0 && stats.held == 0 ? 0 : 1;
            }),
            0);
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, 1u);
  EXPECT_EQ(ReportFromChild(ticket, SendReport::kReleased), absl::StatusCode::kOk);
  EXPECT_EQ(SendLedger::Get().WaitUntilEmpty(absl::Seconds(5)), 0u);
  EXPECT_THAT(journal.entries(), ElementsAre("release", "settle(true)"));
}

TEST(SendLeaseTest, ParsesPositiveSeconds) {
  using send_ledger_internal::ParseLeaseSeconds;
  EXPECT_EQ(ParseLeaseSeconds("600").value_or(absl::ZeroDuration()), absl::Seconds(600));
  EXPECT_EQ(ParseLeaseSeconds("0.25").value_or(absl::ZeroDuration()), absl::Milliseconds(250));
  EXPECT_EQ(ParseLeaseSeconds(" 2 ").value_or(absl::ZeroDuration()), absl::Seconds(2));
  for (const char* bad : {"", "0", "-1", "abc", "10s", "inf", "nan", "1e400"}) {
    EXPECT_THAT(ParseLeaseSeconds(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positive number")))
        << bad;
  }
}

// Run by LeaseComesFromTheEnvironment in a fresh process: prints the lease it found.
TEST(SendLeaseTest, PrintLease) {
  if (std::getenv("SEND_LEDGER_TEST_PRINT_LEASE") == nullptr) GTEST_SKIP();
  std::printf("lease=%s\n", absl::FormatDuration(SendLedger::Get().lease()).c_str());
}

TEST(SendLeaseTest, LeaseComesFromTheEnvironment) {
  struct Case {
    const char* value;
    const char* lease;
    bool warns;
  };
  for (const Case& c : {Case{"2.5", "lease=2.5s", false}, Case{"later", "lease=10m", true},
                        Case{"0", "lease=10m", true}}) {
    Subprocess self({"/proc/self/exe", "--gtest_filter=SendLeaseTest.PrintLease"},
                    {absl::StrCat("VMM_SEND_LEASE_S=", c.value), "SEND_LEDGER_TEST_PRINT_LEASE=1",
                     "VMM_LOG_LEVEL=warning", "GTEST_OUTPUT=", "TEST_PREMATURE_EXIT_FILE="},
                    Subprocess::Output::kWithStderr);
    ASSERT_TRUE(self.started());
    const std::string output = self.ReadAll();
    EXPECT_EQ(self.Wait(), 0) << output;
    EXPECT_THAT(output, HasSubstr(c.lease)) << c.value;
    EXPECT_EQ(output.find("VMM_SEND_LEASE_S") != std::string::npos, c.warns) << output;
  }
}

}  // namespace
}  // namespace vmm

namespace vmm {
namespace {

// What the send budget counts: unacknowledged holds made within the window; an older one stops
// counting for good (its receiver is not reading), an acknowledged one at once.
TEST(SendLedgerRecentTest, RecentHeldBytesCountsTheWindowsUnacknowledgedHolds) {
  const uint64_t base = SendLedger::Get().RecentHeldBytes(absl::Hours(1));
  Journal journal;
  const SendLedger::Ticket a = HoldSettled(1000, &journal);
  const SendLedger::Ticket b = HoldSettled(2000, &journal);
  EXPECT_EQ(SendLedger::Get().RecentHeldBytes(absl::Hours(1)), base + 3000);
  ASSERT_TRUE(AckSend(a).ok());
  EXPECT_EQ(SendLedger::Get().RecentHeldBytes(absl::Hours(1)), base + 2000);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(SendLedger::Get().RecentHeldBytes(absl::Milliseconds(10)), 0u) << "aged out";
  EXPECT_EQ(SendLedger::Get().RecentHeldBytes(absl::Hours(1)), 0u) << "for good";
  EXPECT_EQ(SendLedger::Get().GetStats().held_bytes >= 2000, true) << "still held";
  ASSERT_TRUE(AckSend(b).ok());
  EXPECT_EQ(SendLedger::Get().RecentHeldBytes(absl::Hours(1)), 0u);
  const SendLedger::Ticket c = HoldSettled(4000, &journal);
  EXPECT_EQ(SendLedger::Get().RecentHeldBytes(absl::Hours(1)), 4000u);
  ASSERT_TRUE(AckSend(c).ok());
  for (const auto& t : {a, b, c}) (void)ReportSends({t}, SendReport::kReleased);
}

}  // namespace
}  // namespace vmm
