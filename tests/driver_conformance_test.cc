// driver_conformance_test: the contract of driver.h, checked on every backend.
//
// Each test runs twice: on the host backend (a fresh NewHostDriver() per test) and on the CUDA
// backend (the process-wide GetCudaDriver()). Where there is no usable CUDA driver or GPU the
// CUDA instances are skipped, unless VMM_TEST_BACKEND=cuda (the GPU machine; test_backend.h),
// which makes that a failure. Device memory is only ever read and written through
// MemcpyAsync/MemsetAsync, since CUDA device pointers cannot be dereferenced on the host.
//
// Error codes: the host backend is held to the exact codes of driver.h. The CUDA backend maps
// CUDA's own errors, which the CUDA documentation does not always pin down for a given
// mistake; there only the failure itself is checked, except where CUDA documents the error.
//
// The cross-process tests spawn `vmm_peer driver-import` (see tools/vmm_peer.cc for its flags
// and exit codes), which imports what this process exported.
//
// Tests named TwoDevices* need a second device: on the host backend they use a driver that
// emulates two (and VMM_HOST_DEVICES=2 for vmm_peer); on CUDA they run where there are at
// least two GPUs and are skipped elsewhere, also under VMM_TEST_BACKEND=cuda (one GPU is not a
// broken machine).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "allocator/cuda_driver.h"
#include "allocator/driver.h"
#include "allocator/host_driver.h"
#include "allocator/status_macros.h"
#include "allocator/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;

// Exit codes of vmm_peer (tools/vmm_peer.cc).
constexpr int kPeerOk = 0;
constexpr int kPeerImportFailed = 3;

constexpr int kDevice = 0;

DevPtr HostAddress(const void* p) { return static_cast<DevPtr>(reinterpret_cast<uintptr_t>(p)); }

// A fabric handle as vmm_peer's --fabric flag takes it: 128 hex digits.
std::string FabricHex(const FabricHandle& handle) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(handle.data()), handle.size()));
}

// --- Device memory helpers ------------------------------------------------------------------

// Writes `value` over [ptr, ptr+size) and waits for it.
absl::Status Fill(Driver* driver, DevPtr ptr, uint8_t value, size_t size) {
  VMM_RETURN_IF_ERROR(driver->MemsetAsync(ptr, value, size, /*stream=*/0));
  return driver->SynchronizeStream(0);
}

absl::Status Write(Driver* driver, DevPtr ptr, const std::vector<uint8_t>& bytes) {
  VMM_RETURN_IF_ERROR(driver->MemcpyAsync(ptr, HostAddress(bytes.data()), bytes.size(), 0));
  return driver->SynchronizeStream(0);
}

absl::StatusOr<std::vector<uint8_t>> Read(Driver* driver, DevPtr ptr, size_t size) {
  std::vector<uint8_t> bytes(size);
  VMM_RETURN_IF_ERROR(driver->MemcpyAsync(HostAddress(bytes.data()), ptr, size, 0));
  VMM_RETURN_IF_ERROR(driver->SynchronizeStream(0));
  return bytes;
}

// Whether every byte of [ptr, ptr+size) is `value`; names the first one that is not.
::testing::AssertionResult AllBytesAre(Driver* driver, DevPtr ptr, size_t size, uint8_t value) {
  absl::StatusOr<std::vector<uint8_t>> bytes = Read(driver, ptr, size);
  if (!bytes.ok()) return ::testing::AssertionFailure() << bytes.status();
  for (size_t i = 0; i < size; ++i) {
    if ((*bytes)[i] != value) {
      return ::testing::AssertionFailure()
             << "byte " << i << " is " << int{(*bytes)[i]} << ", expected " << int{value};
    }
  }
  return ::testing::AssertionSuccess();
}

// Whether `device` may access `at`; a failing HasAccess fails the test (and counts as no).
bool Granted(Driver* driver, DevPtr at, int device) {
  absl::StatusOr<bool> granted = driver->HasAccess(at, device);
  EXPECT_TRUE(granted.ok()) << absl::StrFormat("HasAccess(0x%x, %d): ", at, device)
                            << granted.status();
  return granted.ok() && *granted;
}

// A pattern that differs from byte to byte and from seed to seed.
std::vector<uint8_t> Pattern(size_t size, uint32_t seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>((i * 131 + seed) >> 3);
  return bytes;
}

// A reserved range with one physical allocation mapped read-write at its start. Free() undoes
// it step by step and reports the first error; the destructor frees whatever is left and
// ignores errors, so that a failing test does not leak device memory into the next one.
class Buffer {
 public:
  // Creates `size` bytes on device 0 exportable as `handle_types` and maps them, accessible
  // by the devices in `access`.
  static absl::StatusOr<std::unique_ptr<Buffer>> Make(Driver* driver, size_t size,
                                                      uint32_t handle_types,
                                                      const std::vector<int>& access = {kDevice}) {
    VMM_ASSIGN_OR_RETURN(PhysHandle handle, driver->Create(kDevice, size, handle_types));
    return Adopt(driver, handle, size, access);
  }

  // Takes over `handle` (which it releases) and maps it, `size` bytes (its whole size).
  static absl::StatusOr<std::unique_ptr<Buffer>> Adopt(Driver* driver, PhysHandle handle,
                                                       size_t size,
                                                       const std::vector<int>& access = {kDevice}) {
    auto buffer = absl::WrapUnique(new Buffer(driver, size));
    buffer->handle_ = handle;
    VMM_ASSIGN_OR_RETURN(buffer->va_, driver->Reserve(size, 0));
    VMM_RETURN_IF_ERROR(driver->Map(buffer->va_, size, handle));
    buffer->mapped_ = true;
    VMM_RETURN_IF_ERROR(driver->SetAccess(buffer->va_, size, access));
    return buffer;
  }

  ~Buffer() { Free().IgnoreError(); }

  absl::Status Free() {
    absl::Status status;
    if (mapped_) status.Update(driver_->Unmap(va_, size_));
    if (handle_ != 0) status.Update(driver_->Release(handle_));
    if (va_ != 0) status.Update(driver_->Unreserve(va_, size_));
    mapped_ = false;
    handle_ = 0;
    va_ = 0;
    return status;
  }

  DevPtr va() const { return va_; }
  size_t size() const { return size_; }
  PhysHandle handle() const { return handle_; }

 private:
  Buffer(Driver* driver, size_t size) : driver_(driver), size_(size) {}

  Driver* const driver_;
  const size_t size_;
  PhysHandle handle_ = 0;
  DevPtr va_ = 0;
  bool mapped_ = false;
};

// A host function that waits until the gate opens: it holds its stream until then.
struct Gate {
  std::atomic<bool> open{false};
  std::atomic<bool> entered{false};

  static void Wait(void* arg) {
    auto* gate = static_cast<Gate*>(arg);
    gate->entered.store(true);
    while (!gate->open.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
};

// --- Peer process ------------------------------------------------------------------------------

struct PeerResult {
  int exit_code = -1;
  std::string output;  // its stdout and stderr
};

// Runs `vmm_peer driver-import` with `args` (descriptors without FD_CLOEXEC are inherited) and
// waits for it. `env` adds "NAME=value" entries to its environment.
absl::StatusOr<PeerResult> RunPeer(const std::vector<std::string>& args,
                                   const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv = {HelperProgramPath("tools/vmm_peer"), "driver-import"};
  argv.insert(argv.end(), args.begin(), args.end());
  Subprocess peer(argv, env, Subprocess::Output::kWithStderr);
  if (!peer.started()) return absl::InternalError(absl::StrCat("could not start ", argv[0]));
  PeerResult result;
  result.output = peer.ReadAll();
  result.exit_code = peer.Wait();
  return result;
}

// --- The fixture --------------------------------------------------------------------------------

class DriverConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(const TestBackend selected, SelectedTestBackend());
    if (IsHost()) {
      owned_ = NewHostDriver();
      driver_ = owned_.get();
    } else {
      absl::StatusOr<Driver*> cuda = GetCudaDriver();
      if (!cuda.ok()) {
        if (selected == TestBackend::kCuda) {
          FAIL() << "VMM_TEST_BACKEND=cuda but: " << cuda.status();
        }
        GTEST_SKIP() << "no CUDA backend: " << cuda.status();
      }
      driver_ = *cuda;
    }
    ASSERT_OK_AND_ASSIGN(gran_, driver_->Granularity(kDevice));
    ASSERT_GT(gran_, 0u);
  }

