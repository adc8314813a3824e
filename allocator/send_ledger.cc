#include "allocator/send_ledger.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "allocator/capture_window.h"
#include "allocator/fd_share.h"
#include "allocator/fd_share_internal.h"
#include "allocator/fork_guard.h"
#include "allocator/log.h"
#include "allocator/mutex.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

using Nonce = std::array<uint8_t, 16>;
using Release = absl::AnyInvocable<void() &&>;
using Settle = absl::AnyInvocable<void(bool released) &&>;

// How long a receiver waits to connect to the exporter and for each reply.
constexpr std::chrono::milliseconds kAckTimeout = std::chrono::seconds(2);

// Compares nonces in time that does not depend on where they differ.
bool SameNonce(const Nonce& a, const Nonce& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

// The lease VMM_SEND_LEASE_S asks for (read once), else the default; a malformed value is
// said once and the default used.
absl::Duration LeaseFromEnvironment() {
  const char* text = std::getenv("VMM_SEND_LEASE_S");
  if (text == nullptr || text[0] == '\0') return send_ledger_internal::kDefaultLease;
  absl::StatusOr<absl::Duration> lease = send_ledger_internal::ParseLeaseSeconds(text);
  if (!lease.ok()) {
    LogWarningOnce("send-lease", absl::StrCat("VMM_SEND_LEASE_S: ", lease.status().message(),
                                              "; using the default lease of ",
                                              absl::FormatDuration(
                                                  send_ledger_internal::kDefaultLease)));
    return send_ledger_internal::kDefaultLease;
  }
  return *lease;
}

}  // namespace

namespace send_ledger_internal {

absl::StatusOr<absl::Duration> ParseLeaseSeconds(absl::string_view text) {
  double seconds = 0;
  if (!absl::SimpleAtod(text, &seconds) || !std::isfinite(seconds) || seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease \"", text, "\" is not a positive number of seconds"));
  }
  return absl::Seconds(seconds);
}

}  // namespace send_ledger_internal

// The ledger's state, under one lock. Releases are moved out under the lock and run after it
// is dropped, by the caller or, queued, by the release thread; `releasing_` counts those
// queued or running, so that WaitUntilEmpty waits for them too.
class SendLedger::Impl {
 public:
  struct Entry {
    Nonce nonce;
    uint64_t bytes = 0;
    absl::Time deadline;
    Release release;
    Settle settle;       // null: the entry ends with the ack
    bool acked = false;  // the release has been taken; the entry waits for its settle
    absl::Time sent;     // when it was made
    uint64_t key = 0;    // its key in holds_
    bool recent = true;  // unacknowledged and counted in recent_bytes_ (RecentHeldBytes)
    int64_t thread = 0;  // the ThreadToken of the thread that made it (WithdrawMadeBy)
  };
  using Holds = absl::flat_hash_map<uint64_t, Entry>;

  Impl() : lease_(LeaseFromEnvironment()) {}

  // Adds a hold; true when it ends sooner than every other (the fd server must look again).
  bool Add(uint64_t bytes, const Nonce& nonce, Release release, Settle settle, int64_t thread,
           uint64_t* key) {
    MutexLock lock(&mu_);
    *key = next_key_++;
    const absl::Time deadline = absl::Now() + lease_;
    const bool soonest = deadlines_.empty() || deadline < deadlines_.begin()->first;
    const absl::Time now = deadline - lease_;
    holds_.emplace(*key, Entry{nonce, bytes, deadline, std::move(release), std::move(settle),
                               /*acked=*/false, now, *key, /*recent=*/true, thread});
    deadlines_.insert({deadline, *key});
    recent_.insert({now, *key});
    recent_bytes_ += bytes;
    ++unacked_;
    stats_.held_bytes += bytes;
    stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
    ++stats_.holds;
    return soonest;
  }

