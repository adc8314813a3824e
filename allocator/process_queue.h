// process_queue.h: work that one background thread per process does in batches, in order.
//
//   void SendAll(std::vector<Ticket>& batch);                    // the work, no lock held
//   ProcessQueue<Ticket, SendAll>::ForThisProcess().Add(ticket); // returns at once
//   ProcessQueue<Ticket, SendAll>::ForThisProcess().Flush(absl::Seconds(5));
//
// The send acknowledgements (send_acker.h) and the closing of imports (import_closer.h) are
// such work: what a receiver of many small tensors should not do on its own thread.
//
// Each instantiation has one queue per process and one thread, started with the first item. A
// fork()ed child starts with a new, empty queue and no thread: the parent's thread does not
// exist there and its lock may have been held at the fork, so the copy (and what it holds) is
// leaked, never drained. With `kForkWaits`, fork() waits for a batch being drained to finish
// (a gate held across fork(): fork_guard.h, ForkLevel::kImportCloses, before every lock the
// drain takes), so that the child never inherits half a batch (closing an import holds the
// driver's lock); the drain must then never fork. If the thread cannot be started,
// items are drained by the caller of Add (said once, naming the work). Hold() pauses the
// thread (once the batch it drains is done) until as many Release() calls: items queued
// meanwhile wait (the closing of imports pauses while a CUDA graph is captured). Thread safe.
#ifndef VMM_ALLOCATOR_PROCESS_QUEUE_H_
#define VMM_ALLOCATOR_PROCESS_QUEUE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "allocator/fork_guard.h"
#include "allocator/log.h"
#include "allocator/mutex.h"

namespace vmm {

template <typename Item, void (*kDrain)(std::vector<Item>& batch), bool kForkWaits = false>
class ProcessQueue {
 public:
  // This process's queue (made on first use; never destroyed: items may come during exit).
  static ProcessQueue& ForThisProcess() {
    static const bool registered = [] {
      AtForkForever(ForkLevel::kImportCloses,
                    ForkHandlers{&GateForFork, &UngateInParent, &ForgetInChild, nullptr});
      return true;
    }();
    (void)registered;
    ProcessQueue* queue = current.load(std::memory_order_acquire);
    if (queue == nullptr) {
      auto* fresh = new ProcessQueue();
      if (current.compare_exchange_strong(queue, fresh, std::memory_order_acq_rel)) {
        queue = fresh;
      } else {
        delete fresh;
      }
    }
    return *queue;
  }

  // Queues `item` (starting the thread on first use); `what` names the work if the thread
  // cannot be started.
  void Add(Item item, const char* what) {
    std::vector<Item> here;  // drained by this caller when there is no thread
    {
      MutexLock lock(&mu_);
      if (!no_thread_) {
        queued_.push_back(std::move(item));
        if (started_) {
          wake_.notify_one();
          return;
        }
        started_ = true;
        try {
          std::thread([this] { Run(); }).detach();  // lives as long as the process
          return;
        } catch (const std::system_error& e) {
          no_thread_ = true;
          here.swap(queued_);
          LogWarningOnce(what, absl::StrCat("cannot start the thread for ", what, " (",
                                            e.what(), "); done by the caller instead"));
        }
      } else {
        here.push_back(std::move(item));
      }
    }
    kDrain(here);
  }

  // Pauses the thread: returns once no batch is being drained, and none starts until the
  // matching Release(). Holds nest. Items added meanwhile are queued (or, with no thread,
  // drained by the caller of Add as always).
  void Hold() {
    MutexLock lock(&mu_);
    ++holds_;
    while (draining_ != 0) drained_.wait(mu_);
  }
  // Ends one Hold(); the thread resumes once none is left.
  void Release() {
    MutexLock lock(&mu_);
    if (holds_ > 0 && --holds_ == 0) wake_.notify_one();
  }

  // Waits until every item queued so far has been drained, at most `timeout`; returns how
  // many are still queued or being drained (a held queue drains nothing meanwhile).
  size_t Flush(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (Pending() != 0) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      drained_.wait_for(mu_, absl::ToChronoMilliseconds(left) + std::chrono::milliseconds(1));
    }
    return Pending();
  }

 private:
  ProcessQueue() = default;

  // The fork handlers' ends of the gate (only the forking thread runs them): held from the
  // prepare handler to the parent's or the child's.
  static void GateForFork(void*) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ProcessQueue* q = current.load(std::memory_order_acquire);
    if (kForkWaits && q != nullptr) {
      q->gate_.Lock();
      q->gated_ = true;
    }
  }
  static void UngateInParent(void*) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ProcessQueue* q = current.load(std::memory_order_acquire);
    if (q != nullptr && q->gated_) {
      q->gated_ = false;
      q->gate_.Unlock();
    }
  }
  // The child starts with no queue: the parent's (its lock, its thread's work) is left as it
  // was.
  static void ForgetInChild(void* arg) {
    UngateInParent(arg);
    current.store(nullptr);
  }

  size_t Pending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queued_.size() + draining_; }

  void Run() {
    std::vector<Item> batch;
    for (;;) {
      {
        MutexLock lock(&mu_);
        draining_ = 0;
        drained_.notify_all();
        while (queued_.empty() || holds_ > 0) wake_.wait(mu_);  // unlocks mu_ while waiting
        batch.swap(queued_);
        draining_ = batch.size();
      }
      {
        MutexLock gate(&gate_);  // what a fork waits for (kForkWaits)
        kDrain(batch);           // no lock of the queue held
        batch.clear();
      }
    }
  }

  static inline std::atomic<ProcessQueue*> current{nullptr};  // reset in a forked child

  Mutex gate_;          // held while a batch is drained, and across a fork (kForkWaits)
  bool gated_ = false;  // the prepare handler took gate_ (fork handlers only)
  Mutex mu_;
  std::vector<Item> queued_ ABSL_GUARDED_BY(mu_);
  size_t draining_ ABSL_GUARDED_BY(mu_) = 0;
  int holds_ ABSL_GUARDED_BY(mu_) = 0;  // Hold() calls not yet released
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool no_thread_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable_any wake_;
  std::condition_variable_any drained_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_PROCESS_QUEUE_H_
