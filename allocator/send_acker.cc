#include "allocator/send_acker.h"

#include <vector>

#include "allocator/process_queue.h"

namespace vmm {
namespace {

struct Queued {
  SendLedger::Ticket ticket;
  SendReport report;
};

// Sends a batch: one request kind at a time, acks first, all tickets of one exporter in one
// connection (ReportSends). A sender gone or a send expired is no error for the receiver:
// nothing to report.
void SendAll(std::vector<Queued>& batch) {
  std::vector<SendLedger::Ticket> tickets;
  for (SendReport report :
       {SendReport::kImported, SendReport::kReleased, SendReport::kForwarded}) {
    tickets.clear();
    for (const Queued& q : batch) {
      if (q.report == report) tickets.push_back(q.ticket);
    }
    if (!tickets.empty()) (void)ReportSends(tickets, report);
  }
}

using Acker = ProcessQueue<Queued, SendAll>;

}  // namespace

void AckSendLater(const SendLedger::Ticket& ticket) {
  Acker::ForThisProcess().Add({ticket, SendReport::kImported}, "acknowledging sends");
}

void ReportSendLater(const SendLedger::Ticket& ticket, SendReport report) {
  Acker::ForThisProcess().Add({ticket, report}, "acknowledging sends");
}

size_t FlushAcks(absl::Duration timeout) { return Acker::ForThisProcess().Flush(timeout); }

}  // namespace vmm