  // Ends the unacknowledged hold (key, nonce) as withdrawn by its sender (released, settled
  // as released), appending what must run to `out`: NotFound if there is no such hold,
  // FailedPrecondition if it was acknowledged (a receiver has it; the hold is left as it is).
  absl::Status TakeWithdrawal(uint64_t key, const Nonce& nonce, std::vector<Release>* out) {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it == holds_.end() || !SameNonce(it->second.nonce, nonce)) {
      return absl::NotFoundError(absl::StrCat("no such hold: ", key));
    }
    if (it->second.acked) {
      return absl::FailedPreconditionError(
          "the send was received already: it cannot be withdrawn");
    }
    Erase(it, /*released=*/true, out);  // counted neither as acknowledged nor as released
    return absl::OkStatus();
  }

  // The unacknowledged holds made by no thread of `threads`, counted in one step.
  size_t CountHeldNotMadeBy(absl::Span<const int64_t> threads) {
    MutexLock lock(&mu_);
    size_t count = 0;
    for (const auto& [key, entry] : holds_) {
      count += !entry.acked && absl::c_find(threads, entry.thread) == threads.end();
    }
    return count;
  }

  // Ends every unacknowledged hold made by thread `thread`, settled as not released (its
  // payload may have left: a receiver may still import it, so its memory is never reused);
  // returns how many.
  size_t TakeWithdrawalsMadeBy(int64_t thread, std::vector<Release>* out) {
    MutexLock lock(&mu_);
    std::vector<uint64_t> keys;
    for (const auto& [key, entry] : holds_) {
      if (entry.thread == thread && !entry.acked) keys.push_back(key);
    }
    for (uint64_t key : keys) Erase(holds_.find(key), /*released=*/false, out);
    return keys.size();
  }

  // Applies the receiver's `report` on the hold (key, nonce), appending what must run to
  // `out`; false if there is no such hold (or it was acknowledged already, for kImported).
  bool TakeReport(uint64_t key, const Nonce& nonce, SendReport report,
                  std::vector<Release>* out) {
    MutexLock lock(&mu_);
    auto it = holds_.find(key);
    if (it == holds_.end() || !SameNonce(it->second.nonce, nonce)) return false;
    if (report == SendReport::kImported) {
      if (it->second.acked) {
        // A second import of one send (its payload imported twice): importers are no longer
        // counted, so its memory must not be reused. Still NotFound for this ack.
        if (it->second.settle) Erase(it, /*released=*/false, out);
        return false;
      }
      AckLocked(it->second, out);
      if (!it->second.settle) {
        Erase(it, /*released=*/false, out);
      } else {
        // The receiver's release report is waited for kReportWait at most (it may keep the
        // tensor for long: its memory is then its own, and the sender stops counting on it).
        const absl::Time report_by = absl::Now() + send_ledger_internal::kReportWait;
        if (report_by < it->second.deadline) {
          deadlines_.erase({it->second.deadline, it->first});
          it->second.deadline = report_by;
          deadlines_.insert({report_by, it->first});
        }
      }
      return true;
    }
    if (report == SendReport::kReleased) ++stats_.released;
    if (!it->second.acked) AckLocked(it->second, out);  // the report implies the import
    Erase(it, report == SendReport::kReleased, out);
    return true;
  }

  // Ends the holds whose lease is over (a release not yet run, then the settle as not
  // released) and returns what must run.
  std::vector<Release> TakeExpired() {
    std::vector<Release> out;
    MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      auto it = holds_.find(deadlines_.begin()->second);
      if (!it->second.acked) ++stats_.expired;
      Erase(it, /*released=*/false, &out);
    }
    return out;
  }

  // Runs releases taken by TakeAcked or TakeExpired, no ledger lock held but the run gate
  // (unless this thread is inside a release already), then counts them done.
  void Run(std::vector<Release>& releases) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const bool outermost = !in_release;
    if (outermost) {
      run_gate_.Lock();
      in_release = true;
    }
    for (Release& release : releases) {
      if (release) std::move(release)();
    }
    if (outermost) {
      in_release = false;
      run_gate_.Unlock();
    }
    MutexLock lock(&mu_);
    releasing_ -= releases.size();
    ++progress_count_;  // what the releases and settles gave back is back
    progress_->notify_all();
    if (OutstandingLocked() == 0) emptied_->notify_all();
  }

  // Hands releases taken by TakeAcked or TakeExpired to the release thread, starting it if
  // this process has none yet. If no thread can be started, runs them here (said once).
  void Enqueue(std::vector<Release> releases) {
    if (releases.empty()) return;
    bool start = false;
    {
      MutexLock lock(&mu_);
      for (Release& release : releases) queue_.push_back(std::move(release));
      start = !thread_running_;
      thread_running_ = true;
      if (!start) work_->notify_one();
    }
    if (!start) return;
    try {
      std::thread([this] { ReleaseLoop(); }).detach();  // lives as long as the process
      return;
    } catch (const std::system_error& e) {
      LogWarningOnce("send-release-thread",
                     absl::StrCat("cannot start the send ledger's release thread (", e.what(),
                                  "); releases run on the fd server's thread"));
    }
    std::vector<Release> now;
    {
      MutexLock lock(&mu_);
      thread_running_ = false;  // the next Enqueue tries again
      now = TakeQueueLocked();
    }
    Run(now);
  }

  uint64_t RecentHeldBytes(absl::Duration window) {
    MutexLock lock(&mu_);
    const absl::Time since = absl::Now() - window;
    while (!recent_.empty() && recent_.begin()->first < since) {
      Unrecent(holds_.find(recent_.begin()->second)->second);
    }
    return recent_bytes_;
  }

  uint64_t Progress() {
    MutexLock lock(&mu_);
    return progress_count_;
  }

  bool WaitForProgress(uint64_t since, absl::Duration timeout) {
    // As WaitUntilEmpty: absl::Time saturates (an infinite timeout waits for ever), where
    // now() + nanoseconds::max() would overflow and not wait at all.
    const auto until = absl::ToChronoTime(absl::Now() + timeout);
    MutexLock lock(&mu_);
    while (progress_count_ == since && std::chrono::system_clock::now() < until) {
      progress_->wait_until(mu_, until);  // unlocks mu_ while waiting
    }
    return progress_count_ != since;
  }

  absl::Time NextDeadline() {
    MutexLock lock(&mu_);
    return deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first;
  }

  void SetLease(absl::Duration lease) {
    MutexLock lock(&mu_);
    lease_ = lease;
  }

  absl::Duration lease() {
    MutexLock lock(&mu_);
    return lease_;
  }

  size_t WaitUntilEmpty(absl::Duration timeout) {
    const auto until = absl::ToChronoTime(absl::Now() + timeout);
    MutexLock lock(&mu_);
    while (OutstandingLocked() > 0 && std::chrono::system_clock::now() < until) {
      emptied_->wait_until(mu_, until);  // unlocks mu_ while waiting
    }
    return OutstandingLocked();
  }

  Stats GetStats() {
    MutexLock lock(&mu_);
    Stats stats = stats_;
    stats.held = unacked_;
    stats.awaiting_release = holds_.size() - unacked_;
    return stats;
  }

  // fork() handlers (allocator/fork_guard.h): the lock is held across fork(), so that the
  // child finds the state whole; the child then starts with an empty ledger. The run gate is
  // taken before it (and before the locks of the state, pools and drivers that releases take:
  // ForkLevel::kSendReleases): a fork waits for a release that is running, so that the child
  // never inherits half of one. A fork from inside a release (never done by vmm) skips the
  // gate.
  void GateForFork() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    gated_fork_ = !in_release;
    if (gated_fork_) run_gate_.Lock();
  }
  void UngateInParent() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (gated_fork_) run_gate_.Unlock();
  }
  void UngateInChild() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (gated_fork_) run_gate_.UnlockInForkChild();
  }
  void LockForFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { mu_.Lock(); }
  void UnlockInParent() ABSL_NO_THREAD_SAFETY_ANALYSIS { mu_.Unlock(); }
  void ForgetParentInChild() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    // The parent's holds are the parent's: their releases never run here, and they are not
    // destroyed either (what they capture belongs to the parent), so they are kept aside.
    // The same for the releases queued for the parent's release thread, which the child does
    // not have: its own starts with its first queued release.
    static auto* parents_holds = new std::vector<Holds>();
    static auto* parents_queues = new std::vector<std::deque<Release>>();
    parents_holds->push_back(std::move(holds_));
    holds_ = Holds();
    parents_queues->push_back(std::move(queue_));
    queue_ = std::deque<Release>();
    thread_running_ = false;
    deadlines_.clear();
    recent_.clear();
    recent_bytes_ = 0;
    unacked_ = 0;
    releasing_ = 0;
    stats_ = Stats();
    // A thread of the parent may have been inside a condition variable: fresh ones.
    emptied_ = new std::condition_variable_any();
    work_ = new std::condition_variable_any();
    progress_ = new std::condition_variable_any();
    mu_.UnlockInForkChild();
  }

 private:
  // Marks `entry` acknowledged: its release goes to `out`, counted as running.
  void AckLocked(Entry& entry, std::vector<Release>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Progress at once, not only once the release has run: a send budget counts unacknowledged
    // bytes, so its waiter may go on now, without waiting for a slow release (an unmap of a
    // large chunk) on the release thread.
    if (entry.recent) {
      ++progress_count_;
      progress_->notify_all();
    }
    Unrecent(entry);
    entry.acked = true;
    ++stats_.acked;
    --unacked_;
    stats_.held_bytes -= entry.bytes;
    out->push_back(std::move(entry.release));
    ++releasing_;
  }

  // Removes the hold at `it` (which exists): its release, if not taken yet, then its settle
  // with `released`, go to `out`, counted as running.
  void Erase(Holds::iterator it, bool released, std::vector<Release>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Entry& entry = it->second;
    if (!entry.acked) {
      AckLocked(entry, out);
      --stats_.acked;  // ended without an ack (a lease, or a report that came first)
    }
    if (entry.settle) {
      out->push_back([settle = std::move(entry.settle), released]() mutable {
        std::move(settle)(released);
      });
      ++releasing_;
    }
    deadlines_.erase({entry.deadline, it->first});
    holds_.erase(it);
  }

  // Takes `entry` out of the recent unacknowledged holds (if it is there).
  void Unrecent(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!entry.recent) return;
    entry.recent = false;
    recent_bytes_ -= entry.bytes;
    recent_.erase({entry.sent, entry.key});
  }

  // Holds not yet acknowledged and releases not yet returned: what WaitUntilEmpty waits for
  // (a receiver may keep what it imported for long; that is no longer the sender's wait).
  size_t OutstandingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return unacked_ + releasing_;
  }

  std::vector<Release> TakeQueueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Release> out;
    out.reserve(queue_.size());
    for (Release& release : queue_) out.push_back(std::move(release));
    queue_.clear();
    return out;
  }

  // The release thread: runs queued releases in order, one batch at a time, no lock held.
  void ReleaseLoop() {
    for (;;) {
      std::vector<Release> batch;
      {
        MutexLock lock(&mu_);
        while (queue_.empty()) work_->wait(mu_);  // unlocks mu_ while waiting
        batch = TakeQueueLocked();
      }
      // Frees and unmaps: not while a graph is captured (capture_window.h).
      EnterBackgroundWork();
      Run(batch);
      LeaveBackgroundWork();
    }
  }

  // Held while releases run (outermost Run of a thread), and by fork() (LockForFork).
  Mutex run_gate_;
  bool gated_fork_ = false;  // LockForFork took the run gate (read in the fork handlers only)
  static thread_local bool in_release;  // this thread runs releases (holds the run gate)
  Mutex mu_;
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Duration lease_ ABSL_GUARDED_BY(mu_);
  Holds holds_ ABSL_GUARDED_BY(mu_);
  size_t unacked_ ABSL_GUARDED_BY(mu_) = 0;  // holds not yet acknowledged
  // (sent, key) of the unacknowledged holds counted in recent_bytes_, oldest first.
  absl::btree_set<std::pair<absl::Time, uint64_t>> recent_ ABSL_GUARDED_BY(mu_);
  uint64_t recent_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // (deadline, key) of every hold, soonest first.
  absl::btree_set<std::pair<absl::Time, uint64_t>> deadlines_ ABSL_GUARDED_BY(mu_);
  size_t releasing_ ABSL_GUARDED_BY(mu_) = 0;  // taken, not yet returned (queued or running)
  // Releases for the release thread, in order, and whether it runs (or is being started).
  std::deque<Release> queue_ ABSL_GUARDED_BY(mu_);
  bool thread_running_ ABSL_GUARDED_BY(mu_) = false;
  Stats stats_ ABSL_GUARDED_BY(mu_);  // `held` is holds_.size(), filled in by GetStats
  // Notified when nothing is outstanding; replaced (never freed) in a forked child.
  std::condition_variable_any* emptied_ ABSL_GUARDED_BY(mu_) =
      new std::condition_variable_any();
  // Notified when queue_ gets work; replaced (never freed) in a forked child.
  std::condition_variable_any* work_ ABSL_GUARDED_BY(mu_) = new std::condition_variable_any();
  // Batches of releases and settles run so far (Progress), notified on progress_ (replaced,
  // never freed, in a forked child).
  uint64_t progress_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::condition_variable_any* progress_ ABSL_GUARDED_BY(mu_) =
      new std::condition_variable_any();
};

