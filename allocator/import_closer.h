// import_closer.h: closing imports on a background thread.
//
//   CloseLater(std::move(buffer));   // returns at once; unmapped soon after
//   FlushCloses(absl::Seconds(5));   // at exit: every queued import is closed
//
// Closing an import waits for the devices that may use it (a kernel reading the tensor may
// still run when its last view dies), then unmaps and releases it: tens of microseconds, on
// the thread that dropped the last reference — for a PyTorch tensor, the Python thread that
// deleted it, holding the interpreter lock. A receiver of many small tensors pays that per
// tensor. CloseLater hands the import to one thread per process that closes what is queued in
// order (the devices' synchronizations after the first of a batch find them idle), and the
// sender's release reports (ImportedBuffer::OnUnmapped) follow from there.
//
// Failures: those of closing (logged by the mapping, as for an import closed inline). If the
// thread cannot be started, the import is closed by the caller. Thread safe; a forked child
// starts with an empty queue and its own thread, and never closes its parent's queued imports
// (their mappings are the parent's).
#ifndef VMM_ALLOCATOR_IMPORT_CLOSER_H_
#define VMM_ALLOCATOR_IMPORT_CLOSER_H_

#include <cstddef>
#include <memory>

#include "absl/time/time.h"
#include "allocator/sharing.h"

namespace vmm {

// Queues `buffer` to be destroyed (closed) by the closing thread (started on first use).
void CloseLater(std::unique_ptr<ImportedBuffer> buffer);
// Waits until every import queued so far is closed, at most `timeout`; returns how many are
// still queued or being closed.
size_t FlushCloses(absl::Duration timeout);
// Pauses the closing thread while a CUDA graph is captured: closing synchronizes the devices,
// which a capture in CUDA's global mode (PyTorch's default) forbids to every thread (the
// capture is invalidated). HoldCloses returns once no close is running; imports dropped
// meanwhile are closed after the last ReleaseCloses. Holds nest.
void HoldCloses();
void ReleaseCloses();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_IMPORT_CLOSER_H_
