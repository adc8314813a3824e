// fork_guard.h: telling whether this process is a fork() child of the one that made something.
//
// A pool's free space is bookkeeping in process memory over physical memory that a fork()
// child shares with its parent (the host backend maps it MAP_SHARED; CUDA memory is not
// usable in a forked child at all). If both processes went on allocating from the same pool
// they would hand out the same bytes twice. So whatever must not be used across fork() records
// ForkGeneration() when it is made and compares it before use:
//
//   const uint64_t made_in = ForkGeneration();
//   ...
//   if (ABSL_PREDICT_FALSE(ForkGeneration() != made_in)) return ForkedError("pool");
//
// The generation starts at 0 and goes up by one in every child fork() creates (a
// pthread_atfork child handler, installed before main). Reading it is one relaxed atomic load.
//
// Locks held across fork(). fork() copies only the thread that calls it: a lock that another
// thread holds at that moment stays held for good in the child, which hangs at its first use
// (a receiver forked while a second thread of its parent allocates or exports, as
// torch.multiprocessing's fork start method makes them). So every lock that a forked child
// may take is held across fork(): registered here (ForkRegistration, or AtForkForever for what
// lives as long as the process), it is taken by one pthread_atfork prepare handler, level by
// level in the order of ForkLevel, and released after the fork in the parent and in the child
// (whose handler may first make the state the child's: forget the parent's threads' work).
// The child then finds every such lock free and the state it guards whole. A lock that a child
// never takes (that of an object the child replaces and whose state it leaves alone) need not
// be registered: where it is declared says why.
//
// The lock order: a lock of a level is never taken while a lock of a later level is held,
// and locks of one level are never held together (the prepare handler takes them in that
// order, so an inversion could deadlock fork()). Nor may a thread hold a registered lock while
// it waits for another thread (a condition, a join) that needs a lock of an earlier level.
// Registering or unregistering at a level (a ForkRegistration made or destroyed) waits while
// a fork is under way: it must not be done while holding a lock of that level or a later one,
// nor inside a function's static initialisation (a child forked meanwhile would find that
// initialisation under way for good: singletons use AtForkForever, which never waits, or are
// published through an atomic pointer, as ProcessState::Get does).
//
// CUDA is not usable in a forked child at all: the CUDA backend's locks are made free in the child only so
// that its calls fail there rather than hang (cuda_driver.cc), and the LibTorch extension's
// own locks (torch_plugin/csrc) guard CUDA state only. The capture window (capture_window.cc)
// and the process queues (process_queue.h) give a child fresh objects instead, leaving the
// parent's (and their locks) untouched.
#ifndef VMM_ALLOCATOR_FORK_GUARD_H_
#define VMM_ALLOCATOR_FORK_GUARD_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "allocator/mutex.h"

namespace vmm {
namespace fork_internal {
extern std::atomic<uint64_t> generation;
extern std::atomic<uint64_t> forks_made;
struct Access;
}  // namespace fork_internal

// How many fork()s separate this process from the first one that loaded vmm.
inline uint64_t ForkGeneration() {
  return fork_internal::generation.load(std::memory_order_relaxed);
}

// How many children this process has fork()ed (a pthread_atfork parent handler; a child
// starts at its parent's count). What was mapped before a fork may still be mapped in a child.
inline uint64_t ForksMade() { return fork_internal::forks_made.load(std::memory_order_relaxed); }

// FailedPrecondition: `what` was made by the parent of this forked process and cannot be used
// here; says what to do instead.
absl::Status ForkedError(absl::string_view what);

// --- Locks held across fork() -------------------------------------------------------------

// The order in which fork()'s prepare handler takes the registered locks: outermost first.
enum class ForkLevel : int {
  // Gates, held while background work runs that takes the locks below.
  kImportCloses,  // ProcessQueue's gate (process_queue.h, kForkWaits): imports being closed
  kSendReleases,  // the send ledger's run gate (send_ledger.cc): releases of sends running
  // The plugin's state (torch_plugin/process_state.h).
  kPrivatePools,   // ProcessState::private_mu_ (taken before mu_)
  kStatistics,     // ProcessState::stats_mu_ (resets of a GPU's figures, pools going)
  kProcessState,   // ProcessState::mu_
  kProcessSends,   // ProcessState::released_mu_ and budget_mu_, BlockHolds::mu_
  kPool,           // Pool::mu_ (one per pool)
  kSendLedger,     // the send ledger's lock (send_ledger.cc)
  kImports,        // an import's mapping and kept handles, the mapping cache (sharing.cc)
  kExports,        // ExportRegistry::mu_, FdExportAnchors::mu_
  kFdServer,       // the fd server's server_mu (fd_share.cc), which makes a child's own server
  kFdRegistry,     // the fd server's registry (fd_share.cc): the child closes the parent's fds
  kConnections,    // the fd client's kept connections (fd_share.cc)
  kDriverInit,     // making the process-wide drivers (GetHostDriver, GetCudaDriver)
  kDriver,         // HostDriver::mu_ (one per driver); CudaDriver's context_mu_ and mu_
  kLog,            // LogWarningOnce's record of what was said (log.cc)
  kCount,
};

// What runs around every fork() for one registration, each given `arg`: `prepare` before it
// (in the forking thread, ForkLevel order), `parent` and `child` after it (reverse order), in
// the parent and in the child. Any may be null. Handlers must not fork, register or
// unregister, nor call LogWarningOnce (its lock is held).
struct ForkHandlers {
  void (*prepare)(void* arg) = nullptr;
  void (*parent)(void* arg) = nullptr;
  void (*child)(void* arg) = nullptr;
  void* arg = nullptr;

