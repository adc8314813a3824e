// send_acker.h: the receiver's acknowledgements of sends, sent by a background thread.
//
//   AckSendLater(ticket);          // after importing a send: returns at once
//   FlushAcks(absl::Seconds(5));   // at exit: what was queued has been sent
//
// A receiver acknowledges a send (send_ledger.h) once it has imported it, so that the sender
// lets go of the memory. The sender does not need the acknowledgement before the receiver
// uses the tensor, so the receiver does not wait for it: AckSendLater queues the ticket and one
// thread per process sends what is queued, all tickets of one exporter in one connection
// (AckSends), so a receiver of many small tensors pays one connection per batch, not per
// tensor. Failures (the sender gone, the send expired) are no error for the receiver and are
// logged at debug level only; a receiver killed before its queue is sent leaves the send to
// its lease. Thread safe; a forked child starts with an empty queue and its own thread.
#ifndef VMM_ALLOCATOR_SEND_ACKER_H_
#define VMM_ALLOCATOR_SEND_ACKER_H_

#include <cstddef>

#include "absl/time/time.h"
#include "allocator/send_ledger.h"

namespace vmm {

// Queues `ticket` for acknowledgement (starts the thread on first use).
void AckSendLater(const SendLedger::Ticket& ticket);
// Queues a later report on `ticket` (kReleased, kForwarded: the receiver unmapped it), sent
// the same way.
void ReportSendLater(const SendLedger::Ticket& ticket, SendReport report);
// Waits until every ticket queued so far has been sent (answered or failed), at most
// `timeout`; returns how many are still queued or being sent.
size_t FlushAcks(absl::Duration timeout);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_SEND_ACKER_H_