thread_local bool SendLedger::Impl::in_release = false;

SendLedger& SendLedger::Get() {
  // Never destroyed; not a function's static (fork_guard.h PublishOnce: its constructor may
  // warn, under the log's lock, about a malformed VMM_SEND_LEASE_S).
  static std::atomic<SendLedger*> ledger{nullptr};
  return PublishOnce(ledger, [] { return new SendLedger(); });
}

SendLedger::SendLedger() : impl_(new Impl()) {
  // The process's one ledger (Get), never destroyed.
  AtForkForever(ForkLevel::kSendReleases,
                ForkHandlers{[](void* impl) { static_cast<Impl*>(impl)->GateForFork(); },
                             [](void* impl) { static_cast<Impl*>(impl)->UngateInParent(); },
                             [](void* impl) { static_cast<Impl*>(impl)->UngateInChild(); },
                             impl_});
  AtForkForever(ForkLevel::kSendLedger,
                ForkHandlers{[](void* impl) { static_cast<Impl*>(impl)->LockForFork(); },
                             [](void* impl) { static_cast<Impl*>(impl)->UnlockInParent(); },
                             [](void* impl) { static_cast<Impl*>(impl)->ForgetParentInChild(); },
                             impl_});
}

absl::StatusOr<SendLedger::Ticket> SendLedger::Hold(uint64_t bytes, Release release,
                                                     Settle settle) {
  VMM_ASSIGN_OR_RETURN(FdToken ticket, FdServer::Get().Address());
  ticket.kind = FdToken::Kind::kSendHold;
  fd_share_internal::RandomBytes(ticket.nonce.data(), ticket.nonce.size());
  if (impl_->Add(bytes, ticket.nonce, std::move(release), std::move(settle), ThreadToken(),
                 &ticket.key)) {
    FdServer::Get().WakeForLedger();
  }
  return ticket.Encode();
}

