#include "allocator/pool_closer.h"

#include <utility>
#include <vector>

#include "allocator/capture_window.h"
#include "allocator/process_queue.h"

namespace vmm {
namespace {

// Destroys each pool of the batch once no capture window is open.
void DestroyAll(std::vector<std::unique_ptr<Pool>>& batch) {
  EnterBackgroundWork();
  batch.clear();
  LeaveBackgroundWork();
}

// A fork waits for the destructions being made: they hold the driver's locks.
using Destroyer = ProcessQueue<std::unique_ptr<Pool>, DestroyAll, /*kForkWaits=*/true>;

}  // namespace

void DestroyOutsideCapture(std::unique_ptr<Pool> pool) {
  if (pool == nullptr) return;
  {
    const WorkOutsideCapture now(/*wanted=*/true);
    if (now.entered()) {
      pool.reset();
      return;
    }
  }
  Destroyer::ForThisProcess().Add(std::move(pool), "destroying pools after a capture");
}

size_t FlushPoolDestroys(absl::Duration timeout) {
  return Destroyer::ForThisProcess().Flush(timeout);
}

}  // namespace vmm
