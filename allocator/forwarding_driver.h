// forwarding_driver.h: a Driver that passes every call to another, for tests and benchmarks
// that change, count or time some calls (subclass it and override those calls, calling
// ForwardingDriver's). It owns nothing; the inner driver must outlive it.
#ifndef VMM_ALLOCATOR_FORWARDING_DRIVER_H_
#define VMM_ALLOCATOR_FORWARDING_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/driver.h"

namespace vmm {

class ForwardingDriver : public Driver {
 public:
  explicit ForwardingDriver(Driver* inner) : inner_(inner) {}

  Backend backend() const override { return inner_->backend(); }
  int DeviceCount() const override { return inner_->DeviceCount(); }
  absl::StatusOr<std::string> DeviceUuid(int d) override { return inner_->DeviceUuid(d); }
  absl::StatusOr<size_t> Granularity(int d) override { return inner_->Granularity(d); }
  absl::StatusOr<bool> SupportsHandleType(int d, HandleType t) override {
    return inner_->SupportsHandleType(d, t);
  }
  absl::StatusOr<MemInfo> GetMemInfo(int d) override { return inner_->GetMemInfo(d); }
  absl::StatusOr<PhysHandle> Create(int d, size_t size, uint32_t types) override {
    return inner_->Create(d, size, types);
  }
  absl::Status Release(PhysHandle h) override { return inner_->Release(h); }
  absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) override {
    return inner_->Reserve(size, alignment);
  }
  absl::StatusOr<DevPtr> ReserveAt(DevPtr at, size_t size) override {
    return inner_->ReserveAt(at, size);
  }
  absl::Status Unreserve(DevPtr p, size_t size) override { return inner_->Unreserve(p, size); }
  absl::Status Map(DevPtr p, size_t size, PhysHandle h) override { return inner_->Map(p, size, h); }
  absl::Status Unmap(DevPtr p, size_t size) override { return inner_->Unmap(p, size); }
  absl::Status SetAccess(DevPtr p, size_t size, absl::Span<const int> devices) override {
    return inner_->SetAccess(p, size, devices);
  }
  absl::StatusOr<bool> HasAccess(DevPtr p, int d) override { return inner_->HasAccess(p, d); }
  absl::StatusOr<ShareableHandle> Export(PhysHandle h, HandleType t) override {
    return inner_->Export(h, t);
  }
  absl::StatusOr<PhysHandle> Import(const ShareableHandle& h) override { return inner_->Import(h); }
  absl::StatusOr<Stream> CreateStream(int d) override { return inner_->CreateStream(d); }
  absl::Status DestroyStream(Stream s) override { return inner_->DestroyStream(s); }
  absl::Status SynchronizeStream(Stream s) override { return inner_->SynchronizeStream(s); }
  absl::StatusOr<bool> StreamCapturing(Stream s) override { return inner_->StreamCapturing(s); }
  absl::Status SynchronizeDevice(int d) override { return inner_->SynchronizeDevice(d); }
  absl::StatusOr<Event> CreateEvent(int d) override { return inner_->CreateEvent(d); }
  absl::Status DestroyEvent(Event e) override { return inner_->DestroyEvent(e); }
  absl::Status RecordEvent(Event e, Stream s) override { return inner_->RecordEvent(e, s); }
  absl::StatusOr<bool> EventDone(Event e) override { return inner_->EventDone(e); }
  absl::Status SynchronizeEvent(Event e) override { return inner_->SynchronizeEvent(e); }
  absl::Status LaunchHostFunc(Stream s, void (*fn)(void*), void* arg) override {
    return inner_->LaunchHostFunc(s, fn, arg);
  }
  absl::Status MemcpyAsync(DevPtr dst, DevPtr src, size_t n, Stream s) override {
    return inner_->MemcpyAsync(dst, src, n, s);
  }
  absl::Status MemsetAsync(DevPtr dst, uint8_t v, size_t n, Stream s) override {
    return inner_->MemsetAsync(dst, v, n, s);
  }

 protected:
  Driver* const inner_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FORWARDING_DRIVER_H_
