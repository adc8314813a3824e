// send_ledger.h: keeping memory that was sent to another process valid until the receiver has
// imported it.
//
// A sender may drop what it sent at once (`queue.put(t); del t`), before the receiver has
// imported it. So the sender registers a *hold* with the process's SendLedger, whose release
// callback drops what keeps the memory alive, and puts the hold's 64-byte *ticket* in the
// payload. Once the receiver has imported the memory it acknowledges the ticket (AckSend): one
// message to the exporter's fd server (fd_share.h), which acknowledges the hold here and runs
// its release. A receiver that never acknowledges (it died, or never read the payload) does
// not pin the memory for the sender's whole life: each hold ends after a *lease* (600 s, or
// VMM_SEND_LEASE_S seconds, read once, a malformed value warned about once and ignored;
// SetLease changes it), and its release runs then.
//
// Failures: Hold fails only when the fd server cannot start; an ack that cannot be delivered
// (AckSend's errors, below) leaves the hold to its lease, so memory is never released early
// and never held past the lease.
//
// Reusing what was sent. A hold may also have a *settle* callback: then the hold stays after
// the ack until the receiver reports that it has unmapped the memory (SendReport::kReleased,
// settle(true)) or that it cannot tell (kForwarded: it sent the memory on; settle(false)), or
// the lease ends, or kReportWait (30 s) after the ack, whichever is sooner (settle(false)).
// The pool uses it to reuse the chunks of a send only once no receiver maps them (pool.h,
// "Reusing exported chunks"). A release report that comes before the ack counts as both; a
// second ack of one ticket (its payload imported twice) settles it as not released, since
// its importers are no longer counted. Settles run like releases (exactly once, never in a
// forked child).
//
// A ticket is an FdToken (fd_share.h) of kind kSendHold: the exporter's pid, boot hash and fd
// server id address its socket as for fds, and its key and random 16-byte nonce name the hold
// in this ledger, a registry apart from the server's fds. Ack requests look keys up only here
// and fetches only among the fds, and each client refuses a token of the other kind, so a
// ticket never fetches an fd and an fd token never acknowledges a hold.
//
// Each release runs exactly once, with no lock of the ledger (or of the fd server) held. Those
// the fd server ends (acks from other processes, leases) run on the ledger's release thread,
// in the order they ended: a release may be slow (freeing a pool block can release chunks to
// the driver; closing an import synchronizes the device) without delaying the server's other
// clients, and an ack is answered once its hold is ended, before its release has run. Those
// ended by Ack, AckSend of a ticket of this process and ExpireDue called directly run on the
// caller's thread, before the call returns. A release must not throw; it may call the fd
// server and the ledger (register or unregister fds, make holds). The release thread starts
// with the first release queued and lives as long as the process; if it cannot be started,
// queued releases run on the server's thread (said once). A fork()ed child starts with an
// empty ledger and no release thread: it never runs (nor destroys) its parent's releases,
// queued or not; the parent's holds stay the parent's, and the child's thread starts fresh.
#ifndef VMM_ALLOCATOR_SEND_LEDGER_H_
#define VMM_ALLOCATOR_SEND_LEDGER_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "allocator/fd_share.h"

namespace vmm {

// The process's holds on memory it sent (see file comment). Thread safe.
class SendLedger {
 public:
  static SendLedger& Get();  // process-wide, never destroyed

  using Ticket = std::array<uint8_t, 64>;

  // Registers a hold of `bytes` whose `release` runs exactly once, without any ledger lock
  // held: when the receiver acks the ticket, when the lease ends, or never in a forked child
  // (a child drops its parent's holds without running them); then `settle`, if given, once
  // (file comment). Starts the fd server if needed. Errors: those of starting the server
  // (the failed system call's).
  absl::StatusOr<Ticket> Hold(uint64_t bytes, absl::AnyInvocable<void() &&> release,
                              absl::AnyInvocable<void(bool released) &&> settle = nullptr);

  // Where the release of a hold that Ack or ExpireDue ends runs.
  enum class RunOn {
    kCaller,         // this thread, before the call returns
    kReleaseThread,  // queued for the release thread (the fd server's calls)
  };

  // Server side: the hold (key, nonce) was acknowledged; ends it and runs its release as
  // `run_on` says. NotFound if no such hold (stale, already acked or expired, or a forged
  // nonce: which is not said).
  absl::Status Ack(uint64_t key, const std::array<uint8_t, 16>& nonce,
                   RunOn run_on = RunOn::kCaller);
  // The sender's withdrawal of the unacknowledged hold (key, nonce) whose payload never left
  // (CancelSend): its release runs here, its settle as released. NotFound if no such hold;
  // FailedPrecondition, leaving it as it is, if it was acknowledged.
  absl::Status Withdraw(uint64_t key, const std::array<uint8_t, 16>& nonce);
  // The calling thread's token: a number no other thread of this process has had or will
  // have (unlike a Linux thread id, which comes round again), from 1; Hold records the
  // caller's.
  static int64_t ThreadToken();
  // Ends every unacknowledged hold that the thread with `thread_token` made: a queue's
  // feeder thread whose data the program gave up at exit (vmm_send_withdraw_token). Their
  // releases run here; they settle as not released, since their payloads may have left (a
  // fabric handle still imports while this process lives), so their chunks are never reused.
  // Returns how many; acknowledged holds are left as they are.
  size_t WithdrawMadeBy(int64_t thread_token);
  // How many unacknowledged holds no thread of `thread_tokens` made, counted in one step:
  // what the exit wait waits for, leaving out cancelled queues' feeders
  // (vmm_send_held_except).
  size_t HeldNotMadeBy(absl::Span<const int64_t> thread_tokens);
  // Server side: the receiver's `report` on the hold (key, nonce) (kImported is Ack). NotFound
  // if no such hold, or, for kImported, if it was acknowledged already.
  absl::Status Report(uint64_t key, const std::array<uint8_t, 16>& nonce, SendReport report,
                      RunOn run_on = RunOn::kCaller);

