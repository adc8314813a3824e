#include "allocator/capture_window.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/fork_guard.h"
#include "allocator/log.h"

namespace vmm {
namespace {

using Clock = std::chrono::steady_clock;

struct Window {
  std::mutex mu;
  std::condition_variable changed;
  int open = 0;  // windows open (guarded by mu; mirrored in open_now for lock-free reads)
  int busy = 0;  // pieces of background work running
  std::atomic<bool> open_now{false};
  std::atomic<int64_t> opened_at{0};  // Clock ticks when the newest open window opened
  std::atomic<int64_t> stale_after{Clock::duration(kStaleAfter).count()};  // Clock ticks
  std::vector<std::function<void()>> after;  // RunOutsideCapture's work kept (guarded by mu)
};

int64_t Now() { return Clock::now().time_since_epoch().count(); }

Clock::duration StaleAfter(const Window& w) {
  return Clock::duration(w.stale_after.load(std::memory_order_relaxed));
}

// Whether the newest window open now opened longer than the stale period ago (guarded by
// w.mu or not: a hint either way). A window left open (a capture that raised before it ended
// its route) so stops holding work back, but never a capture begun since.
bool Stale(const Window& w) {
  const auto age = Clock::duration(Now() - w.opened_at.load(std::memory_order_relaxed));
  return age > StaleAfter(w);
}

std::atomic<Window*> the_window{nullptr};

// Pieces of background work this thread holds. A window that opens meanwhile waits for them,
// so this thread's nested work may go on (an out-of-memory retry's growth that moves memory):
// refusing it would only skip work the window is waiting out anyway, and waiting for the
// window to close would never end.
thread_local int held_here = 0;

// A forked child has no capture and none of its parent's threads: a fresh window, the
// parent's left as it was (its lock may be held; its kept work is the parent's pools). So no
// lock is held across fork() here (unlike those of fork_guard.h): the child never takes the
// parent's. The forking thread's own pieces of work (held_here, if it forked from inside
// one) stay counted, so that leaving them balances.
void FreshWindowInChild() {
  auto* fresh = new Window();
  fresh->busy = held_here;
  the_window.store(fresh, std::memory_order_release);
}

// The child handler, registered when the library is loaded (before any fork()): registered
// at the first use instead, inside a function's static, a fork racing that first use would
// skip it (and an older glibc blocks fork() during pthread_atfork).
const bool fresh_window_in_child = [] {
  AtForkForever(ForkLevel::kLog,
                ForkHandlers{nullptr, nullptr, [](void*) { FreshWindowInChild(); }, nullptr});
  return true;
}();

// Never destroyed: background threads may use it during exit. Made at the first use,
// published through the_window (a fork never finds it half made).
Window& TheWindow() {
  (void)fresh_window_in_child;
  return PublishOnce(the_window, [] { return new Window(); });
}

// Leaves background work entered by the constructor's caller, at the end of a scope.
struct Leave {
  ~Leave() { LeaveBackgroundWork(); }
};

// Runs `work`, which the caller entered as background work, then leaves it. Work that throws
// is logged and the rest still runs: a kept piece runs inside CloseCaptureWindow, whose
// callers (the C interface) must not see an exception.
void RunEntered(std::vector<std::function<void()>>& work) {
  const Leave leave;
  for (std::function<void()>& f : work) {
    try {
      f();
    } catch (const std::exception& e) {
      LogError(absl::StrCat("work kept until after a capture failed: ", e.what()));
    } catch (...) {
      LogError("work kept until after a capture failed");
    }
  }
  work.clear();
}

}  // namespace

void OpenCaptureWindow() {
  Window& w = TheWindow();
  std::unique_lock<std::mutex> lock(w.mu);
  ++w.open;
  w.opened_at.store(Now(), std::memory_order_relaxed);
  w.open_now.store(true, std::memory_order_relaxed);
  w.changed.wait(lock, [&] { return w.busy == 0; });
}

void CloseCaptureWindow() {
  Window& w = TheWindow();
  std::vector<std::function<void()>> after;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.open > 0) --w.open;
    w.open_now.store(w.open > 0, std::memory_order_relaxed);
    w.changed.notify_all();
    if (w.open > 0 || w.after.empty()) return;
    after.swap(w.after);
    ++w.busy;  // a window that opens meanwhile waits for the kept work
    ++held_here;
  }
  RunEntered(after);
}

void RunOutsideCapture(std::function<void()> work) {
  Window& w = TheWindow();
  std::vector<std::function<void()>> now;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.open > 0 && !Stale(w)) {
      w.after.push_back(std::move(work));
      return;
    }
    now.swap(w.after);  // kept while a window that went stale was open
    now.push_back(std::move(work));
    ++w.busy;
    ++held_here;
  }
  RunEntered(now);
}

bool CaptureWindowOpen() {
  const Window& w = TheWindow();
  return w.open_now.load(std::memory_order_relaxed) && !Stale(w);
}

void EnterBackgroundWork() {
  Window& w = TheWindow();
  std::unique_lock<std::mutex> lock(w.mu);
  while (held_here == 0 && w.open > 0 && !Stale(w)) {
    w.changed.wait_for(lock, StaleAfter(w));
  }
  if (held_here == 0 && w.open > 0) {
    LogWarningOnce("capture-window",
                   "a capture window has been open for over a minute (a capture that failed "
                   "before it ended its allocator route, or a long MemPool context); vmm's "
                   "background work and stream events go on");
  }
  ++w.busy;
  ++held_here;
}

bool TryEnterBackgroundWork() {
  Window& w = TheWindow();
  std::lock_guard<std::mutex> lock(w.mu);
  if (held_here == 0 && w.open > 0 && !Stale(w)) return false;
  ++w.busy;
  ++held_here;
  return true;
}

void LeaveBackgroundWork() {
  Window& w = TheWindow();
  std::lock_guard<std::mutex> lock(w.mu);
  --w.busy;
  --held_here;
  w.changed.notify_all();
}

void SetStaleAfterForTesting(std::chrono::milliseconds period) {
  TheWindow().stale_after.store(Clock::duration(period).count(), std::memory_order_relaxed);
}

}  // namespace vmm
