// Tests of vmm::Mutex (allocator/mutex.h): mutual exclusion under contention, including the
// path where waiters sleep in the kernel and are woken by Unlock (or by their retry timeout).
#include "allocator/mutex.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

// Whether TryLock fails while the lock is held and succeeds once it is free. (Locks taken
// and released on purpose in ways the static analysis cannot follow, hence its opt-out.)
void CheckTryLock(Mutex& mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  mu.Lock();
  EXPECT_FALSE(mu.TryLock());
  mu.Unlock();
  EXPECT_TRUE(mu.TryLock());
  mu.Unlock();
}

TEST(MutexTest, TryLockFailsWhileHeld) {
  Mutex mu;
  CheckTryLock(mu);
}

// Many threads increment a plain counter under the lock; every increment must survive. Short
// critical sections exercise the spinning path.
TEST(MutexTest, CountsEveryIncrementUnderContention) {
  Mutex mu;
  int64_t counter = 0;
  constexpr int kThreads = 8;
  constexpr int kIncrements = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kIncrements; ++i) {
        MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, int64_t{kThreads} * kIncrements);
}

// The holder keeps the lock long enough for the others to stop spinning and sleep; each must
// be woken and get the lock, and no two may hold it at once.
TEST(MutexTest, SleepersAreWokenAndExclusive) {
  Mutex mu;
  std::atomic<int> inside{0};
  std::atomic<int> max_inside{0};
  int64_t rounds = 0;
  constexpr int kThreads = 6;
  constexpr int kRounds = 40;
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        MutexLock lock(&mu);
        const int now = inside.fetch_add(1) + 1;
        int seen = max_inside.load();
        while (now > seen && !max_inside.compare_exchange_weak(seen, now)) {
        }
        ++rounds;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        inside.fetch_sub(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(rounds, int64_t{kThreads} * kRounds);
  EXPECT_EQ(max_inside.load(), 1);
  // 240 sections of 0.2 ms take about 50 ms (more under sanitizers); lost wake-ups would cost
  // a retry timeout each. Generous bound: the point is that nobody waits forever.
  EXPECT_LT(seconds, 20.0);
}

}  // namespace
}  // namespace vmm