absl::Status SendLedger::Ack(uint64_t key, const std::array<uint8_t, 16>& nonce,
                             RunOn run_on) {
  return Report(key, nonce, SendReport::kImported, run_on);
}

absl::Status SendLedger::Withdraw(uint64_t key, const std::array<uint8_t, 16>& nonce) {
  std::vector<Release> work;
  absl::Status status = impl_->TakeWithdrawal(key, nonce, &work);
  RunWithdrawals(std::move(work));
  return status;
}

int64_t SendLedger::ThreadToken() {
  // From 1; a thread's first call takes the next (a Linux thread id comes round again once
  // its thread has ended: a later thread's sends must not count as an ended feeder's).
  static std::atomic<int64_t> next{1};
  thread_local const int64_t token = next.fetch_add(1, std::memory_order_relaxed);
  return token;
}

size_t SendLedger::WithdrawMadeBy(int64_t thread_token) {
  std::vector<Release> work;
  const size_t withdrawn = impl_->TakeWithdrawalsMadeBy(thread_token, &work);
  RunWithdrawals(std::move(work));
  return withdrawn;
}

size_t SendLedger::HeldNotMadeBy(absl::Span<const int64_t> thread_tokens) {
  return impl_->CountHeldNotMadeBy(thread_tokens);
}