  void TearDown() override {
    if (driver_ != nullptr && !IsHost()) {
      EXPECT_OK(driver_->SynchronizeDevice(kDevice));
    }
  }

  bool IsHost() const { return GetParam() == "host"; }
  Driver* driver() { return driver_; }

  // Free device memory. Tests expect it back at its starting value, exactly, once they have
  // freed everything: the host backend's accounting is exact, and the CUDA driver's was too on
  // an H200 with nothing else running (a busy GPU would make these checks fail).
  size_t FreeBytes() {
    absl::StatusOr<MemInfo> info = driver_->GetMemInfo(kDevice);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->free : 0;
  }

  // Expects `status` to fail with `code`. On CUDA, unless `strict_on_cuda`, any failure will do
  // (see the file comment).
  void ExpectError(const absl::Status& status, absl::StatusCode code, const char* what,
                   bool strict_on_cuda = false) {
    if (IsHost() || strict_on_cuda) {
      EXPECT_EQ(status.code(), code) << what << ": " << status;
    } else {
      EXPECT_FALSE(status.ok()) << what << " succeeded";
    }
  }

  // Whether fabric handles work here; on CUDA they need an IMEX channel, without which
  // Create() with kFabricBit fails (PermissionDenied / NotPermitted): `why` says so.
  bool FabricUsable(std::string* why) {
    absl::StatusOr<bool> supported = driver_->SupportsHandleType(kDevice, HandleType::kFabric);
    if (!supported.ok() || !*supported) {
      *why = supported.ok() ? "the device does not support fabric handles"
                            : supported.status().ToString();
      return false;
    }
    absl::StatusOr<PhysHandle> probe = driver_->Create(kDevice, gran_, kFabricBit);
    if (!probe.ok()) {
      *why = absl::StrCat("Create with kFabricBit failed: ", probe.status().ToString());
      return false;
    }
    EXPECT_OK(driver_->Release(*probe));
    return true;
  }

  // A driver with at least two devices: on the host backend a fresh one that emulates two, on
  // CUDA the CUDA backend if it has two GPUs, else nullptr (see REQUIRE_TWO_DEVICES).
  Driver* TwoDeviceDriver() {
    if (IsHost()) {
      HostDriverOptions options;
      options.device_count = 2;
      owned_two_ = NewHostDriver(options);
      return owned_two_.get();
    }
    return driver_->DeviceCount() >= 2 ? driver_ : nullptr;
  }

  // Same-process sharing: export, import, map at a second address, and see each mapping's
  // writes through the other.
  void CheckShareInProcess(HandleType type);
  // Cross-process sharing: `driver` (default: the test's) exports from device 0, the peer
  // imports for `peer_device`, checks our bytes, writes its own.
  void CheckShareWithPeer(HandleType type, Driver* driver = nullptr, int peer_device = kDevice);

  std::unique_ptr<Driver> owned_;      // the host backend of this test
  std::unique_ptr<Driver> owned_two_;  // a host backend with two devices, when a test asks
  Driver* driver_ = nullptr;
  size_t gran_ = 0;
};

#define EXPECT_ERROR(expr, code) ExpectError((expr), (code), #expr)
#define EXPECT_ERROR_STRICT(expr, code) ExpectError((expr), (code), #expr, /*strict_on_cuda=*/true)

// Skips the fabric variant of a test where fabric handles are not usable. On the host backend
// they always must be.
#define REQUIRE_FABRIC()                                               \
  do {                                                                 \
    std::string why_no_fabric;                                         \
    if (!FabricUsable(&why_no_fabric)) {                               \
      ASSERT_FALSE(IsHost()) << why_no_fabric;                         \
      GTEST_SKIP() << "fabric handles unavailable: " << why_no_fabric; \
    }                                                                  \
  } while (0)

// Declares `var`, a driver with two devices, or skips the test where there is none.
#define REQUIRE_TWO_DEVICES(var)                                                    \
  Driver* const var = TwoDeviceDriver();                                            \
  if (var == nullptr) {                                                             \
    GTEST_SKIP() << "needs two devices and " << driver()->Name() << " has "         \
                 << driver()->DeviceCount() << " (run on a machine with two GPUs)"; \
  }

// --- Device queries ---------------------------------------------------------------------------

