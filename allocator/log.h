// log.h: vmm's few messages to people, on stderr.
//
// The allocator speaks only when something deserves attention: a fallback taken (fabric
// handles unavailable, so POSIX fds are used), or a fault it cannot return as a status.
// VMM_LOG_LEVEL=quiet silences warnings; errors are always printed.
//
//   LogWarningOnce("fabric-fallback", "fabric handles unavailable; using POSIX fds");
#ifndef VMM_ALLOCATOR_LOG_H_
#define VMM_ALLOCATOR_LOG_H_

#include "absl/strings/string_view.h"

namespace vmm {

void LogWarning(absl::string_view message);
// Prints `message` the first time `key` is seen in this process, and never again.
void LogWarningOnce(absl::string_view key, absl::string_view message);
void LogError(absl::string_view message);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_LOG_H_
