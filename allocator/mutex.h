// mutex.h: the lock vmm uses, annotated for clang's -Wthread-safety analysis.
//
// vmm::Mutex is a small futex-based lock with Abseil's capability annotations, so members can
// be marked ABSL_GUARDED_BY(mu_) and helpers ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_), and clang
// checks them. An uncontended Lock is one compare-and-swap and Unlock one plain store, with
// no system call (the pool's cached path takes the lock twice per allocate/free pair, and an
// atomic read-modify-write costs 15-30 cycles, so this matters). A contended Lock spins
// briefly, then sleeps in the kernel (futex); Unlock wakes a sleeper when it sees one. Because
// Unlock's store and its look at the sleeper count are not ordered against each other (that
// would take a fence, as costly as the exchange it saves), a wake-up can in principle be
// missed when a thread goes to sleep at that very moment: sleepers therefore also wake by
// themselves every millisecond and retry, so a missed wake-up costs latency, never progress.
// It is built on std::atomic with acquire/release order, which ThreadSanitizer understands; absl::Mutex is not used because the prebuilt Abseil libraries on the build
// machine are not instrumented, and TSan would report races through it that are not there.
//
//   vmm::Mutex mu;
//   int counter ABSL_GUARDED_BY(mu);
//   { vmm::MutexLock lock(&mu); ++counter; }
#ifndef VMM_ALLOCATOR_MUTEX_H_
#define VMM_ALLOCATOR_MUTEX_H_

#include <atomic>

#include "absl/base/thread_annotations.h"

namespace vmm {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    int expected = kUnlocked;
    if (!state_.compare_exchange_strong(expected, kLocked, std::memory_order_acquire)) {
      LockSlow();
    }
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    state_.store(kUnlocked, std::memory_order_release);
    if (sleepers_.load(std::memory_order_relaxed) != 0) WakeOne();
  }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) {
    int expected = kUnlocked;
    return state_.compare_exchange_strong(expected, kLocked, std::memory_order_acquire);
  }
  // Tells the analysis that the caller holds the lock (no run-time check).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

  // In a fork() child only, on a lock the forking thread took before the fork (a
  // pthread_atfork prepare handler: fork_guard.h): releases it, and forgets the parent's
  // threads that were waiting for it (none of them exists here), so that later unlocks do not
  // make a system call to wake them.
  void UnlockInForkChild() ABSL_UNLOCK_FUNCTION() {
    sleepers_.store(0, std::memory_order_relaxed);
    state_.store(kUnlocked, std::memory_order_release);
  }

  // BasicLockable, for std::condition_variable_any.
  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { Lock(); }
  void unlock() ABSL_UNLOCK_FUNCTION() { Unlock(); }

 private:
  static constexpr int kUnlocked = 0;
  static constexpr int kLocked = 1;

  void LockSlow();
  void WakeOne();

  std::atomic<int> state_{kUnlocked};
  std::atomic<int> sleepers_{0};  // threads in LockSlow's sleeping phase
};

// MutexLock holds a Mutex for the lifetime of the object.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_MUTEX_H_
