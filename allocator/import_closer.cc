#include "allocator/import_closer.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/log.h"
#include "allocator/mutex.h"

namespace vmm {
namespace {

// The queue and its thread. One per process: a forked child makes a new one (the parent's
// thread does not exist there and its lock may have been held at the fork), leaking the copy
// and what it holds.
class Closer {
 public:
  static Closer& ForThisProcess() {
    static const int registered =
        pthread_atfork(nullptr, nullptr, [] { current.store(nullptr); });
    (void)registered;
    Closer* closer = current.load(std::memory_order_acquire);
    if (closer == nullptr) {
      auto* fresh = new Closer();  // never destroyed: imports may be dropped during exit
      if (current.compare_exchange_strong(closer, fresh, std::memory_order_acq_rel)) {
        closer = fresh;
      } else {
        delete fresh;
      }
    }
    return *closer;
  }

  void Add(std::unique_ptr<ImportedBuffer> buffer) {
    {
      MutexLock lock(&mu_);
      if (!failed_) {
        queued_.push_back(std::move(buffer));
        if (started_) {
          wake_.notify_one();
          return;
        }
        started_ = true;
        try {
          std::thread([this] { Run(); }).detach();  // lives as long as the process
          return;
        } catch (const std::system_error& e) {
          failed_ = true;
          buffer = std::move(queued_.back());
          queued_.pop_back();
          LogWarningOnce("import-closer-thread",
                         absl::StrCat("cannot start the thread that closes imports (", e.what(),
                                      "); imports are closed where they are dropped"));
        }
      }
    }
    buffer.reset();  // no thread: closed here, no lock held
  }

  size_t Flush(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (pending() != 0) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      drained_.wait_for(mu_, absl::ToChronoMilliseconds(left) + std::chrono::milliseconds(1));
    }
    return pending();
  }

 private:
  size_t pending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queued_.size() + closing_; }

  void Run() {
    std::vector<std::unique_ptr<ImportedBuffer>> batch;
    for (;;) {
      {
        MutexLock lock(&mu_);
        closing_ = 0;
        drained_.notify_all();
        while (queued_.empty()) wake_.wait(mu_);
        batch.swap(queued_);
        closing_ = batch.size();
      }
      batch.clear();  // closes each, in order, no lock held
    }
  }

  static std::atomic<Closer*> current;  // this process's; reset in a forked child

  Mutex mu_;
  std::vector<std::unique_ptr<ImportedBuffer>> queued_ ABSL_GUARDED_BY(mu_);
  size_t closing_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable_any wake_;
  std::condition_variable_any drained_;
};

std::atomic<Closer*> Closer::current{nullptr};

}  // namespace

void CloseLater(std::unique_ptr<ImportedBuffer> buffer) {
  if (buffer == nullptr) return;
  Closer::ForThisProcess().Add(std::move(buffer));
}

size_t FlushCloses(absl::Duration timeout) { return Closer::ForThisProcess().Flush(timeout); }

}  // namespace vmm