TEST_P(DriverConformanceTest, DeviceQueries) {
  EXPECT_EQ(driver()->Name(), GetParam());
  EXPECT_GE(driver()->DeviceCount(), 1);
  EXPECT_EQ(gran_ & (gran_ - 1), 0u) << "granularity " << gran_ << " is not a power of two";

  ASSERT_OK_AND_ASSIGN(std::string uuid, driver()->DeviceUuid(kDevice));
  EXPECT_FALSE(uuid.empty());
  ASSERT_OK_AND_ASSIGN(std::string again, driver()->DeviceUuid(kDevice));
  EXPECT_EQ(uuid, again);
  if (IsHost()) {
    // "HOST-" and a UUID (8-4-4-4-12 hex digits), the same for every driver of this boot.
    EXPECT_TRUE(absl::StartsWith(uuid, "HOST-")) << uuid;
    EXPECT_EQ(uuid.size(), 5u + 36u) << uuid;
    ASSERT_OK_AND_ASSIGN(std::string other, NewHostDriver()->DeviceUuid(kDevice));
    EXPECT_EQ(uuid, other);
    EXPECT_EQ(driver()->DeviceCount(), 1);
    EXPECT_TRUE(*driver()->SupportsHandleType(kDevice, HandleType::kPosixFd));
    EXPECT_TRUE(*driver()->SupportsHandleType(kDevice, HandleType::kFabric));
  }

  const int bad = driver()->DeviceCount();
  EXPECT_ERROR_STRICT(driver()->DeviceUuid(bad).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR_STRICT(driver()->DeviceUuid(-1).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Granularity(bad).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->GetMemInfo(bad).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Create(bad, gran_, 0).status(), absl::StatusCode::kInvalidArgument);

  ASSERT_OK_AND_ASSIGN(MemInfo info, driver()->GetMemInfo(kDevice));
  EXPECT_GT(info.total, 0u);
  EXPECT_LE(info.free, info.total);
}

TEST_P(DriverConformanceTest, HasAccessAfterSetAccess) {
  const size_t size = 2 * gran_;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), size, 0));
  EXPECT_TRUE(Granted(driver(), buffer->va(), kDevice));
  EXPECT_TRUE(Granted(driver(), buffer->va() + size - 1, kDevice));
  EXPECT_ERROR_STRICT(driver()->HasAccess(buffer->va(), driver()->DeviceCount()).status(),
                      absl::StatusCode::kInvalidArgument);
  const DevPtr va = buffer->va();
  ASSERT_OK(buffer->Free());
  if (IsHost()) {
    EXPECT_EQ(driver()->HasAccess(va, kDevice).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST_P(DriverConformanceTest, TwoDevicesHaveTheirOwnUuids) {
  REQUIRE_TWO_DEVICES(two);
  ASSERT_OK_AND_ASSIGN(std::string first, two->DeviceUuid(0));
  ASSERT_OK_AND_ASSIGN(std::string second, two->DeviceUuid(1));
  EXPECT_NE(first, second);
  ASSERT_OK_AND_ASSIGN(size_t granularity, two->Granularity(1));
  EXPECT_GT(granularity, 0u);
  EXPECT_ERROR_STRICT(two->DeviceUuid(two->DeviceCount()).status(),
                      absl::StatusCode::kInvalidArgument);
  if (IsHost()) {
    EXPECT_EQ(two->DeviceCount(), 2);
    // Device 0 keeps the one-device UUID; device 1's has the same form, and every driver of
    // this boot (so every process) agrees on it.
    EXPECT_EQ(first, *driver()->DeviceUuid(0));
    EXPECT_TRUE(absl::StartsWith(second, "HOST-")) << second;
    EXPECT_EQ(second.size(), 5u + 36u) << second;
    HostDriverOptions options;
    options.device_count = 2;
    EXPECT_EQ(second, *NewHostDriver(options)->DeviceUuid(1));
    EXPECT_EQ(two->CreateStream(2).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST_P(DriverConformanceTest, TwoDevicesHasAccessFollowsSetAccess) {
  REQUIRE_TWO_DEVICES(two);
  const size_t size = 2 * gran_;
  const DevPtr last = size - 1;  // offset of a mapping's last byte

  // Access for device 0 only: device 1 has none.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> one, Buffer::Make(two, size, 0, {0}));
  for (DevPtr at : {one->va(), one->va() + last}) {
    EXPECT_TRUE(Granted(two, at, 0));
    EXPECT_FALSE(Granted(two, at, 1));
  }
  // Both in one call.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> both, Buffer::Make(two, size, 0, {0, 1}));
  for (DevPtr at : {both->va(), both->va() + last}) {
    EXPECT_TRUE(Granted(two, at, 0));
    EXPECT_TRUE(Granted(two, at, 1));
  }
  // Grants add up: granting device 1 later leaves device 0's access in place.
  ASSERT_OK(two->SetAccess(one->va(), size, {1}));
  EXPECT_TRUE(Granted(two, one->va(), 0));
  EXPECT_TRUE(Granted(two, one->va() + last, 1));

  // Device 1 writes, device 0 reads (through a peer link on GPUs).
  ASSERT_OK_AND_ASSIGN(Stream on_one, two->CreateStream(1));
  ASSERT_OK(two->MemsetAsync(both->va(), 0x3d, size, on_one));
  ASSERT_OK(two->SynchronizeStream(on_one));
  ASSERT_OK(two->DestroyStream(on_one));
  EXPECT_TRUE(AllBytesAre(two, both->va(), size, 0x3d));

  // Bad device indices.
  const int bad = two->DeviceCount();
  EXPECT_ERROR_STRICT(two->HasAccess(one->va(), bad).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR_STRICT(two->HasAccess(one->va(), -1).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR_STRICT(two->SetAccess(one->va(), size, {0, bad}),
                      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Granted(two, one->va(), 0)) << "a refused SetAccess changed the access";

  // An address with nothing mapped: an error (on CUDA, at least no access).
  ASSERT_OK_AND_ASSIGN(DevPtr hole, two->Reserve(gran_, 0));
  absl::StatusOr<bool> unmapped = two->HasAccess(hole, 0);
  if (IsHost()) {
    EXPECT_EQ(unmapped.status().code(), absl::StatusCode::kInvalidArgument) << unmapped.status();
  } else {
    EXPECT_TRUE(!unmapped.ok() || !*unmapped);
  }
  ASSERT_OK(two->Unreserve(hole, gran_));
  ASSERT_OK(one->Free());
  ASSERT_OK(both->Free());
  if (IsHost()) {
    EXPECT_EQ(two->HasAccess(one->va(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// The host backend records access per byte: grants on parts of one mapping stay apart, and a
// mapping made again at the same address starts with no access (as on CUDA, where a new
// mapping needs SetAccess before use).
TEST_P(DriverConformanceTest, TwoDevicesHostAccessIsTrackedPerPartAndPerMapping) {
  if (!IsHost()) GTEST_SKIP() << "checks the host backend's access bookkeeping";
  REQUIRE_TWO_DEVICES(two);
  ASSERT_OK_AND_ASSIGN(PhysHandle handle, two->Create(0, 2 * gran_, 0));
  ASSERT_OK_AND_ASSIGN(DevPtr va, two->Reserve(2 * gran_, 0));
  ASSERT_OK(two->Map(va, 2 * gran_, handle));
  EXPECT_FALSE(Granted(two, va, 0)) << "mapped, but no access granted yet";
  ASSERT_OK(two->SetAccess(va, gran_, {0}));
  ASSERT_OK(two->SetAccess(va + gran_, gran_, {1}));
  EXPECT_TRUE(Granted(two, va + gran_ - 1, 0));
  EXPECT_FALSE(Granted(two, va + gran_ - 1, 1));
  EXPECT_FALSE(Granted(two, va + gran_, 0));
  EXPECT_TRUE(Granted(two, va + gran_, 1));

  ASSERT_OK(two->Unmap(va, 2 * gran_));
  EXPECT_EQ(two->HasAccess(va, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(two->Map(va, 2 * gran_, handle));
  for (DevPtr at : {va, va + gran_}) {
    EXPECT_FALSE(Granted(two, at, 0));
    EXPECT_FALSE(Granted(two, at, 1));
  }
  ASSERT_OK(two->Unmap(va, 2 * gran_));
  ASSERT_OK(two->Release(handle));
  ASSERT_OK(two->Unreserve(va, 2 * gran_));
}

// --- Mapping ----------------------------------------------------------------------------------

TEST_P(DriverConformanceTest, CreateMapWriteReadRoundTrip) {
  const size_t start = FreeBytes();
  const size_t size = 2 * gran_;

  ASSERT_OK_AND_ASSIGN(PhysHandle handle, driver()->Create(kDevice, size, 0));
  EXPECT_NE(handle, 0u);
  if (IsHost()) {
    EXPECT_EQ(FreeBytes(), start - size);
  }
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(2 * size, 0));
  EXPECT_EQ(va % gran_, 0u);
  ASSERT_OK(driver()->Map(va, size, handle));
  ASSERT_OK(driver()->SetAccess(va, size, {kDevice}));

  const std::vector<uint8_t> pattern = Pattern(size, 7);
  ASSERT_OK(Write(driver(), va, pattern));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, Read(driver(), va, size));
  EXPECT_TRUE(back == pattern) << "read back differs from what was written";

  ASSERT_OK(driver()->Unmap(va, size));
  ASSERT_OK(driver()->Release(handle));
  ASSERT_OK(driver()->Unreserve(va, 2 * size));
  EXPECT_EQ(FreeBytes(), start);
}

TEST_P(DriverConformanceTest, ReserveHonoursAlignment) {
  const size_t alignment = 8 * gran_;
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(gran_, alignment));
  EXPECT_EQ(va % alignment, 0u);
  ASSERT_OK(driver()->Unreserve(va, gran_));
}

// ReserveAt lengthens a range: exactly the address asked for, a reservation of its own (given
// back alone), memory mapped on both sides of the seam reads and writes as one range. Address
// space that is taken is ResourceExhausted and leaves nothing reserved; a misaligned address is
// InvalidArgument. The address space is made free first (a range reserved and given back):
// where the CUDA driver still places the range elsewhere, it must say ResourceExhausted (the
// test then skips); the host must succeed.
TEST_P(DriverConformanceTest, ReserveAtLengthensARangeEndToEnd) {
  const size_t start = FreeBytes();
  ASSERT_OK_AND_ASSIGN(DevPtr space, driver()->Reserve(4 * gran_, 0));
  ASSERT_OK(driver()->Unreserve(space, 4 * gran_));
  absl::StatusOr<DevPtr> first = driver()->ReserveAt(space, 2 * gran_);
  if (!first.ok()) {
    EXPECT_FALSE(IsHost()) << first.status();
    EXPECT_EQ(first.status().code(), absl::StatusCode::kResourceExhausted) << first.status();
    GTEST_SKIP() << "the driver did not give back the address space: " << first.status();
  }
  const DevPtr va = *first;
  ASSERT_EQ(va, space);
  EXPECT_EQ(driver()->ReserveAt(va + gran_, 2 * gran_).status().code(),
            absl::StatusCode::kResourceExhausted)
      << "inside the first reservation";
  EXPECT_EQ(driver()->ReserveAt(va + 2 * gran_ + 1, gran_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver()->ReserveAt(va + 2 * gran_, gran_ + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<DevPtr> more = driver()->ReserveAt(va + 2 * gran_, 2 * gran_);
  if (!more.ok()) {
    EXPECT_FALSE(IsHost()) << more.status();
    EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted) << more.status();
    ASSERT_OK(driver()->Unreserve(va, 2 * gran_));
    GTEST_SKIP() << "the driver gave no address space after the range: " << more.status();
  }
  ASSERT_EQ(*more, va + 2 * gran_);
  // One chunk on each side of the seam, each mapped and granted inside its own reservation.
  ASSERT_OK_AND_ASSIGN(PhysHandle low, driver()->Create(kDevice, gran_, 0));
  ASSERT_OK_AND_ASSIGN(PhysHandle high, driver()->Create(kDevice, gran_, 0));
  ASSERT_OK(driver()->Map(va + gran_, gran_, low));
  ASSERT_OK(driver()->Map(va + 2 * gran_, gran_, high));
  ASSERT_OK(driver()->SetAccess(va + gran_, gran_, {kDevice}));
  ASSERT_OK(driver()->SetAccess(va + 2 * gran_, gran_, {kDevice}));
  ASSERT_OK(Fill(driver(), va + gran_, 0x22, 2 * gran_));
  const size_t span = gran_ / 2;
  const DevPtr across = va + 2 * gran_ - span / 2;
  const std::vector<uint8_t> pattern = Pattern(span, 5);
  ASSERT_OK(Write(driver(), across, pattern));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, Read(driver(), across, span));
  EXPECT_TRUE(back == pattern) << "a copy across the seam differs";
  EXPECT_TRUE(AllBytesAre(driver(), va + gran_, gran_ - span / 2, 0x22));
  EXPECT_TRUE(AllBytesAre(driver(), across + span, va + 3 * gran_ - (across + span), 0x22));
  if (IsHost()) {
    // The host backend refuses calls across the seam, as the pool must never make them
    // (whether CUDA takes them: CudaGpuTest.CallsAcrossTwoReservationsArePrinted).
    EXPECT_EQ(driver()->SetAccess(va + gran_, 2 * gran_, {kDevice}).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(driver()->Unmap(va + gran_, 2 * gran_).code(), absl::StatusCode::kInvalidArgument);
  }
  ASSERT_OK(driver()->Unmap(va + gran_, gran_));
  ASSERT_OK(driver()->Unmap(va + 2 * gran_, gran_));
  if (IsHost()) {
    ASSERT_OK_AND_ASSIGN(PhysHandle wide, driver()->Create(kDevice, 2 * gran_, 0));
    EXPECT_EQ(driver()->Map(va + gran_, 2 * gran_, wide).code(),
              absl::StatusCode::kInvalidArgument)
        << "one allocation across the seam";
    ASSERT_OK(driver()->Release(wide));
  }
  ASSERT_OK(driver()->Release(low));
  ASSERT_OK(driver()->Release(high));
  // Each reservation is given back alone, whole.
  EXPECT_FALSE(driver()->Unreserve(va, 4 * gran_).ok()) << "two reservations are not one";
  ASSERT_OK(driver()->Unreserve(*more, 2 * gran_));
  ASSERT_OK(driver()->Unreserve(va, 2 * gran_));
  EXPECT_EQ(FreeBytes(), start);
}

TEST_P(DriverConformanceTest, ChunksMappedContiguouslyActAsOneRange) {
  const size_t start = FreeBytes();
  ASSERT_OK_AND_ASSIGN(PhysHandle first, driver()->Create(kDevice, gran_, 0));
  ASSERT_OK_AND_ASSIGN(PhysHandle second, driver()->Create(kDevice, gran_, 0));
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(2 * gran_, 0));
  ASSERT_OK(driver()->Map(va, gran_, first));
  ASSERT_OK(driver()->Map(va + gran_, gran_, second));
  ASSERT_OK(driver()->SetAccess(va, 2 * gran_, {kDevice}));  // once, over both chunks

  ASSERT_OK(Fill(driver(), va, 0x11, 2 * gran_));
  // A copy that straddles the boundary between the two chunks.
  const size_t span = gran_ / 2;
  const DevPtr across = va + gran_ - span / 2;
  const std::vector<uint8_t> pattern = Pattern(span, 3);
  ASSERT_OK(Write(driver(), across, pattern));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, Read(driver(), across, span));
  EXPECT_TRUE(back == pattern) << "copy across the chunk boundary differs";
  EXPECT_TRUE(AllBytesAre(driver(), va, gran_ - span / 2, 0x11));
  EXPECT_TRUE(AllBytesAre(driver(), across + span, va + 2 * gran_ - (across + span), 0x11));

  ASSERT_OK(driver()->Unmap(va, 2 * gran_));  // both mappings in one call
  ASSERT_OK(driver()->Release(first));
  ASSERT_OK(driver()->Release(second));
  ASSERT_OK(driver()->Unreserve(va, 2 * gran_));
  EXPECT_EQ(FreeBytes(), start);
}

TEST_P(DriverConformanceTest, ReleaseBeforeUnmapKeepsMemoryUntilUnmapped) {
  const size_t start = FreeBytes();
  const size_t size = 4 * gran_;
  ASSERT_OK_AND_ASSIGN(PhysHandle handle, driver()->Create(kDevice, size, 0));
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(size, 0));
  ASSERT_OK(driver()->Map(va, size, handle));
  ASSERT_OK(driver()->SetAccess(va, size, {kDevice}));
  ASSERT_OK(Fill(driver(), va, 0x3c, size));

  ASSERT_OK(driver()->Release(handle));
  // Still mapped: still there, still counted.
  EXPECT_TRUE(AllBytesAre(driver(), va, size, 0x3c));
  ASSERT_OK(Fill(driver(), va, 0x44, size));
  EXPECT_TRUE(AllBytesAre(driver(), va, size, 0x44));
  const size_t while_mapped = FreeBytes();
  if (IsHost()) {
    EXPECT_EQ(while_mapped, start - size);
  }

  ASSERT_OK(driver()->Unmap(va, size));
  const size_t after = FreeBytes();
  EXPECT_GE(after, while_mapped + size) << "unmapping did not free the memory";
  EXPECT_EQ(after, start);
  ASSERT_OK(driver()->Unreserve(va, size));
}

// --- Mistakes ---------------------------------------------------------------------------------

TEST_P(DriverConformanceTest, RejectsBadSizes) {
  const size_t odd = gran_ + gran_ / 2;  // not a multiple of the granularity
  // CUDA documents cuMemCreate's size as a multiple of the granularity (else INVALID_VALUE).
  EXPECT_ERROR_STRICT(driver()->Create(kDevice, odd, 0).status(),
                      absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR_STRICT(driver()->Create(kDevice, gran_ / 2, 0).status(),
                      absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Create(kDevice, 0, 0).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Reserve(odd, 0).status(), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Reserve(0, 0).status(), absl::StatusCode::kInvalidArgument);
  if (IsHost()) {
    EXPECT_ERROR(driver()->Reserve(gran_, 3 * gran_).status(),
                 absl::StatusCode::kInvalidArgument);  // alignment not a power of two
  }

  ASSERT_OK_AND_ASSIGN(PhysHandle handle, driver()->Create(kDevice, 2 * gran_, 0));
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(4 * gran_, 0));
  EXPECT_ERROR(driver()->Map(va, odd, handle), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Map(va, 0, handle), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Map(va + gran_ / 2, gran_, handle), absl::StatusCode::kInvalidArgument);

  // None of the failed calls left anything behind.
  ASSERT_OK(driver()->Map(va, 2 * gran_, handle));
  ASSERT_OK(driver()->Unmap(va, 2 * gran_));
  ASSERT_OK(driver()->Release(handle));
  ASSERT_OK(driver()->Unreserve(va, 4 * gran_));
}

TEST_P(DriverConformanceTest, RejectsBadMappings) {
  const size_t start = FreeBytes();
  ASSERT_OK_AND_ASSIGN(PhysHandle handle, driver()->Create(kDevice, 2 * gran_, 0));
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(4 * gran_, 0));
  // An address range that was reserved and is no longer.
  ASSERT_OK_AND_ASSIGN(DevPtr gone, driver()->Reserve(2 * gran_, 0));
  ASSERT_OK(driver()->Unreserve(gone, 2 * gran_));

  // Outside any reservation.
  EXPECT_ERROR(driver()->Map(gone, gran_, handle), absl::StatusCode::kInvalidArgument);
  // Larger than the allocation, and part of it (a mapping covers a whole allocation): refused
  // by the backend itself, in the same words on both, before the driver is asked.
  for (size_t size : {3 * gran_, gran_}) {
    EXPECT_THAT(driver()->Map(va, size, handle),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("a mapping covers a whole allocation")));
  }
  // Access where nothing is mapped yet.
  EXPECT_ERROR(driver()->SetAccess(va, gran_, {kDevice}), absl::StatusCode::kInvalidArgument);

  ASSERT_OK(driver()->Map(va, 2 * gran_, handle));
  // Overlapping the mapping, exactly or in part.
  EXPECT_ERROR(driver()->Map(va, 2 * gran_, handle), absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Map(va + gran_, gran_, handle), absl::StatusCode::kInvalidArgument);
  // Access to a range that is only partly mapped.
  EXPECT_ERROR(driver()->SetAccess(va, 3 * gran_, {kDevice}), absl::StatusCode::kInvalidArgument);
  if (IsHost()) {
    // Mistakes the CUDA driver lets through (seen with driver 580): cuMemMap accepts a range
    // that runs past the end of its reservation, and cuMemUnmap accepts a range with nothing
    // mapped, part of a mapping, or a mapping plus unmapped space, unmapping whatever is there.
    EXPECT_ERROR(driver()->Map(va + 3 * gran_, 2 * gran_, handle),
                 absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Unmap(va + 2 * gran_, gran_), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Unmap(va, gran_), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Unmap(va, 3 * gran_), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->SetAccess(va, gran_, {}), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->SetAccess(va, gran_, {1}), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Unreserve(va, 4 * gran_), absl::StatusCode::kFailedPrecondition);
    EXPECT_ERROR(driver()->Unreserve(va, 2 * gran_), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Unreserve(gone, 2 * gran_), absl::StatusCode::kInvalidArgument);
  }

  // The mapping survived all of that.
  ASSERT_OK(driver()->SetAccess(va, 2 * gran_, {kDevice}));
  ASSERT_OK(Fill(driver(), va, 0x5e, 2 * gran_));
  EXPECT_TRUE(AllBytesAre(driver(), va, 2 * gran_, 0x5e));
  ASSERT_OK(driver()->Unmap(va, 2 * gran_));
  ASSERT_OK(driver()->Release(handle));
  ASSERT_OK(driver()->Unreserve(va, 4 * gran_));
  EXPECT_EQ(FreeBytes(), start);
}

TEST_P(DriverConformanceTest, RejectsBadHandles) {
  const size_t start = FreeBytes();
  EXPECT_ERROR(driver()->Release(0), absl::StatusCode::kInvalidArgument);

  // Export of a type that was not requested at Create.
  ASSERT_OK_AND_ASSIGN(PhysHandle plain, driver()->Create(kDevice, gran_, 0));
  EXPECT_ERROR(driver()->Export(plain, HandleType::kPosixFd).status(),
               absl::StatusCode::kInvalidArgument);
  EXPECT_ERROR(driver()->Export(plain, HandleType::kFabric).status(),
               absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(PhysHandle fd_only, driver()->Create(kDevice, gran_, kPosixFdBit));
  EXPECT_ERROR(driver()->Export(fd_only, HandleType::kFabric).status(),
               absl::StatusCode::kInvalidArgument);
  ASSERT_OK(driver()->Release(fd_only));

  ASSERT_OK(driver()->Release(plain));

  if (IsHost()) {
    // A released handle can be neither released again, nor mapped, nor exported. Only the
    // host backend can promise that: a CUDA handle is a pointer into the driver, dangling once
    // released (cuMemMap of a released handle crashed inside libcuda with driver 580).
    ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(gran_, 0));
    EXPECT_ERROR(driver()->Release(plain), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Map(va, gran_, plain), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->Export(fd_only, HandleType::kPosixFd).status(),
                 absl::StatusCode::kInvalidArgument);
    ASSERT_OK(driver()->Unreserve(va, gran_));

    ShareableHandle none;
    EXPECT_ERROR(driver()->Import(none).status(), absl::StatusCode::kInvalidArgument);
    ShareableHandle bad_fd;
    bad_fd.type = HandleType::kPosixFd;
    EXPECT_ERROR(driver()->Import(bad_fd).status(), absl::StatusCode::kInvalidArgument);
    // A descriptor that is not a host driver allocation.
    int pipe_fds[2];
    ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
    UniqueFd keep_read(pipe_fds[0]);
    ShareableHandle pipe_handle;
    pipe_handle.type = HandleType::kPosixFd;
    pipe_handle.fd.reset(pipe_fds[1]);
    EXPECT_ERROR(driver()->Import(pipe_handle).status(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(FreeBytes(), start);
}

// --- Out of memory ----------------------------------------------------------------------------

TEST_P(DriverConformanceTest, OutOfMemoryIsResourceExhaustedAndRecoverable) {
  // The host backend gets a small capacity; on CUDA, 1 TiB is more than any GPU has.
  std::unique_ptr<Driver> small;
  Driver* driver = this->driver();
  size_t too_much = (size_t{1} << 40) / gran_ * gran_;
  if (IsHost()) {
    HostDriverOptions options;
    options.capacity = 4 * gran_;
    small = NewHostDriver(options);
    driver = small.get();
    too_much = options.capacity + gran_;
    ASSERT_OK_AND_ASSIGN(MemInfo info, driver->GetMemInfo(kDevice));
    EXPECT_EQ(info.total, options.capacity);
    EXPECT_EQ(info.free, options.capacity);
  }

  absl::StatusOr<PhysHandle> failed = driver->Create(kDevice, too_much, 0);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  if (IsHost()) {
    EXPECT_THAT(failed.status().message(), HasSubstr("out of memory"));
    // Filling the capacity exactly works, one more granule does not, and a release makes room.
    ASSERT_OK_AND_ASSIGN(PhysHandle all, driver->Create(kDevice, 4 * gran_, 0));
    EXPECT_EQ(driver->Create(kDevice, gran_, 0).status().code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(driver->GetMemInfo(kDevice)->free, 0u);
    ASSERT_OK(driver->Release(all));
  }

  // The driver still works.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver, gran_, 0));
  ASSERT_OK(Fill(driver, buffer->va(), 0x6b, gran_));
  EXPECT_TRUE(AllBytesAre(driver, buffer->va(), gran_, 0x6b));
  ASSERT_OK(buffer->Free());
}

// --- Sharing in one process ---------------------------------------------------------------------

void DriverConformanceTest::CheckShareInProcess(HandleType type) {
  const size_t start = FreeBytes();
  const size_t size = 2 * gran_;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> original,
                       Buffer::Make(driver(), size, HandleTypeBit(type)));
  ASSERT_OK_AND_ASSIGN(ShareableHandle shared, driver()->Export(original->handle(), type));
  EXPECT_EQ(shared.type, type);
  if (type == HandleType::kPosixFd) {
    EXPECT_TRUE(shared.fd.valid());
    // A copy in a program the process execs would hold the memory for that program's life.
    EXPECT_NE(::fcntl(shared.fd.get(), F_GETFD) & FD_CLOEXEC, 0) << "not close-on-exec";
  }

  ASSERT_OK_AND_ASSIGN(PhysHandle imported_handle, driver()->Import(shared));
  if (type == HandleType::kPosixFd) {
    EXPECT_NE(::fcntl(shared.fd.get(), F_GETFD), -1) << "Import consumed the descriptor";
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> imported,
                       Buffer::Adopt(driver(), imported_handle, size));
  EXPECT_NE(imported->va(), original->va());

  ASSERT_OK(Fill(driver(), original->va(), 0x11, size));
  EXPECT_TRUE(AllBytesAre(driver(), imported->va(), size, 0x11));
  const std::vector<uint8_t> pattern = Pattern(gran_, 9);
  ASSERT_OK(Write(driver(), imported->va() + gran_ / 2, pattern));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back,
                       Read(driver(), original->va() + gran_ / 2, gran_));
  EXPECT_TRUE(back == pattern) << "write through the import not seen through the original";

  // The original can go first; the import keeps the memory.
  ASSERT_OK(original->Free());
  EXPECT_TRUE(AllBytesAre(driver(), imported->va(), gran_ / 2, 0x11));
  ASSERT_OK(imported->Free());
  // On CUDA an exported descriptor holds the memory too, until it is closed.
  shared.fd.reset();
  EXPECT_EQ(FreeBytes(), start);
}

TEST_P(DriverConformanceTest, ExportImportPosixFdInProcess) {
  CheckShareInProcess(HandleType::kPosixFd);
}

TEST_P(DriverConformanceTest, ExportImportFabricInProcess) {
  REQUIRE_FABRIC();
  CheckShareInProcess(HandleType::kFabric);
}

// --- Sharing with another process ---------------------------------------------------------------

void DriverConformanceTest::CheckShareWithPeer(HandleType type, Driver* driver, int peer_device) {
  if (driver == nullptr) driver = this->driver();
  const size_t size = 2 * gran_;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer,
                       Buffer::Make(driver, size, HandleTypeBit(type)));
  ASSERT_OK(Fill(driver, buffer->va(), 0x5a, size));
  ASSERT_OK_AND_ASSIGN(ShareableHandle shared, driver->Export(buffer->handle(), type));

  std::vector<std::string> args = {absl::StrCat("--backend=", GetParam()),
                                   absl::StrCat("--size=", size), "--expect=90",
                                   "--write=165",  // 0x5a, then 0xa5
                                   absl::StrCat("--device=", peer_device)};
  // The host backend of vmm_peer emulates as many devices as the test's driver.
  const std::vector<std::string> env = {
      absl::StrCat("VMM_HOST_DEVICES=", driver->Name() == "host" ? driver->DeviceCount() : 1)};
  UniqueFd inherited;
  if (type == HandleType::kPosixFd) {
    // A duplicate without FD_CLOEXEC, so that the peer inherits it under the same number.
    inherited.reset(::fcntl(shared.fd.get(), F_DUPFD, 3));
    ASSERT_TRUE(inherited.valid()) << std::strerror(errno);
    args.push_back("--type=fd");
    args.push_back(absl::StrCat("--fd=", inherited.get()));
  } else {
    args.push_back("--type=fabric");
    args.push_back(absl::StrCat("--fabric=", FabricHex(shared.fabric)));
  }
  ASSERT_OK_AND_ASSIGN(PeerResult peer, RunPeer(args, env));
  inherited.reset();
  ASSERT_EQ(peer.exit_code, kPeerOk) << peer.output;
  EXPECT_TRUE(AllBytesAre(driver, buffer->va(), size, 0xa5)) << "the peer's writes are not seen";
  ASSERT_OK(buffer->Free());
}

TEST_P(DriverConformanceTest, CrossProcessPosixFd) { CheckShareWithPeer(HandleType::kPosixFd); }

TEST_P(DriverConformanceTest, CrossProcessFabric) {
  REQUIRE_FABRIC();
  CheckShareWithPeer(HandleType::kFabric);
}

// Process A (this one) exports from device 0; process B maps it for device 1 only, reads and
// writes it there (over the peer link on GPUs).
TEST_P(DriverConformanceTest, TwoDevicesCrossProcessPosixFdOnTheOtherDevice) {
  REQUIRE_TWO_DEVICES(two);
  CheckShareWithPeer(HandleType::kPosixFd, two, /*peer_device=*/1);
}

TEST_P(DriverConformanceTest, TwoDevicesCrossProcessFabricOnTheOtherDevice) {
  REQUIRE_TWO_DEVICES(two);
  REQUIRE_FABRIC();
  CheckShareWithPeer(HandleType::kFabric, two, /*peer_device=*/1);
}

TEST_P(DriverConformanceTest, CrossProcessStaleFabricHandleFailsCleanly) {
  REQUIRE_FABRIC();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), gran_, kFabricBit));
  ASSERT_OK_AND_ASSIGN(ShareableHandle shared,
                       driver()->Export(buffer->handle(), HandleType::kFabric));
  ASSERT_OK(buffer->Free());  // unmapped and released before the peer imports

  ASSERT_OK_AND_ASSIGN(PeerResult peer,
                       RunPeer({absl::StrCat("--backend=", GetParam()), "--type=fabric",
                                absl::StrCat("--fabric=", FabricHex(shared.fabric)),
                                absl::StrCat("--size=", gran_)}));
  EXPECT_EQ(peer.exit_code, kPeerImportFailed) << peer.output;
  EXPECT_THAT(peer.output, HasSubstr("Import"));
  if (IsHost()) {
    EXPECT_THAT(peer.output, HasSubstr("stale"));
  }
}

TEST_P(DriverConformanceTest, ForgedFabricHandleFailsCleanly) {
  REQUIRE_FABRIC();
  std::mt19937_64 random(std::random_device{}());
  for (int i = 0; i < 16; ++i) {
    ShareableHandle forged;
    forged.type = HandleType::kFabric;
    for (uint8_t& byte : forged.fabric) byte = static_cast<uint8_t>(random());
    EXPECT_ERROR(driver()->Import(forged).status(), absl::StatusCode::kInvalidArgument);
  }
  // The driver still works.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), gran_, 0));
  ASSERT_OK(buffer->Free());
}

// The host backend's fabric handle (layout in host_driver.cc) with one field changed at a time.
TEST_P(DriverConformanceTest, HostFabricHandleTamperingIsDetected) {
  if (!IsHost()) GTEST_SKIP() << "checks the host backend's fabric handle format";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), gran_, kFabricBit));
  ASSERT_OK_AND_ASSIGN(ShareableHandle good,
                       driver()->Export(buffer->handle(), HandleType::kFabric));
  EXPECT_EQ(std::memcmp(good.fabric.data(), "VMMHOSTF", 8), 0);

  struct Case {
    const char* what;
    size_t offset;  // byte to change
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"magic", 0, absl::StatusCode::kInvalidArgument, "not a host fabric handle"},
      {"version", 8, absl::StatusCode::kInvalidArgument, "version"},
      {"pid", 14, absl::StatusCode::kUnavailable, "exited"},  // no such process
      {"fd", 17, absl::StatusCode::kNotFound, "stale"},   // no such descriptor
      {"reserved", 20, absl::StatusCode::kInvalidArgument, "malformed"},
      {"inode", 24, absl::StatusCode::kNotFound, "stale"},   // the fd names another file
      {"size", 33, absl::StatusCode::kInvalidArgument, "forged"},  // the file, misdescribed
      {"tag", 40, absl::StatusCode::kNotFound, "stale"},     // another allocation
      {"boot id", 56, absl::StatusCode::kFailedPrecondition, "another machine"},
  };
  for (const Case& c : cases) {
    ShareableHandle bad;
    bad.type = HandleType::kFabric;
    bad.fabric = good.fabric;
    bad.fabric[c.offset] ^= 0x5a;
    absl::StatusOr<PhysHandle> imported = driver()->Import(bad);
    EXPECT_EQ(imported.status().code(), c.code) << c.what << ": " << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(c.message)) << c.what;
  }

  // The untouched handle still imports, and re-exports.
  ASSERT_OK_AND_ASSIGN(PhysHandle imported, driver()->Import(good));
  ASSERT_OK_AND_ASSIGN(ShareableHandle again, driver()->Export(imported, HandleType::kFabric));
  ASSERT_OK_AND_ASSIGN(PhysHandle imported_again, driver()->Import(again));
  ASSERT_OK(driver()->Release(imported));
  ASSERT_OK(driver()->Release(imported_again));
  ASSERT_OK(buffer->Free());
}

// The bytes of a host fabric handle (host_memfd.h) at `offset`, little-endian.
void PutLe(FabricHandle& h, size_t offset, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) h[offset + i] = static_cast<uint8_t>(value >> (8 * i));
}
uint64_t GetLe(const FabricHandle& h, size_t offset, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(h[offset + i]) << (8 * i);
  return value;
}

