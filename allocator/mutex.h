// mutex.h: the lock vmm uses, annotated for clang's -Wthread-safety analysis.
//
// vmm::Mutex is std::mutex with Abseil's capability annotations, so members can be marked
// ABSL_GUARDED_BY(mu_) and helpers ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_), and clang checks them.
// It wraps a pthread mutex (not absl::Mutex) because ThreadSanitizer understands pthread
// locks directly, while the prebuilt Abseil libraries on the build machine are not
// instrumented, and TSan would report races through absl::Mutex that are not there.
//
//   vmm::Mutex mu;
//   int counter ABSL_GUARDED_BY(mu);
//   { vmm::MutexLock lock(&mu); ++counter; }
#ifndef VMM_ALLOCATOR_MUTEX_H_
#define VMM_ALLOCATOR_MUTEX_H_

#include <mutex>

#include "absl/base/thread_annotations.h"

namespace vmm {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds the lock (no run-time check).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  std::mutex mu_;
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
