// capture_window.h: whether the framework has a CUDA graph capture under way in this process,
// so that vmm's own work does not disturb it.
//
// PyTorch opens an allocator route (beginAllocateToPool) before a capture begins and closes it
// (endAllocateToPool) after the capture ends; it does the same around a MemPool's context. While
// any route is open the capture *window* is open. In CUDA's global capture mode (PyTorch's
// default) an event query or a synchronisation (of a stream or of the device) by any thread
// invalidates the capture, and an event recorded on the capturing stream by another thread joins
// its graph. The virtual memory calls themselves (create, map, set access, unmap, release) left
// captures valid on the H200's driver 580 (tests/gpu/capture_safe_calls.py), but what comes
// before an unmap here (a synchronisation, an event query) does not, and no driver documents
// them as safe during a capture, so vmm keeps its unmaps out of windows too. So while the window
// is open:
//   - vmm's background threads (the send ledger's release thread) wait before their next piece
//     of work (EnterBackgroundWork), and OpenCaptureWindow first waits for the piece running;
//   - pools neither record nor query stream events (stream_reclaim.h): frees that wait for
//     other streams keep waiting, and other streams' cached blocks keep their tags, as
//     PyTorch's own allocator defers its events while captures are under way (the event work
//     of a miss enters with WorkOutsideCapture, so a window waits for it to end);
//   - pools synchronise and unmap nothing: a miss moves no memory, neither a release
//     threshold nor a miss near a memory limit releases cached memory (the miss fails, as
//     PyTorch's does with captures under way), EmptyCache releases nothing, a large import
//     is closed on the closing thread, and a pool whose last use ends is destroyed after
//     the window (RunOutsideCapture). Each enters its work with WorkOutsideCapture, so a window
//     that opens meanwhile waits for it to end.
// Windows nest (several captures, on several threads or devices). Windows of which the newest
// opened longer than kStaleAfter ago (a capture that raised before it ended its route:
// PyTorch's capture_end checks cudaStreamEndCapture before it ends the route, and a MemPool
// context held that long) no longer hold anything back: background work and stream events go
// on, said once; a window that opens later holds them back again. A forked child starts with
// no window and no work (its parent's kept work is left to the parent). Thread safe.
#ifndef VMM_ALLOCATOR_CAPTURE_WINDOW_H_
#define VMM_ALLOCATOR_CAPTURE_WINDOW_H_

#include <chrono>
#include <functional>

namespace vmm {

inline constexpr std::chrono::seconds kStaleAfter{60};

// Opens a window; returns once no background work is running.
void OpenCaptureWindow();
// Closes one window; background work goes on once none is open.
void CloseCaptureWindow();
// Whether a window is open now (one relaxed atomic load).
bool CaptureWindowOpen();

// A piece of background work: waits while a window is open, and holds the next one from
// opening until LeaveBackgroundWork. Work nested in work this thread already holds enters at
// once: a window that began opening meanwhile is waiting for the outer piece anyway.
void EnterBackgroundWork();
// The same without waiting: false (and nothing entered) while a window is open, unless this
// thread holds work already (nested: true); true where none is, or the one open is stale, and
// then the next window waits for LeaveBackgroundWork.
bool TryEnterBackgroundWork();
void LeaveBackgroundWork();

// Runs `work` now, as background work, if no window is open (or the one open is stale);
// else keeps it and runs it on the thread whose CloseCaptureWindow closes the last window, as
// background work again, after that call has released the window's lock (or, for a window
// gone stale, at the next RunOutsideCapture). For teardown that synchronises or unmaps (a
// pool whose last use ends during a capture). `work` must not open a window; an exception it
// throws is logged and goes no further.
void RunOutsideCapture(std::function<void()> work);

// Tests: the stale period instead of kStaleAfter.
void SetStaleAfterForTesting(std::chrono::milliseconds period);

// A pool's piece of work that a capture must not overlap (moves, event queries), for one
// scope: entered where `wanted` and no window is open (TryEnterBackgroundWork), left when the
// scope ends. Where it is not entered the work must not be done.
class WorkOutsideCapture {
 public:
  explicit WorkOutsideCapture(bool wanted) : entered_(wanted && TryEnterBackgroundWork()) {}
  ~WorkOutsideCapture() {
    if (entered_) LeaveBackgroundWork();
  }
  WorkOutsideCapture(const WorkOutsideCapture&) = delete;
  WorkOutsideCapture& operator=(const WorkOutsideCapture&) = delete;
  bool entered() const { return entered_; }

 private:
  const bool entered_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_CAPTURE_WINDOW_H_