void SendLedger::RunWithdrawals(std::vector<absl::AnyInvocable<void() &&>> work) {
  if (work.empty()) return;
  // While a graph is captured the release thread runs them afterwards (capture_window.h).
  if (CaptureWindowOpen()) {
    impl_->Enqueue(std::move(work));
  } else {
    impl_->Run(work);
  }
}

absl::Status SendLedger::Report(uint64_t key, const std::array<uint8_t, 16>& nonce,
                                SendReport report, RunOn run_on) {
  std::vector<Release> work;
  const bool found = impl_->TakeReport(key, nonce, report, &work);
  if (!work.empty()) {  // also for a NotFound duplicate ack, which settles the hold
    // While a graph is captured the release thread runs it afterwards (capture_window.h).
    if (run_on == RunOn::kReleaseThread || CaptureWindowOpen()) {
      impl_->Enqueue(std::move(work));
    } else {
      impl_->Run(work);
    }
  }
  if (!found) return absl::NotFoundError(absl::StrCat("no such hold: ", key));
  return absl::OkStatus();
}

size_t SendLedger::ExpireDue(RunOn run_on) {
  std::vector<Release> releases = impl_->TakeExpired();
  const size_t n = releases.size();
  if (n == 0) return 0;
  if (run_on == RunOn::kReleaseThread || CaptureWindowOpen()) {
    impl_->Enqueue(std::move(releases));
  } else {
    impl_->Run(releases);
  }
  return n;
}

