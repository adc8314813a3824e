#include "allocator/import_closer.h"

#include <utility>
#include <vector>

#include "allocator/process_queue.h"

namespace vmm {
namespace {

// Destroys (closes) each import of the batch, in order.
void CloseAll(std::vector<std::unique_ptr<ImportedBuffer>>& batch) { batch.clear(); }

// A fork waits for the closes being made: they hold the driver's locks.
using Closer = ProcessQueue<std::unique_ptr<ImportedBuffer>, CloseAll, /*kForkWaits=*/true>;

}  // namespace

void CloseLater(std::unique_ptr<ImportedBuffer> buffer) {
  if (buffer == nullptr) return;
  Closer::ForThisProcess().Add(std::move(buffer), "closing imports");
}

size_t FlushCloses(absl::Duration timeout) { return Closer::ForThisProcess().Flush(timeout); }

void HoldCloses() { Closer::ForThisProcess().Hold(); }

void ReleaseCloses() { Closer::ForThisProcess().Release(); }

}  // namespace vmm