// A memfd named as the host backend names its own ("vmm-" and the 32 hex digits of `tag`),
// `size` bytes, with `seals` added (MFD_ALLOW_SEALING only when there are any).
UniqueFd LookalikeMemfd(const uint8_t* tag, size_t size, int seals) {
  const std::string name = absl::StrCat(
      "vmm-", absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(tag), 16)));
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | (seals != 0 ? MFD_ALLOW_SEALING : 0)));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  if (seals != 0) {
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

// Exported memory cannot be resized by anyone holding it, through the exported fd or the
// exporter's own fd in /proc: truncating it would kill every process mapping it (SIGBUS).
TEST_P(DriverConformanceTest, HostMemfdsAreSealedAgainstResizing) {
  if (!IsHost()) GTEST_SKIP() << "the host backend's memfds";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer,
                       Buffer::Make(driver(), gran_, kPosixFdBit | kFabricBit));
  ASSERT_OK(Fill(driver(), buffer->va(), 0x5c, gran_));
  ASSERT_OK_AND_ASSIGN(ShareableHandle fd, driver()->Export(buffer->handle(), HandleType::kPosixFd));
  for (off_t size : {off_t{0}, static_cast<off_t>(gran_ / 2), static_cast<off_t>(2 * gran_)}) {
    errno = 0;
    EXPECT_EQ(::ftruncate(fd.fd.get(), size), -1) << "resized to " << size;
    EXPECT_EQ(errno, EPERM);
  }
  ASSERT_OK_AND_ASSIGN(ShareableHandle fabric,
                       driver()->Export(buffer->handle(), HandleType::kFabric));
  const std::string path = absl::StrCat("/proc/self/fd/", GetLe(fabric.fabric, 16, 4));
  UniqueFd reopened(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(reopened.valid()) << path;
  errno = 0;
  EXPECT_EQ(::ftruncate(reopened.get(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::fcntl(reopened.get(), F_ADD_SEALS, F_SEAL_WRITE), -1) << "further seals refused";
  EXPECT_TRUE(AllBytesAre(driver(), buffer->va(), gran_, 0x5c));
  ASSERT_OK(buffer->Free());
}

// A memfd named like the host backend's but not sealed (or not fully) is refused, whether it
// comes as an fd or through a forged fabric handle naming it in this process's /proc.
TEST_P(DriverConformanceTest, HostImportRefusesAnUnsealedMemfd) {
  if (!IsHost()) GTEST_SKIP() << "the host backend's memfds";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), gran_, kFabricBit));
  ASSERT_OK_AND_ASSIGN(ShareableHandle real,
                       driver()->Export(buffer->handle(), HandleType::kFabric));
  const size_t start = FreeBytes();
  for (int seals : {0, F_SEAL_GROW | F_SEAL_SEAL, F_SEAL_SHRINK | F_SEAL_GROW}) {
    SCOPED_TRACE(absl::StrCat("seals 0x", absl::Hex(seals)));
    UniqueFd lookalike = LookalikeMemfd(real.fabric.data() + 40, gran_, seals);
    ShareableHandle by_fd;
    by_fd.type = HandleType::kPosixFd;
    by_fd.fd.reset(::fcntl(lookalike.get(), F_DUPFD_CLOEXEC, 0));
    EXPECT_THAT(driver()->Import(by_fd),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not sealed")));
    // The real handle, pointed at the lookalike: same pid, tag and size; its fd and inode.
    ShareableHandle forged;
    forged.type = HandleType::kFabric;
    forged.fabric = real.fabric;
    struct stat st;
    ASSERT_EQ(::fstat(lookalike.get(), &st), 0);
    PutLe(forged.fabric, 16, static_cast<uint64_t>(lookalike.get()), 4);
    PutLe(forged.fabric, 24, static_cast<uint64_t>(st.st_ino), 8);
    EXPECT_THAT(driver()->Import(forged),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not sealed")));
  }
  EXPECT_EQ(FreeBytes(), start);
  // A lookalike sealed as the backend seals its own is accepted: the check is the seals.
  UniqueFd sealed =
      LookalikeMemfd(real.fabric.data() + 40, gran_, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  ShareableHandle by_fd;
  by_fd.type = HandleType::kPosixFd;
  by_fd.fd.reset(::fcntl(sealed.get(), F_DUPFD_CLOEXEC, 0));
  ASSERT_OK_AND_ASSIGN(PhysHandle accepted, driver()->Import(by_fd));
  ASSERT_OK(driver()->Release(accepted));
  ASSERT_OK(buffer->Free());
}

// A fabric handle whose fd number the exporter has since reused for another file is stale
// (NotFound, as when the fd is gone), not malformed (InvalidArgument).
TEST_P(DriverConformanceTest, HostFabricHandleWhoseFdWasReusedIsStale) {
  if (!IsHost()) GTEST_SKIP() << "the host backend's fabric handles";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> other, Buffer::Make(driver(), gran_, kPosixFdBit));
  ASSERT_OK_AND_ASSIGN(ShareableHandle other_fd,
                       driver()->Export(other->handle(), HandleType::kPosixFd));
  UniqueFd regular(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(regular.valid());
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  struct Case {
    const char* what;
    int file;
  };
  for (const Case& c : {Case{"another host allocation", other_fd.fd.get()},
                        Case{"a regular file", regular.get()}, Case{"a pipe", pipe_read.get()}}) {
    SCOPED_TRACE(c.what);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer,
                         Buffer::Make(driver(), gran_, kFabricBit));
    ASSERT_OK_AND_ASSIGN(ShareableHandle stale,
                         driver()->Export(buffer->handle(), HandleType::kFabric));
    ASSERT_OK(buffer->Free());  // the exporter's fd is closed...
    const int number = static_cast<int>(GetLe(stale.fabric, 16, 4));
    ASSERT_EQ(::dup3(c.file, number, O_CLOEXEC), number);  // ...and its number reused
    EXPECT_THAT(driver()->Import(stale),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")));
    ::close(number);
  }
  ASSERT_OK(other->Free());
}

// Imports of one physical allocation, however many and however often mapped, count its bytes
// once: duplicated handles must not use up the capacity of the importing driver.
TEST_P(DriverConformanceTest, HostImportsOfOneAllocationCountItOnce) {
  if (!IsHost()) GTEST_SKIP() << "the host backend's capacity";
  HostDriverOptions options;
  options.granularity = gran_;
  options.capacity = 8 * gran_;
  std::unique_ptr<Driver> small = NewHostDriver(options);
  ASSERT_OK_AND_ASSIGN(PhysHandle original, small->Create(kDevice, 2 * gran_, kFabricBit));
  ASSERT_OK_AND_ASSIGN(ShareableHandle shared, small->Export(original, HandleType::kFabric));
  std::vector<PhysHandle> imports;
  for (int i = 0; i < 100; ++i) {
    ASSERT_OK_AND_ASSIGN(PhysHandle imported, small->Import(shared));
    imports.push_back(imported);
  }
  const int mapped = 5;
  ASSERT_OK_AND_ASSIGN(DevPtr va, small->Reserve(mapped * 2 * gran_, 0));
  for (int i = 0; i < mapped; ++i) ASSERT_OK(small->Map(va + i * 2 * gran_, 2 * gran_, imports[i]));
  for (PhysHandle imported : imports) ASSERT_OK(small->Release(imported));
  EXPECT_EQ(small->GetMemInfo(kDevice)->free, 6 * gran_);
  // The rest of the capacity is still there to create.
  ASSERT_OK_AND_ASSIGN(PhysHandle rest, small->Create(kDevice, 6 * gran_, 0));
  ASSERT_OK(small->Release(rest));
  // The bytes stay counted while any mapping or the original is left, and only then return.
  ASSERT_OK(small->Release(original));
  EXPECT_EQ(small->GetMemInfo(kDevice)->free, 6 * gran_);
  ASSERT_OK(small->Unmap(va, mapped * 2 * gran_));
  EXPECT_EQ(small->GetMemInfo(kDevice)->free, 8 * gran_);
  ASSERT_OK(small->Unreserve(va, mapped * 2 * gran_));
}

// --- Streams and events -------------------------------------------------------------------------

// No stream of vmm's own, nor the legacy stream, is capturing a graph unless someone began a
// capture there (the host backend's never do).
TEST_P(DriverConformanceTest, StreamsAreNotCapturingUnlessACaptureBegan) {
  ASSERT_OK_AND_ASSIGN(Stream stream, driver()->CreateStream(kDevice));
  ASSERT_OK_AND_ASSIGN(bool capturing, driver()->StreamCapturing(stream));
  EXPECT_FALSE(capturing);
  ASSERT_OK_AND_ASSIGN(capturing, driver()->StreamCapturing(0));
  EXPECT_FALSE(capturing);
  ASSERT_OK(driver()->DestroyStream(stream));
}

TEST_P(DriverConformanceTest, EventsFollowStreamOrder) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), gran_, 0));
  ASSERT_OK(Fill(driver(), buffer->va(), 0, gran_));
  ASSERT_OK_AND_ASSIGN(Stream stream, driver()->CreateStream(kDevice));
  ASSERT_OK_AND_ASSIGN(Stream idle, driver()->CreateStream(kDevice));
  ASSERT_OK_AND_ASSIGN(Event event, driver()->CreateEvent(kDevice));
  EXPECT_TRUE(*driver()->EventDone(event)) << "a never-recorded event is done";

  Gate gate;
  // Whatever happens below, the gate opens and the streams drain before `gate` goes away.
  auto release = absl::MakeCleanup([&] {
    gate.open.store(true);
    driver()->SynchronizeStream(stream).IgnoreError();
  });
  ASSERT_OK(driver()->LaunchHostFunc(stream, &Gate::Wait, &gate));
  ASSERT_OK(driver()->MemsetAsync(buffer->va(), 0x77, gran_, stream));
  ASSERT_OK(driver()->RecordEvent(event, stream));
  while (!gate.entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(*driver()->EventDone(event)) << "the event passed a blocked host function";

  // Re-recording replaces what the event captures: on an idle stream it completes...
  ASSERT_OK(driver()->RecordEvent(event, idle));
  ASSERT_OK(driver()->SynchronizeStream(idle));
  EXPECT_TRUE(*driver()->EventDone(event));
  // ...and on the blocked stream again it does not.
  ASSERT_OK(driver()->RecordEvent(event, stream));
  EXPECT_FALSE(*driver()->EventDone(event));

  gate.open.store(true);
  ASSERT_OK(driver()->SynchronizeEvent(event));
  EXPECT_TRUE(*driver()->EventDone(event));
  ASSERT_OK(driver()->SynchronizeStream(stream));
  ASSERT_OK(driver()->SynchronizeDevice(kDevice));
  EXPECT_TRUE(AllBytesAre(driver(), buffer->va(), gran_, 0x77));

  ASSERT_OK(driver()->DestroyEvent(event));
  std::move(release).Invoke();
  ASSERT_OK(driver()->DestroyStream(stream));
  ASSERT_OK(driver()->DestroyStream(idle));
  if (IsHost()) {
    EXPECT_ERROR(driver()->DestroyStream(stream), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->SynchronizeStream(stream), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->MemsetAsync(buffer->va(), 0, gran_, stream),
                 absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->EventDone(event).status(), absl::StatusCode::kInvalidArgument);
    EXPECT_ERROR(driver()->DestroyEvent(event), absl::StatusCode::kInvalidArgument);
  }
  ASSERT_OK(buffer->Free());
}

