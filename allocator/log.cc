#include "allocator/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/container/flat_hash_set.h"
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

}  // namespace

void LogWarning(absl::string_view message) {
  if (!Quiet()) Print("warning", message);
}

void LogWarningOnce(absl::string_view key, absl::string_view message) {
  static Mutex mu;
  static auto* seen = new absl::flat_hash_set<std::string>();
  {
    MutexLock lock(&mu);
    if (!seen->insert(std::string(key)).second) return;
  }
  LogWarning(message);
}

void LogError(absl::string_view message) { Print("error", message); }

}  // namespace vmm