absl::Time SendLedger::NextDeadline() { return impl_->NextDeadline(); }

uint64_t SendLedger::Progress() { return impl_->Progress(); }
uint64_t SendLedger::RecentHeldBytes(absl::Duration window) {
  return impl_->RecentHeldBytes(window);
}
bool SendLedger::WaitForProgress(uint64_t since, absl::Duration timeout) {
  return impl_->WaitForProgress(since, timeout);
}

void SendLedger::SetLease(absl::Duration lease) {
  if (lease <= absl::ZeroDuration()) {
    LogWarning(absl::StrCat("SendLedger::SetLease(", absl::FormatDuration(lease),
                            "): a lease must be positive; keeping ",
                            absl::FormatDuration(impl_->lease())));
    return;
  }
  impl_->SetLease(lease);
}

absl::Duration SendLedger::lease() { return impl_->lease(); }

size_t SendLedger::WaitUntilEmpty(absl::Duration timeout) {
  return impl_->WaitUntilEmpty(timeout);
}

SendLedger::Stats SendLedger::GetStats() { return impl_->GetStats(); }

// --- The receiver's half ------------------------------------------------------------------

namespace {

// The ticket `index` decoded, or InvalidArgument saying why it is none.
absl::StatusOr<FdToken> DecodeTicket(absl::Span<const uint8_t> bytes, size_t index) {
  absl::StatusOr<FdToken> token = FdToken::Decode(bytes);
  if (!token.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ticket ", index, " is not a send ticket: ", token.status().message()));
  }
  if (token->kind != FdToken::Kind::kSendHold) {
    return absl::InvalidArgumentError(
        absl::StrCat("ticket ", index, " is an fd token, not a send ticket"));
  }
  if (token->boot_hash != BootHash()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ticket ", index, " comes from another machine: sends are acknowledged only on the "
        "machine that made them"));
  }
  return *token;
}