TEST_P(DriverConformanceTest, StreamRunsMemsetAndMemcpyInOrder) {
  const size_t part = gran_ / 4;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Buffer> buffer, Buffer::Make(driver(), gran_, 0));
  const DevPtr a = buffer->va();
  const DevPtr b = a + part;
  const DevPtr c = a + 2 * part;
  ASSERT_OK(Fill(driver(), a, 0, gran_));
  ASSERT_OK_AND_ASSIGN(Stream stream, driver()->CreateStream(kDevice));

  // Queue everything behind a closed gate, so nothing can run early. (Only device-side work
  // while it is closed: CUDA copies to or from pageable host memory may wait for the stream.)
  Gate gate;
  auto release = absl::MakeCleanup([&] {
    gate.open.store(true);
    driver()->SynchronizeStream(stream).IgnoreError();
  });
  ASSERT_OK(driver()->LaunchHostFunc(stream, &Gate::Wait, &gate));
  ASSERT_OK(driver()->MemsetAsync(a, 1, part, stream));
  ASSERT_OK(driver()->MemcpyAsync(b, a, part, stream));
  ASSERT_OK(driver()->MemsetAsync(a, 2, part, stream));
  ASSERT_OK(driver()->MemcpyAsync(c, a, part, stream));
  ASSERT_OK(driver()->MemsetAsync(a, 3, part, stream));
  gate.open.store(true);
  ASSERT_OK(driver()->SynchronizeStream(stream));

  EXPECT_TRUE(AllBytesAre(driver(), a, part, 3));
  EXPECT_TRUE(AllBytesAre(driver(), b, part, 1));
  EXPECT_TRUE(AllBytesAre(driver(), c, part, 2));
  EXPECT_TRUE(AllBytesAre(driver(), c + part, part, 0));
  std::move(release).Invoke();
  ASSERT_OK(driver()->DestroyStream(stream));
  ASSERT_OK(buffer->Free());
}

