// stream_gate.h: a test helper that holds a stream's work until Release(), through a host
// function that waits on a flag (Driver::LaunchHostFunc). The waiting function shares the
// gate's state, so the gate may go away before the stream reaches it.
#ifndef VMM_TESTS_STREAM_GATE_H_
#define VMM_TESTS_STREAM_GATE_H_

#include <condition_variable>
#include <memory>
#include <mutex>

#include "allocator/driver.h"
#include "gtest/gtest.h"

namespace vmm {

class StreamGate {
 public:
  StreamGate(Driver* driver, Stream stream) : state_(std::make_shared<State>()) {
    auto* arg = new std::shared_ptr<State>(state_);
    EXPECT_TRUE(driver->LaunchHostFunc(stream, &StreamGate::Wait, arg).ok());
  }
  ~StreamGate() { Release(); }
  void Release() {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->open = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
  };
  static void Wait(void* arg) {
    std::unique_ptr<std::shared_ptr<State>> state(static_cast<std::shared_ptr<State>*>(arg));
    std::unique_lock<std::mutex> lock((*state)->mu);
    (*state)->cv.wait(lock, [&] { return (*state)->open; });
  }
  std::shared_ptr<State> state_;
};

}  // namespace vmm

#endif  // VMM_TESTS_STREAM_GATE_H_
