#include "allocator/capture_window.h"

#include <atomic>
#include <condition_variable>
#include <mutex>

namespace vmm {
namespace {

struct Window {
  std::mutex mu;
  std::condition_variable changed;
  int open = 0;  // windows open (guarded by mu; mirrored in open_now for lock-free reads)
  int busy = 0;  // pieces of background work running
  std::atomic<bool> open_now{false};
};

// Never destroyed: background threads may use it during exit.
Window& TheWindow() {
  static Window* window = new Window();
  return *window;
}

}  // namespace

void OpenCaptureWindow() {
  Window& w = TheWindow();
  std::unique_lock<std::mutex> lock(w.mu);
  ++w.open;
  w.open_now.store(true, std::memory_order_relaxed);
  w.changed.wait(lock, [&] { return w.busy == 0; });
}

void CloseCaptureWindow() {
  Window& w = TheWindow();
  std::lock_guard<std::mutex> lock(w.mu);
  if (w.open > 0) --w.open;
  w.open_now.store(w.open > 0, std::memory_order_relaxed);
  w.changed.notify_all();
}

bool CaptureWindowOpen() { return TheWindow().open_now.load(std::memory_order_relaxed); }

void EnterBackgroundWork() {
  Window& w = TheWindow();
  std::unique_lock<std::mutex> lock(w.mu);
  w.changed.wait(lock, [&] { return w.open == 0; });
  ++w.busy;
}

void LeaveBackgroundWork() {
  Window& w = TheWindow();
  std::lock_guard<std::mutex> lock(w.mu);
  --w.busy;
  w.changed.notify_all();
}

}  // namespace vmm