  // Ends the holds whose lease has ended and runs their releases as `run_on` says; returns
  // how many. The fd server's loop calls it (kReleaseThread) at least once a second while
  // holds exist.
  size_t ExpireDue(RunOn run_on = RunOn::kCaller);

  // The soonest lease end, or absl::InfiniteFuture() with no holds.
  absl::Time NextDeadline();

  // The lease of holds made from now on. A lease that is not positive is refused (a warning,
  // and the lease stays as it was).
  void SetLease(absl::Duration lease);
  absl::Duration lease();

  // A count that grows each time a recent hold (RecentHeldBytes) is acknowledged, at the ack,
  // and each time releases or settles have run (what senders waiting for memory to come back
  // watch), and a wait until it passes `since` or `timeout` ends; true if it did.
  uint64_t Progress();
  bool WaitForProgress(uint64_t since, absl::Duration timeout);
  // Bytes of the holds not yet acknowledged that were made within the last `window` (what a
  // send budget counts: older ones wait on receivers that are not reading).
  uint64_t RecentHeldBytes(absl::Duration window);

  // Waits until no hold is unacknowledged (every release and settle, queued ones included,
  // has returned; sends acked but still mapped by their receivers are not waited for) or
  // `timeout` passes; returns the holds left (held, queued or running).
  size_t WaitUntilEmpty(absl::Duration timeout);

  struct Stats {
    uint64_t held = 0, held_bytes = 0, peak_held_bytes = 0;  // now / peak (unacknowledged)
    uint64_t awaiting_release = 0;  // now: acked, the receiver still maps them (with settle)
    uint64_t holds = 0, acked = 0, expired = 0;              // totals
    uint64_t released = 0;  // total: receivers reported they unmapped the memory
  };
  Stats GetStats();

  SendLedger(const SendLedger&) = delete;
  SendLedger& operator=(const SendLedger&) = delete;

 private:
  SendLedger();
  // Runs the releases of withdrawn holds here, or on the release thread while a capture
  // window is open.
  void RunWithdrawals(std::vector<absl::AnyInvocable<void() &&>> work);
  class Impl;
  Impl* const impl_;
};

// The receiver's half: acknowledges `ticket` to the exporter named in it (connects to its fd
// server socket, one request, waits for the reply, at most about 2 s; a ticket of this very
// process is acknowledged without the socket). InvalidArgument if the bytes are not a ticket
// (an fd token is not one) or come from another machine (boot hash); Unavailable if the
// exporter is gone; NotFound if the exporter does not know the hold (already acked or
// expired); DeadlineExceeded if it does not answer in time; PermissionDenied if it runs as
// another user and refused.
absl::Status AckSend(absl::Span<const uint8_t> ticket);

// Acknowledges many tickets (possibly of several exporters) with one connection per exporter
// (one request per 250 tickets). Every ticket is tried; OK when all were acknowledged, else
// the error (as AckSend's) of the first ticket that failed, saying how many failed.
absl::Status AckSends(absl::Span<const SendLedger::Ticket> tickets);

// The sender's withdrawal of one of its own sends whose payload never left the process (the
// message that held it failed to pickle, so no receiver can have it): the hold ends at once,
// its chunks reusable as if its receiver had imported and unmapped the memory.
// FailedPrecondition for another process's ticket (only the sender knows that its payload
// went nowhere) or for a send already acknowledged (a receiver has it: the hold is left to its
// receiver's report); NotFound if the hold is gone (expired, released or withdrawn already);
// InvalidArgument as AckSend's.
absl::Status CancelSend(absl::Span<const uint8_t> ticket);

// AckSends for any report (SendReport, fd_share.h): kImported acknowledges, kReleased and
// kForwarded tell the sender its receiver has unmapped the memory (SendLedger, "Reusing what
// was sent"). Errors as AckSends'.
absl::Status ReportSends(absl::Span<const SendLedger::Ticket> tickets, SendReport report);

namespace send_ledger_internal {

// The default lease, when VMM_SEND_LEASE_S is unset or malformed.
inline constexpr absl::Duration kDefaultLease = absl::Seconds(600);
// How long after its ack a hold with a settle waits for the receiver's release report (within
// its lease); then it settles as not released.
inline constexpr absl::Duration kReportWait = absl::Seconds(30);

// Reads a lease in seconds, as VMM_SEND_LEASE_S holds it ("600", "0.5"). InvalidArgument,
// naming the text, for anything but a positive finite number.
absl::StatusOr<absl::Duration> ParseLeaseSeconds(absl::string_view text);

}  // namespace send_ledger_internal
}  // namespace vmm

#endif  // VMM_ALLOCATOR_SEND_LEDGER_H_