  // `*mu` held across fork(): locked before it, unlocked after it in the parent and, with
  // Mutex::UnlockInForkChild, in the child.
  static ForkHandlers Lock(Mutex* mu);
};

namespace fork_internal {
template <typename T, Mutex T::*kMu, void (*kInChild)(T&)>
struct LockedAcrossFork {
  static void Prepare(void* o) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    (static_cast<T*>(o)->*kMu).Lock();
  }
  static void Parent(void* o) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    (static_cast<T*>(o)->*kMu).Unlock();
  }
  static void Child(void* o) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    T* object = static_cast<T*>(o);
    kInChild(*object);
    (object->*kMu).UnlockInForkChild();
  }
};
}  // namespace fork_internal

// `object->*kMu` held across fork() as ForkHandlers::Lock holds it, with `kInChild(*object)`
// run in the child first, the lock still held: what makes the state the child's (its copies
// of the parent's fds closed, the parent's work forgotten). kInChild is a handler: the rules
// above apply, and it touches what the lock guards without the analysis knowing the lock is
// held (mark it ABSL_NO_THREAD_SAFETY_ANALYSIS).
//
//   ForkRegistration fork_{ForkLevel::kImports,
//                          LockWithChild<Kept, &Kept::mu_, &Kept::CloseFdsInChild>(this)};
template <typename T, Mutex T::*kMu, void (*kInChild)(T&)>
ForkHandlers LockWithChild(T* object) {
  using Handlers = fork_internal::LockedAcrossFork<T, kMu, kInChild>;
  return ForkHandlers{&Handlers::Prepare, &Handlers::Parent, &Handlers::Child, object};
}

// Registers `handlers` at `level` for the life of the process (a singleton's lock). Never
// waits: a registration made while a fork is under way takes effect from the next fork. May be
// called from static initialisers.
void AtForkForever(ForkLevel level, const ForkHandlers& handlers);

// Registers `handlers` at `level` for the lifetime of this object (a lock of an object that
// comes and goes): declare it after what the handlers use (the lock first of all), so that it
// unregisters before that goes. Construction and destruction wait while a fork is under way:
// see the rule above.
class ForkRegistration {
 public:
  ForkRegistration(ForkLevel level, const ForkHandlers& handlers);
  ~ForkRegistration() { Unregister(); }
  ForkRegistration(const ForkRegistration&) = delete;
  ForkRegistration& operator=(const ForkRegistration&) = delete;

  // Ends the registration now (idempotent): for a destructor that tears down before its
  // members go.
  void Unregister();

 private:
  friend struct fork_internal::Access;
  const int level_;
  const ForkHandlers handlers_;
  bool registered_ = false;  // guarded by the level's list lock
  ForkRegistration* prev_ = nullptr;
  ForkRegistration* next_ = nullptr;
};

// A process-wide object made at its first use by `make()` (a new T) and never destroyed,
// published through `slot` rather than a function's static: its constructor may register
// fork handlers, which wait while a fork is under way, and a child forked meanwhile would
// find a static's initialisation under way for good. Where two threads make one at once, the
// one published first wins and the other is deleted.
template <typename T, typename Make>
T& PublishOnce(std::atomic<T*>& slot, Make make) {
  T* published = slot.load(std::memory_order_acquire);
  if (published != nullptr) return *published;
  T* fresh = make();
  if (slot.compare_exchange_strong(published, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *published;
}

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FORK_GUARD_H_
