// hold_journal.h: test helpers for send-ledger holds with a settle (send_ledger.h).
#ifndef VMM_TESTS_HOLD_JOURNAL_H_
#define VMM_TESTS_HOLD_JOURNAL_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "allocator/mutex.h"
#include "allocator/send_ledger.h"
#include "gtest/gtest.h"

namespace vmm {

// What a hold's release and settle did, in order: "release", "settle(true)", "settle(false)".
class Journal {
 public:
  void Add(std::string what) {
    MutexLock lock(&mu_);
    entries_.push_back(std::move(what));
  }
  std::vector<std::string> entries() {
    MutexLock lock(&mu_);
    return entries_;
  }

 private:
  Mutex mu_;
  std::vector<std::string> entries_ ABSL_GUARDED_BY(mu_);
};

// A hold of `bytes` in the process's ledger whose release and settle are recorded in
// `journal` (a failure to make it fails the test and returns a zero ticket).
inline SendLedger::Ticket HoldSettled(uint64_t bytes, Journal* journal) {
  absl::StatusOr<SendLedger::Ticket> ticket = SendLedger::Get().Hold(
      bytes, [journal] { journal->Add("release"); },
      [journal](bool released) { journal->Add(released ? "settle(true)" : "settle(false)"); });
  EXPECT_TRUE(ticket.ok()) << ticket.status();
  return ticket.ok() ? *ticket : SendLedger::Ticket{};
}

}  // namespace vmm

#endif  // VMM_TESTS_HOLD_JOURNAL_H_