// --- Thread safety ------------------------------------------------------------------------------

TEST_P(DriverConformanceTest, ConcurrentMapUnmapReleaseInOneRange) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 8;
  const size_t start = FreeBytes();
  const size_t slot = 2 * gran_;  // each thread owns one slot of the range
  ASSERT_OK_AND_ASSIGN(DevPtr va, driver()->Reserve(kThreads * slot, 0));

  // One round: create, map, access, write, check, then unmap and release (in either order).
  auto round = [&](DevPtr at, int t, int r) -> absl::Status {
    const size_t size = (r % 2 == 0) ? gran_ : 2 * gran_;
    const uint8_t value = static_cast<uint8_t>(16 * t + r + 1);
    VMM_ASSIGN_OR_RETURN(PhysHandle handle, driver()->Create(kDevice, size, 0));
    VMM_RETURN_IF_ERROR(driver()->Map(at, size, handle));
    VMM_RETURN_IF_ERROR(driver()->SetAccess(at, size, {kDevice}));
    VMM_RETURN_IF_ERROR(Fill(driver(), at, value, size));
    VMM_ASSIGN_OR_RETURN(std::vector<uint8_t> back, Read(driver(), at, size));
    for (uint8_t byte : back) {
      if (byte != value) return absl::DataLossError(absl::StrCat("thread ", t, " saw ", byte));
    }
    if (r % 3 == 0) {
      VMM_RETURN_IF_ERROR(driver()->Release(handle));
      return driver()->Unmap(at, size);
    }
    VMM_RETURN_IF_ERROR(driver()->Unmap(at, size));
    return driver()->Release(handle);
  };

  std::vector<absl::Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds && results[t].ok(); ++r) results[t] = round(va + t * slot, t, r);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_OK(results[t]);

  ASSERT_OK(driver()->Unreserve(va, kThreads * slot));
  EXPECT_EQ(FreeBytes(), start);
}

INSTANTIATE_TEST_SUITE_P(Backends, DriverConformanceTest, ::testing::Values("host", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace vmm
