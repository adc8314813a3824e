// slack_range_driver.h: a test driver that keeps address space free after each range it
// reserves, so that a pool's range can grow there (Driver::ReserveAt), and that refuses, as
// the CUDA backend is taken to, any Map, Unmap or SetAccess crossing from one of its
// reservations into another.
#ifndef VMM_TESTS_SLACK_RANGE_DRIVER_H_
#define VMM_TESTS_SLACK_RANGE_DRIVER_H_

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <map>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "allocator/driver.h"
#include "allocator/forwarding_driver.h"
#include "allocator/status_macros.h"

namespace vmm {

// Reserves `slack` bytes more than asked after each range, which the pool does not know of:
// ReserveAt takes address space from that slack (elsewhere it refuses, as where another mapping
// took it, and so does it everywhere once `refuse` is set). Each range it gives is a
// reservation of its own: a Map, Unmap or SetAccess that crosses from one into another fails
// and is counted, as the CUDA backend is taken to refuse it (driver.h ReserveAt). `total`, if
// set, is the GPU's memory that GetMemInfo reports (the default range follows it).
// Thread safe: its tables are under one lock.
class SlackRangeDriver : public ForwardingDriver {
 public:
  SlackRangeDriver(Driver* inner, size_t slack, size_t total = 0)
      : ForwardingDriver(inner), slack_(slack), total_(total) {}
  absl::StatusOr<MemInfo> GetMemInfo(int device) override {
    VMM_ASSIGN_OR_RETURN(MemInfo info, ForwardingDriver::GetMemInfo(device));
    if (total_ != 0) info = MemInfo{std::min(info.free, total_), total_};
    return info;
  }
  absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) override {
    std::lock_guard<std::mutex> lock(mu_);
    VMM_ASSIGN_OR_RETURN(DevPtr base, ForwardingDriver::Reserve(size + slack_, alignment));
    padded_[base] = size + slack_;
    ranges_[base] = size;
    return base;
  }
  absl::StatusOr<DevPtr> ReserveAt(DevPtr at, size_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++reserve_ats_;
    auto pad = padded_.upper_bound(at);
    const bool in_slack = !refuse_ && pad != padded_.begin() &&
                          at + size <= std::prev(pad)->first + std::prev(pad)->second &&
                          !Overlaps(at, size);
    if (!in_slack) return absl::ResourceExhaustedError("the address space there is taken");
    ranges_[at] = size;
    return at;
  }
  absl::Status Unreserve(DevPtr ptr, size_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.find(ptr);
    if (it == ranges_.end() || it->second != size) {
      return absl::InvalidArgumentError("not a reservation");
    }
    ranges_.erase(it);
    // The padded range goes back once none of its reservations is left.
    auto pad = std::prev(padded_.upper_bound(ptr));
    if (!Overlaps(pad->first, pad->second)) {
      VMM_RETURN_IF_ERROR(ForwardingDriver::Unreserve(pad->first, pad->second));
      padded_.erase(pad);
    }
    return absl::OkStatus();
  }
  absl::Status Map(DevPtr p, size_t size, PhysHandle h) override {
    VMM_RETURN_IF_ERROR(InsideOne("Map", p, size));
    return ForwardingDriver::Map(p, size, h);
  }
  absl::Status Unmap(DevPtr p, size_t size) override {
    VMM_RETURN_IF_ERROR(InsideOne("Unmap", p, size));
    return ForwardingDriver::Unmap(p, size);
  }
  absl::Status SetAccess(DevPtr p, size_t size, absl::Span<const int> devices) override {
    VMM_RETURN_IF_ERROR(InsideOne("SetAccess", p, size));
    return ForwardingDriver::SetAccess(p, size, devices);
  }
  void set_refuse(bool refuse) {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_ = refuse;
  }
  int reserve_ats() {
    std::lock_guard<std::mutex> lock(mu_);
    return reserve_ats_;
  }
  int crossings() {
    std::lock_guard<std::mutex> lock(mu_);
    return crossings_;
  }
  size_t reservations() {
    std::lock_guard<std::mutex> lock(mu_);
    return ranges_.size();
  }

 private:
  bool Overlaps(DevPtr at, size_t size) const {
    auto next = ranges_.lower_bound(at);
    if (next != ranges_.end() && next->first < at + size) return true;
    return next != ranges_.begin() && std::prev(next)->first + std::prev(next)->second > at;
  }
  absl::Status InsideOne(const char* call, DevPtr p, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(p);
    if (it != ranges_.begin() && p + size <= std::prev(it)->first + std::prev(it)->second) {
      return absl::OkStatus();
    }
    ++crossings_;
    return absl::InvalidArgumentError(absl::StrCat(call, " crosses from one reservation"));
  }

  std::mutex mu_;
  size_t slack_;
  size_t total_;
  bool refuse_ = false;
  int reserve_ats_ = 0;
  int crossings_ = 0;
  std::map<DevPtr, size_t> padded_;  // what the inner driver reserved
  std::map<DevPtr, size_t> ranges_;  // what the pool was given
};

}  // namespace vmm

#endif  // VMM_TESTS_SLACK_RANGE_DRIVER_H_
