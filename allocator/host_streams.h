// host_streams.h: the host backend's streams and events (internal to host_driver.cc).
//
// A HostStream is a worker thread that runs queued work in FIFO order; a HostEvent is a
// generation counter that a marker queued on a stream advances, so that "the work queued
// before the event has completed" means what it means on CUDA. Both are thread safe; CondVar
// is a condition variable over vmm::Mutex for them.
#ifndef VMM_ALLOCATOR_HOST_STREAMS_H_
#define VMM_ALLOCATOR_HOST_STREAMS_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "allocator/mutex.h"

namespace vmm {
namespace host {

// A condition variable for vmm::Mutex: Wait() must be called with `mu` held, which the
// thread-safety analysis checks at the caller; callers loop on their condition.
class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    LockAdapter adapter{mu};
    cv_.wait(adapter);
  }
  void NotifyAll() { cv_.notify_all(); }

 private:
  // BasicLockable view of a held vmm::Mutex for std::condition_variable_any, which unlocks it
  // while waiting and locks it again before returning.
  struct LockAdapter {
    Mutex* mu;
    void lock() ABSL_NO_THREAD_SAFETY_ANALYSIS { mu->Lock(); }
    void unlock() ABSL_NO_THREAD_SAFETY_ANALYSIS { mu->Unlock(); }
  };
  std::condition_variable_any cv_;
};

// A worker thread that runs queued work in FIFO order.
class HostStream {
 public:
  HostStream() : worker_([this] { Run(); }) {}
  ~HostStream() {
    Stop();
    worker_.join();
  }
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Queues `work`; false once Stop() has begun.
  bool Enqueue(std::function<void()> work) {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(work));
    ++enqueued_;
    cv_.NotifyAll();
    return true;
  }

  // Waits until all work queued before the call has run.
  void Synchronize() {
    MutexLock lock(&mu_);
    const uint64_t target = enqueued_;
    while (completed_ < target) cv_.Wait(&mu_);
  }

  // Refuses new work, lets the queue drain and waits for the worker to finish. Idempotent.
  void Stop() {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.NotifyAll();
    while (!worker_done_) cv_.Wait(&mu_);
  }

 private:
  void Run() {
    MutexLock lock(&mu_);
    while (true) {
      while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
      if (queue_.empty()) break;  // stopping, and drained
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      mu_.Unlock();
      work();
      mu_.Lock();
      ++completed_;
      cv_.NotifyAll();
    }
    worker_done_ = true;
    cv_.NotifyAll();
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;   // work items ever queued
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;  // work items that have run
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;  // last: starts after the members above exist
};

// An event: each Record() starts a new generation, and the marker of that generation, when
// its stream reaches it, marks it reached. The event is done when the latest recorded
// generation has been reached (a never-recorded event is done, as in CUDA).
class HostEvent {
 public:
  uint64_t Record() {
    MutexLock lock(&mu_);
    return ++recorded_;
  }
  void Reach(uint64_t generation) {
    MutexLock lock(&mu_);
    reached_ = std::max(reached_, generation);
    cv_.NotifyAll();
  }
  bool Done() {
    MutexLock lock(&mu_);
    return reached_ >= recorded_;
  }
  void Wait() {
    MutexLock lock(&mu_);
    const uint64_t target = recorded_;
    while (reached_ < target) cv_.Wait(&mu_);
  }

 private:
  Mutex mu_;
  CondVar cv_;
  uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reached_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace host
}  // namespace vmm

#endif  // VMM_ALLOCATOR_HOST_STREAMS_H_
