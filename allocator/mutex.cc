#include "allocator/mutex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace vmm {
namespace {

// Sleeps while *word == value, for at most `timeout`.
void FutexWait(std::atomic<int>* word, int value, const timespec& timeout) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, value, &timeout, nullptr,
          0);
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
  // Announce a sleeper (Unlock then wakes one), and sleep until the lock is free. The timeout
  // bounds the wait should a wake-up be missed (see mutex.h).
  constexpr timespec kRetry = {0, 1000 * 1000};
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  while (state_.exchange(kLocked, std::memory_order_acquire) != kUnlocked) {
    FutexWait(&state_, kLocked, kRetry);
  }
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
}

void Mutex::WakeOne() { FutexWake(&state_, 1); }

}  // namespace vmm
