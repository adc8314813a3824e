#include "allocator/send_acker.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "allocator/mutex.h"

namespace vmm {
namespace {

// The queue and its thread. One per process: a forked child makes a new one (the parent's
// thread does not exist there and its lock may have been held at the fork), leaking the copy.
class Acker {
 public:
  static Acker& ForThisProcess() {
    static const int registered =
        pthread_atfork(nullptr, nullptr, [] { current.store(nullptr); });
    (void)registered;
    Acker* acker = current.load(std::memory_order_acquire);
    if (acker == nullptr) {
      auto* fresh = new Acker();  // never destroyed: acks may be queued during exit
      if (current.compare_exchange_strong(acker, fresh, std::memory_order_acq_rel)) {
        acker = fresh;
      } else {
        delete fresh;
      }
    }
    return *acker;
  }

  void Add(const SendLedger::Ticket& ticket, SendReport report) {
    MutexLock lock(&mu_);
    queued_.push_back({ticket, report});
    if (!started_) {
      started_ = true;
      std::thread([this] { Run(); }).detach();
    }
    wake_.notify_one();
  }

  size_t Flush(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (pending() != 0) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      drained_.wait_for(mu_, absl::ToChronoMilliseconds(left) + std::chrono::milliseconds(1));
    }
    return pending();
  }

 private:
  size_t pending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queued_.size() + sending_; }

  struct Queued {
    SendLedger::Ticket ticket;
    SendReport report;
  };

  void Run() {
    std::vector<Queued> batch;
    std::vector<SendLedger::Ticket> tickets;
    for (;;) {
      {
        MutexLock lock(&mu_);
        sending_ = 0;
        drained_.notify_all();
        while (queued_.empty()) wake_.wait(mu_);
        batch.swap(queued_);
        sending_ = batch.size();
      }
      // One request kind at a time, acks first. A sender gone or a send expired is no error
      // for the receiver: nothing to report.
      for (SendReport report :
           {SendReport::kImported, SendReport::kReleased, SendReport::kForwarded}) {
        tickets.clear();
        for (const Queued& q : batch) {
          if (q.report == report) tickets.push_back(q.ticket);
        }
        if (!tickets.empty()) (void)ReportSends(tickets, report);
      }
      batch.clear();
    }
  }

  static std::atomic<Acker*> current;  // this process's; reset in a forked child

  Mutex mu_;
  std::vector<Queued> queued_ ABSL_GUARDED_BY(mu_);
  size_t sending_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable_any wake_;
  std::condition_variable_any drained_;
};

std::atomic<Acker*> Acker::current{nullptr};

}  // namespace

void AckSendLater(const SendLedger::Ticket& ticket) {
  Acker::ForThisProcess().Add(ticket, SendReport::kImported);
}

void ReportSendLater(const SendLedger::Ticket& ticket, SendReport report) {
  Acker::ForThisProcess().Add(ticket, report);
}

size_t FlushAcks(absl::Duration timeout) { return Acker::ForThisProcess().Flush(timeout); }

}  // namespace vmm