absl::Status NotHeld(size_t index, uint32_t pid) {
  return absl::NotFoundError(absl::StrCat(
      "process ", pid, " holds nothing for ticket ", index,
      " (it was already acknowledged, or its lease ended)"));
}

// Reports the tickets `indices` of `tokens`, all of one exporter, into `statuses`.
void AckOneExporter(absl::Span<const FdToken> tokens, const std::vector<size_t>& indices,
                    SendReport report, std::vector<absl::Status>* statuses) {
  const FdToken& first = tokens[indices[0]];
  if (first.pid == static_cast<uint32_t>(getpid())) {  // this process's own: no socket
    for (size_t i : indices) {
      if (!SendLedger::Get().Report(tokens[i].key, tokens[i].nonce, report).ok()) {
        (*statuses)[i] = NotHeld(i, tokens[i].pid);
      }
    }
    return;
  }
  std::vector<fd_share_internal::FdRequestEntry> entries;
  entries.reserve(indices.size());
  for (size_t i : indices) entries.push_back({tokens[i].key, tokens[i].nonce});
  absl::StatusOr<std::vector<bool>> acknowledged =
      fd_share_internal::AckBySocket(first.pid, first.server_id, entries, kAckTimeout, report);
  for (size_t j = 0; j < indices.size(); ++j) {
    if (!acknowledged.ok()) {
      (*statuses)[indices[j]] = acknowledged.status();
    } else if (!(*acknowledged)[j]) {
      (*statuses)[indices[j]] = NotHeld(indices[j], first.pid);
    }
  }
}

}  // namespace

absl::Status AckSend(absl::Span<const uint8_t> ticket) {
  VMM_ASSIGN_OR_RETURN(FdToken token, DecodeTicket(ticket, 0));
  std::vector<absl::Status> statuses(1);
  AckOneExporter({token}, {0}, SendReport::kImported, &statuses);
  return statuses[0];
}

absl::Status CancelSend(absl::Span<const uint8_t> ticket) {
  VMM_ASSIGN_OR_RETURN(FdToken token, DecodeTicket(ticket, 0));
  if (token.pid != static_cast<uint32_t>(getpid())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the ticket is a send of process ", token.pid, ", not of this one: only its sender may "
        "withdraw it"));
  }
  return SendLedger::Get().Withdraw(token.key, token.nonce);
}

absl::Status AckSends(absl::Span<const SendLedger::Ticket> tickets) {
  return ReportSends(tickets, SendReport::kImported);
}

absl::Status ReportSends(absl::Span<const SendLedger::Ticket> tickets, SendReport report) {
  std::vector<absl::Status> statuses(tickets.size());
  std::vector<FdToken> tokens(tickets.size());
  // The tickets of each exporter (pid, server id), exporters in order of first appearance.
  std::vector<std::vector<size_t>> exporters;
  absl::flat_hash_map<std::pair<uint32_t, uint64_t>, size_t> exporter_of;
  for (size_t i = 0; i < tickets.size(); ++i) {
    absl::StatusOr<FdToken> token = DecodeTicket(tickets[i], i);
    if (!token.ok()) {
      statuses[i] = token.status();
      continue;
    }
    tokens[i] = *token;
    auto [it, added] = exporter_of.try_emplace({token->pid, token->server_id}, exporters.size());
    if (added) exporters.emplace_back();
    exporters[it->second].push_back(i);
  }
  for (const std::vector<size_t>& indices : exporters) {
    AckOneExporter(tokens, indices, report, &statuses);
  }
  size_t failed = 0;
  const absl::Status* first = nullptr;
  for (const absl::Status& status : statuses) {
    if (status.ok()) continue;
    if (failed++ == 0) first = &status;
  }
  if (failed <= 1) return first == nullptr ? absl::OkStatus() : *first;
  return absl::Status(first->code(), absl::StrCat(failed, " of ", tickets.size(),
                                                  " tickets failed; the first: ",
                                                  first->message()));
}

}  // namespace vmm
