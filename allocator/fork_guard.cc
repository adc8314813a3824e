#include "allocator/fork_guard.h"

#include <pthread.h>

#include "absl/base/attributes.h"
#include "absl/strings/str_cat.h"

namespace vmm {
namespace fork_internal {

std::atomic<uint64_t> generation{0};
std::atomic<uint64_t> forks_made{0};

// The registrations of each level. Constant-initialised (no constructor runs), so that static
// initialisers of other files may register before this file's have run.
struct Forever {
  ForkHandlers handlers;
  Forever* next = nullptr;
};

struct Level {
  // AtForkForever's registrations, newest first; pushed without a lock, never removed.
  std::atomic<Forever*> forever{nullptr};
  // The newest of them when this fork's prepare handler reached the level: the parent's and
  // the child's handlers run those (one registered later had no prepare).
  Forever* prepared = nullptr;
  // Guards the ForkRegistrations of the level; held from the level's prepare to after the
  // fork, so that none is made or destroyed meanwhile.
  Mutex mu;
  ForkRegistration* first ABSL_GUARDED_BY(mu) = nullptr;
};

constexpr int kLevels = static_cast<int>(ForkLevel::kCount);
ABSL_CONST_INIT Level levels[kLevels];

struct Access {
  static void Prepare(Level& level) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    level.mu.Lock();
    level.prepared = level.forever.load(std::memory_order_acquire);
    for (Forever* f = level.prepared; f != nullptr; f = f->next) {
      if (f->handlers.prepare != nullptr) f->handlers.prepare(f->handlers.arg);
    }
    for (ForkRegistration* r = level.first; r != nullptr; r = r->next_) {
      if (r->handlers_.prepare != nullptr) r->handlers_.prepare(r->handlers_.arg);
    }
  }

  // After the fork: `parent` or `child` of every registration the prepare handler ran, then
  // the level's own lock.
  static void After(Level& level, bool child) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (ForkRegistration* r = level.first; r != nullptr; r = r->next_) {
      void (*handler)(void*) = child ? r->handlers_.child : r->handlers_.parent;
      if (handler != nullptr) handler(r->handlers_.arg);
    }
    for (Forever* f = level.prepared; f != nullptr; f = f->next) {
      void (*handler)(void*) = child ? f->handlers.child : f->handlers.parent;
      if (handler != nullptr) handler(f->handlers.arg);
    }
    if (child) {
      level.mu.UnlockInForkChild();
    } else {
      level.mu.Unlock();
    }
  }

  static void Link(ForkRegistration* r) {
    Level& level = levels[r->level_];
    MutexLock lock(&level.mu);
    r->next_ = level.first;
    if (level.first != nullptr) level.first->prev_ = r;
    level.first = r;
    r->registered_ = true;
  }

  static void Unlink(ForkRegistration* r) {
    Level& level = levels[r->level_];
    MutexLock lock(&level.mu);
    if (!r->registered_) return;
    if (r->prev_ != nullptr) r->prev_->next_ = r->next_;
    if (r->next_ != nullptr) r->next_->prev_ = r->prev_;
    if (level.first == r) level.first = r->next_;
    r->prev_ = r->next_ = nullptr;
    r->registered_ = false;
  }
};

namespace {

void PrepareFork() {
  for (int i = 0; i < kLevels; ++i) Access::Prepare(levels[i]);
}

void AfterForkInParent() {
  forks_made.fetch_add(1, std::memory_order_relaxed);
  for (int i = kLevels - 1; i >= 0; --i) Access::After(levels[i], /*child=*/false);
}

void AfterForkInChild() {
  // First: a child handler may ask which generation it is in.
  generation.fetch_add(1, std::memory_order_relaxed);
  for (int i = kLevels - 1; i >= 0; --i) Access::After(levels[i], /*child=*/true);
}

// The one pthread_atfork registration of vmm's handlers, made when the library is loaded
// (before anything can be made and before any fork()), or by the first registration if that
// comes first (another file's static initialiser).
bool Install() {
  static const bool installed = [] {
    pthread_atfork(&PrepareFork, &AfterForkInParent, &AfterForkInChild);
    return true;
  }();
  return installed;
}

const bool installed_at_load = Install();

}  // namespace
}  // namespace fork_internal

namespace {

void LockMutex(void* mu) ABSL_NO_THREAD_SAFETY_ANALYSIS { static_cast<Mutex*>(mu)->Lock(); }
void UnlockMutex(void* mu) ABSL_NO_THREAD_SAFETY_ANALYSIS { static_cast<Mutex*>(mu)->Unlock(); }
void UnlockMutexInChild(void* mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static_cast<Mutex*>(mu)->UnlockInForkChild();
}

}  // namespace

ForkHandlers ForkHandlers::Lock(Mutex* mu) {
  ForkHandlers h;
  h.prepare = &LockMutex;
  h.parent = &UnlockMutex;
  h.child = &UnlockMutexInChild;
  h.arg = mu;
  return h;
}

void AtForkForever(ForkLevel level, const ForkHandlers& handlers) {
  (void)fork_internal::Install();
  auto* f = new fork_internal::Forever{handlers, nullptr};  // never freed
  std::atomic<fork_internal::Forever*>& head =
      fork_internal::levels[static_cast<int>(level)].forever;
  f->next = head.load(std::memory_order_relaxed);
  while (!head.compare_exchange_weak(f->next, f, std::memory_order_release,
                                     std::memory_order_relaxed)) {
  }
}

ForkRegistration::ForkRegistration(ForkLevel level, const ForkHandlers& handlers)
    : level_(static_cast<int>(level)), handlers_(handlers) {
  (void)fork_internal::Install();
  fork_internal::Access::Link(this);
}

void ForkRegistration::Unregister() { fork_internal::Access::Unlink(this); }

absl::Status ForkedError(absl::string_view what) {
  (void)fork_internal::installed_at_load;
  return absl::FailedPreconditionError(absl::StrCat(
      "this ", what, " was made by the parent of this forked process: after fork() a child "
      "never allocates from or exports its parent's memory (both would hand out the same "
      "bytes); create a new pool in the child, or start children with the spawn method"));
}

}  // namespace vmm
