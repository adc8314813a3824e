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
#ifndef VMM_ALLOCATOR_FORK_GUARD_H_
#define VMM_ALLOCATOR_FORK_GUARD_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vmm {
namespace fork_internal {
extern std::atomic<uint64_t> generation;
extern std::atomic<uint64_t> forks_made;
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

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FORK_GUARD_H_
