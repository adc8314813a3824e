#include "allocator/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/attributes.h"
#include "absl/container/flat_hash_set.h"
#include "allocator/fork_guard.h"
#include "allocator/mutex.h"

namespace vmm {
namespace {

bool Quiet() {
  static const bool quiet = [] {
    const char* level = std::getenv("VMM_LOG_LEVEL");
    return level != nullptr && std::strcmp(level, "quiet") == 0;
  }();
  return quiet;
}

void Print(const char* severity, absl::string_view message) {
  std::fprintf(stderr, "[vmm] %s: %.*s\n", severity, static_cast<int>(message.size()),
               message.data());
}

// LogWarningOnce's record of the keys said. The lock is held across fork() (the last level:
// anything may log), so that a forked child never finds it held by a thread of its parent.
ABSL_CONST_INIT Mutex once_mu;
absl::flat_hash_set<std::string>* said ABSL_GUARDED_BY(once_mu) = nullptr;
const bool once_mu_held_across_fork = [] {
  AtForkForever(ForkLevel::kLog, ForkHandlers::Lock(&once_mu));
  return true;
}();

}  // namespace

void LogWarningOnce(absl::string_view key, absl::string_view message) {
  (void)once_mu_held_across_fork;
  {
    MutexLock lock(&once_mu);
    if (said == nullptr) said = new absl::flat_hash_set<std::string>();  // never freed
    if (!said->insert(std::string(key)).second) return;
  }
  LogWarning(message);
}

void LogWarning(absl::string_view message) {
  if (!Quiet()) Print("warning", message);
}

void LogError(absl::string_view message) { Print("error", message); }

}  // namespace vmm
