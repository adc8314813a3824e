#include "allocator/fork_guard.h"

#include <pthread.h>

#include "absl/strings/str_cat.h"

namespace vmm {
namespace fork_internal {

std::atomic<uint64_t> generation{0};
std::atomic<uint64_t> forks_made{0};

namespace {

void OnForkChild() { generation.fetch_add(1, std::memory_order_relaxed); }
void OnForkParent() { forks_made.fetch_add(1, std::memory_order_relaxed); }

// Installed when the library is loaded, before anything can be made and before any fork().
const bool installed = [] {
  pthread_atfork(/*prepare=*/nullptr, &OnForkParent, &OnForkChild);
  return true;
}();

}  // namespace
}  // namespace fork_internal

absl::Status ForkedError(absl::string_view what) {
  (void)fork_internal::installed;
  return absl::FailedPreconditionError(absl::StrCat(
      "this ", what, " was made by the parent of this forked process: after fork() a child "
      "never allocates from or exports its parent's memory (both would hand out the same "
      "bytes); create a new pool in the child, or start children with the spawn method"));
}

}  // namespace vmm
