#include "allocator/capture_window.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

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
  std::atomic<int64_t> opened_at{0};  // Clock ticks when the first open window opened
  std::vector<std::function<void()>> after;  // RunOutsideCapture's work kept (guarded by mu)
};

int64_t Now() { return Clock::now().time_since_epoch().count(); }

// Whether the windows open now opened longer than kStaleAfter ago (guarded by w.mu or not:
// a hint either way).
bool Stale(const Window& w) {
  const auto age = Clock::duration(Now() - w.opened_at.load(std::memory_order_relaxed));
  return age > kStaleAfter;
}

// Never destroyed: background threads may use it during exit.
Window& TheWindow() {
  static Window* window = new Window();
  return *window;
}

}  // namespace

void OpenCaptureWindow() {
  Window& w = TheWindow();
  std::unique_lock<std::mutex> lock(w.mu);
  if (w.open++ == 0) w.opened_at.store(Now(), std::memory_order_relaxed);
  w.open_now.store(true, std::memory_order_relaxed);
  w.changed.wait(lock, [&] { return w.busy == 0; });
}

namespace {

// Runs `work` as background work the caller entered, then leaves it.
void RunEntered(std::vector<std::function<void()>>& work) {
  for (std::function<void()>& f : work) f();
  work.clear();
  LeaveBackgroundWork();
}

}  // namespace

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
  while (w.open > 0 && !Stale(w)) {
    w.changed.wait_for(lock, kStaleAfter);
  }
  if (w.open > 0) {
    LogWarningOnce("capture-window",
                   "a capture window has been open for over a minute (a capture that failed "
                   "before it ended its allocator route, or a long MemPool context); vmm's "
                   "background work and stream events go on");
  }
  ++w.busy;
}

bool TryEnterBackgroundWork() {
  Window& w = TheWindow();
  std::lock_guard<std::mutex> lock(w.mu);
  if (w.open > 0 && !Stale(w)) return false;
  ++w.busy;
  return true;
}

void LeaveBackgroundWork() {
  Window& w = TheWindow();
  std::lock_guard<std::mutex> lock(w.mu);
  --w.busy;
  w.changed.notify_all();
}

}  // namespace vmm
