#include "allocator/mutex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace vmm {
namespace {

void FutexWait(std::atomic<int>* word, int value) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
}

void FutexWake(std::atomic<int>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

void Mutex::LockSlow() {
  // Critical sections are short: spin a little before sleeping.
  for (int i = 0; i < 64; ++i) {
    CpuRelax();
    int expected = kUnlocked;
    if (state_.load(std::memory_order_relaxed) == kUnlocked &&
        state_.compare_exchange_weak(expected, kLocked, std::memory_order_acquire)) {
      return;
    }
  }
  // Announce a sleeper; whoever unlocks then wakes one. Taking the lock here leaves it marked
  // contended, which costs at most one spare wake-up.
  while (state_.exchange(kContended, std::memory_order_acquire) != kUnlocked) {
    FutexWait(&state_, kContended);
  }
}

void Mutex::WakeOne() { FutexWake(&state_, 1); }

}  // namespace vmm
