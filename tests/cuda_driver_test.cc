// Tests of the CUDA backend's loading, its CUresult -> Status mapping, and the backend choice
// of driver_factory.h. Runs everywhere: without a driver it checks that the CUDA backend says
// so cleanly and that the host backend is chosen; with a driver and a GPU it also runs a short
// smoke test of the CUDA backend itself (the full contract is driver_conformance_test's).
#include "allocator/cuda_driver.h"

#include <fcntl.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "allocator/cuda_status.h"
#include "allocator/driver.h"
#include "allocator/driver_error.h"
#include "allocator/driver_factory.h"
#include "allocator/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/scoped_env.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

bool CudaAvailable() { return GetCudaDriver().ok(); }

// --- CUresult -> Status ----------------------------------------------------------------------

TEST(CudaStatusTest, CodesFollowMeaning) {
  struct Case {
    CUresult result;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {CUDA_SUCCESS, absl::StatusCode::kOk},
      {CUDA_ERROR_OUT_OF_MEMORY, absl::StatusCode::kResourceExhausted},
      {CUDA_ERROR_INVALID_VALUE, absl::StatusCode::kInvalidArgument},
      {CUDA_ERROR_INVALID_HANDLE, absl::StatusCode::kInvalidArgument},
      {CUDA_ERROR_INVALID_DEVICE, absl::StatusCode::kInvalidArgument},
      {CUDA_ERROR_NOT_FOUND, absl::StatusCode::kInvalidArgument},
      {CUDA_ERROR_NOT_PERMITTED, absl::StatusCode::kPermissionDenied},
      {CUDA_ERROR_NOT_SUPPORTED, absl::StatusCode::kUnimplemented},
      {CUDA_ERROR_NOT_INITIALIZED, absl::StatusCode::kFailedPrecondition},
      {CUDA_ERROR_DEINITIALIZED, absl::StatusCode::kFailedPrecondition},
      {CUDA_ERROR_NO_DEVICE, absl::StatusCode::kFailedPrecondition},
      {CUDA_ERROR_CAPTURED_EVENT, absl::StatusCode::kUnavailable},
      {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, absl::StatusCode::kUnavailable},
      {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, absl::StatusCode::kUnavailable},
      {CUDA_ERROR_INVALID_CONTEXT, absl::StatusCode::kInternal},
      {CUDA_ERROR_LAUNCH_FAILED, absl::StatusCode::kInternal},
      {CUDA_ERROR_ILLEGAL_ADDRESS, absl::StatusCode::kInternal},
      {CUDA_ERROR_NOT_READY, absl::StatusCode::kInternal},
      {CUDA_ERROR_UNKNOWN, absl::StatusCode::kInternal},
      {static_cast<CUresult>(998), absl::StatusCode::kInternal},  // no such error (yet)
  };
  for (const Case& c : cases) {
    EXPECT_EQ(CudaErrorCode(c.result), c.code) << "CUresult " << static_cast<int>(c.result);
    EXPECT_EQ(CudaErrorStatus(c.result, "cuX", "NAME", "description").code(), c.code)
        << "CUresult " << static_cast<int>(c.result);
  }
}

TEST(CudaStatusTest, MessageNamesCallErrorAndContext) {
  absl::Status status = CudaErrorStatus(CUDA_ERROR_INVALID_VALUE, "cuMemMap",
                                        "CUDA_ERROR_INVALID_VALUE", "invalid argument");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "cuMemMap: CUDA_ERROR_INVALID_VALUE (invalid argument)");

  status = CudaErrorStatus(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY",
                           "out of memory", "device 0, 2097152 bytes");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory); device 0, 2097152 bytes");
}

// The CUresult rides along, so that callers raise CUDA's error (torch.AcceleratorError) for a
// device-side assert without reading the message; a context added above keeps it.
TEST(CudaStatusTest, CarriesTheCUresult) {
  for (CUresult result : {CUDA_ERROR_ASSERT, CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_OUT_OF_MEMORY,
                          CUDA_ERROR_INVALID_VALUE, static_cast<CUresult>(998)}) {
    const absl::Status status = CudaErrorStatus(result, "cuX", "NAME", "description");
    EXPECT_EQ(DriverErrorOf(status), static_cast<int32_t>(result));
    const absl::Status wrapped = WithContext(status, "importing a buffer");
    EXPECT_EQ(wrapped.code(), status.code());
    EXPECT_EQ(wrapped.message(), absl::StrCat("importing a buffer: ", status.message()));
    EXPECT_EQ(DriverErrorOf(wrapped), static_cast<int32_t>(result));
  }
  EXPECT_EQ(DriverErrorOf(absl::InternalError("vmm's own")), 0);
  EXPECT_EQ(DriverErrorOf(absl::OkStatus()), 0);
  EXPECT_EQ(DriverErrorOf(WithDriverError(absl::OkStatus(), 710)), 0);
  EXPECT_EQ(DriverErrorOf(WithDriverError(absl::InternalError("x"), -5)), -5);
}

TEST(CudaStatusTest, SuccessIsOk) {
  EXPECT_TRUE(CudaErrorStatus(CUDA_SUCCESS, "cuMemMap", "CUDA_SUCCESS", "no error").ok());
}

// --- Loading -------------------------------------------------------------------------------

TEST(CudaDriverTest, LoadsOrSaysWhyNot) {
  absl::StatusOr<Driver*> driver = GetCudaDriver();
  if (driver.ok()) {
    EXPECT_EQ((*driver)->Name(), "cuda");
    EXPECT_GT((*driver)->DeviceCount(), 0);
  } else {
    EXPECT_EQ(driver.status().code(), absl::StatusCode::kFailedPrecondition) << driver.status();
    EXPECT_THAT(driver.status().message(), HasSubstr("no CUDA"));
  }
}

TEST(CudaDriverTest, SameAnswerEveryCall) {
  absl::StatusOr<Driver*> first = GetCudaDriver();
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<Driver*>> results(8);
  for (auto& result : results) {
    threads.emplace_back([&result] { result = GetCudaDriver(); });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& result : results) EXPECT_EQ(result, first);
}

// --- Choosing a backend --------------------------------------------------------------------

TEST(DriverFactoryTest, DriverByName) {
  absl::StatusOr<Driver*> host = DriverByName("host");
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->Name(), "host");

  EXPECT_EQ(DriverByName("cuda"), GetCudaDriver());

  absl::StatusOr<Driver*> bogus = DriverByName("bogus");
  EXPECT_EQ(bogus.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bogus.status().message(), HasSubstr("bogus"));
  EXPECT_THAT(bogus.status().message(), HasSubstr("cuda"));
  EXPECT_THAT(bogus.status().message(), HasSubstr("host"));
}

TEST(DriverFactoryTest, DefaultPrefersCudaElseHost) {
  const std::string expected = CudaAvailable() ? "cuda" : "host";
  for (const std::optional<std::string>& value :
       {std::optional<std::string>(), std::optional<std::string>("")}) {
    ScopedEnv env("VMM_BACKEND", value);
    absl::StatusOr<Driver*> driver = DefaultDriver();
    ASSERT_TRUE(driver.ok()) << driver.status();
    EXPECT_EQ((*driver)->Name(), expected);
  }
}

TEST(DriverFactoryTest, BackendVariableForcesChoice) {
  {
    ScopedEnv env("VMM_BACKEND", "host");
    absl::StatusOr<Driver*> driver = DefaultDriver();
    ASSERT_TRUE(driver.ok()) << driver.status();
    EXPECT_EQ((*driver)->Name(), "host");
  }
  {
    ScopedEnv env("VMM_BACKEND", "cuda");
    absl::StatusOr<Driver*> driver = DefaultDriver();
    if (CudaAvailable()) {
      ASSERT_TRUE(driver.ok()) << driver.status();
      EXPECT_EQ((*driver)->Name(), "cuda");
    } else {
      EXPECT_EQ(driver.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(driver.status().message(), HasSubstr("no CUDA"));
    }
  }
  {
    ScopedEnv env("VMM_BACKEND", "bogus");
    absl::StatusOr<Driver*> driver = DefaultDriver();
    EXPECT_EQ(driver.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(driver.status().message(), HasSubstr("VMM_BACKEND=bogus"));
  }
}

// --- With a GPU ----------------------------------------------------------------------------

class CudaGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<Driver*> driver = GetCudaDriver();
    if (!driver.ok()) GTEST_SKIP() << "no CUDA driver or GPU: " << driver.status();
    driver_ = *driver;
    absl::StatusOr<size_t> granularity = driver_->Granularity(0);
    ASSERT_TRUE(granularity.ok()) << granularity.status();
    granularity_ = *granularity;
  }

  Driver* driver_ = nullptr;
  size_t granularity_ = 0;
};

TEST_F(CudaGpuTest, DeviceQueries) {
  for (int device = 0; device < driver_->DeviceCount(); ++device) {
    absl::StatusOr<std::string> uuid = driver_->DeviceUuid(device);
    ASSERT_TRUE(uuid.ok()) << uuid.status();
    EXPECT_THAT(*uuid, MatchesRegex("GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-"
                                    "[0-9a-f]{12}"));
    absl::StatusOr<size_t> granularity = driver_->Granularity(device);
    ASSERT_TRUE(granularity.ok()) << granularity.status();
    EXPECT_EQ(*granularity & (*granularity - 1), 0u);
    absl::StatusOr<MemInfo> info = driver_->GetMemInfo(device);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_GT(info->total, 0u);
    EXPECT_LE(info->free, info->total);
    for (HandleType type : {HandleType::kNone, HandleType::kPosixFd, HandleType::kFabric}) {
      absl::StatusOr<bool> supported = driver_->SupportsHandleType(device, type);
      ASSERT_TRUE(supported.ok()) << supported.status();
      std::printf("device %d (%s): granularity %zu, %s supported: %d\n", device, uuid->c_str(),
                  *granularity, std::string(HandleTypeName(type)).c_str(), *supported);
    }
  }
}

TEST_F(CudaGpuTest, BadArgumentsAreInvalidArgument) {
  const int bad = driver_->DeviceCount();
  EXPECT_EQ(driver_->DeviceUuid(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->DeviceUuid(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Granularity(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->GetMemInfo(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Create(bad, granularity_, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Create(0, granularity_ / 2, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Create(0, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Reserve(granularity_ + 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->CreateStream(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->CreateEvent(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->SynchronizeDevice(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->DestroyStream(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->EventDone(12345).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Export(0, HandleType::kPosixFd).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaGpuTest, OutOfMemoryIsResourceExhausted) {
  absl::StatusOr<MemInfo> info = driver_->GetMemInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  const size_t too_much = (info->total / granularity_ + 1) * granularity_;
  absl::StatusOr<PhysHandle> handle = driver_->Create(0, too_much, 0);
  EXPECT_EQ(handle.status().code(), absl::StatusCode::kResourceExhausted) << handle.status();
  EXPECT_EQ(DriverErrorOf(handle.status()), CUDA_ERROR_OUT_OF_MEMORY) << handle.status();
  if (handle.ok()) {
    EXPECT_TRUE(driver_->Release(*handle).ok());
  }
}

// Memory written through one mapping is read through a second mapping of the same physical
// memory, imported from a POSIX fd; all from a thread with no current context.
TEST_F(CudaGpuTest, MapShareAndCopy) {
  const size_t size = granularity_;
  absl::StatusOr<PhysHandle> handle = driver_->Create(0, size, kPosixFdBit);
  ASSERT_TRUE(handle.ok()) << handle.status();
  absl::StatusOr<DevPtr> base = driver_->Reserve(2 * size, 0);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE(driver_->Map(*base, size, *handle).ok());
  const int device0[] = {0};
  ASSERT_TRUE(driver_->SetAccess(*base, size, device0).ok());

  absl::StatusOr<ShareableHandle> exported = driver_->Export(*handle, HandleType::kPosixFd);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(exported->fd.valid());
  absl::StatusOr<PhysHandle> imported = driver_->Import(*exported);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(exported->fd.valid());  // not consumed
  const DevPtr second = *base + size;
  ASSERT_TRUE(driver_->Map(second, size, *imported).ok());
  ASSERT_TRUE(driver_->SetAccess(second, size, device0).ok());

  absl::StatusOr<Stream> stream = driver_->CreateStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE(driver_->MemsetAsync(*base, 0xab, size, *stream).ok());
  std::vector<uint8_t> host(size, 0);
  absl::Status copied =
      driver_->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), second, size, *stream);
  ASSERT_TRUE(copied.ok()) << copied;
  ASSERT_TRUE(driver_->SynchronizeStream(*stream).ok());
  EXPECT_EQ(host.front(), 0xab);
  EXPECT_EQ(host.back(), 0xab);

  // The same from another thread, on stream 0.
  std::thread([&] {
    std::vector<uint8_t> again(size, 0);
    ASSERT_TRUE(driver_->MemsetAsync(second, 0x5c, size, 0).ok());
    ASSERT_TRUE(driver_->MemcpyAsync(reinterpret_cast<DevPtr>(again.data()), *base, size, 0).ok());
    ASSERT_TRUE(driver_->SynchronizeStream(0).ok());
    EXPECT_EQ(again.front(), 0x5c);
    EXPECT_EQ(again.back(), 0x5c);
  }).join();

  EXPECT_TRUE(driver_->DestroyStream(*stream).ok());
  EXPECT_TRUE(driver_->Unmap(*base, size).ok());
  EXPECT_TRUE(driver_->Release(*handle).ok());  // memory stays: still mapped at `second`
  EXPECT_TRUE(driver_->Release(*imported).ok());
  EXPECT_TRUE(driver_->Unmap(second, size).ok());
  EXPECT_TRUE(driver_->Unreserve(*base, 2 * size).ok());
  EXPECT_TRUE(driver_->SynchronizeDevice(0).ok());
}

// Misuse of addresses and sizes fails cleanly, without a crash. The codes that driver.h fixes
// are checked; the driver's answers to the rest are printed for the record.
TEST_F(CudaGpuTest, MisuseFailsCleanly) {
  const size_t g = granularity_;
  absl::StatusOr<PhysHandle> handle = driver_->Create(0, g, 0);
  ASSERT_TRUE(handle.ok()) << handle.status();
  absl::StatusOr<DevPtr> base = driver_->Reserve(2 * g, 0);
  ASSERT_TRUE(base.ok()) << base.status();
  const int device0[] = {0};
  auto print = [](const char* what, const absl::Status& status) {
    std::printf("%-36s %s\n", what, status.ToString().c_str());
  };

  EXPECT_EQ(driver_->Map(*base, g / 2, *handle).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Map(*base + g / 2, g, *handle).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Unmap(*base, g + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->SetAccess(*base + 1, g, device0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Unreserve(*base, g / 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Reserve(g, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver_->Map(*base + 2 * g, g, *handle).code(), absl::StatusCode::kInvalidArgument)
      << "past the reservation";
  EXPECT_FALSE(driver_->SetAccess(*base, g, device0).ok()) << "nothing mapped";
  print("Unmap(nothing mapped)", driver_->Unmap(*base, g));

  ASSERT_TRUE(driver_->Map(*base, g, *handle).ok());
  EXPECT_EQ(driver_->Map(*base, g, *handle).code(), absl::StatusCode::kInvalidArgument)
      << "over a mapping";
  print("Unreserve(still mapped)", driver_->Unreserve(*base, 2 * g));
  print("Unmap(mapping + unmapped granule)", driver_->Unmap(*base, 2 * g));
  print("Unmap(the mapping)", driver_->Unmap(*base, g));
  EXPECT_TRUE(driver_->Release(*handle).ok());
  print("Unreserve(the range)", driver_->Unreserve(*base, 2 * g));
}

// What the driver answers to calls that cross from one reservation into the next, laid end to
// end by ReserveAt, printed for the record: the pool never makes them (a seam is never crossed
// by a growth's Map or SetAccess, nor by a batched Unmap: arena.h ExtendRange), and this says
// whether it must keep that rule.
TEST_F(CudaGpuTest, CallsAcrossTwoReservationsArePrinted) {
  const size_t g = granularity_;
  absl::StatusOr<DevPtr> base = driver_->Reserve(g, 0);
  ASSERT_TRUE(base.ok()) << base.status();
  absl::StatusOr<DevPtr> more = driver_->ReserveAt(*base + g, g);
  if (!more.ok()) {
    EXPECT_TRUE(driver_->Unreserve(*base, g).ok());
    GTEST_SKIP() << "no address space after the range: " << more.status();
  }
  absl::StatusOr<PhysHandle> a = driver_->Create(0, g, 0);
  absl::StatusOr<PhysHandle> b = driver_->Create(0, g, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  const int device0[] = {0};
  auto print = [](const char* what, const absl::Status& status) {
    std::printf("%-44s %s\n", what, status.ToString().c_str());
  };
  ASSERT_TRUE(driver_->Map(*base, g, *a).ok());
  ASSERT_TRUE(driver_->Map(*more, g, *b).ok());
  const absl::Status access = driver_->SetAccess(*base, 2 * g, device0);
  print("SetAccess(across two reservations)", access);
  if (!access.ok()) {
    EXPECT_TRUE(driver_->SetAccess(*base, g, device0).ok());
    EXPECT_TRUE(driver_->SetAccess(*more, g, device0).ok());
  }
  const absl::Status unmapped = driver_->Unmap(*base, 2 * g);
  print("Unmap(across two reservations)", unmapped);
  if (!unmapped.ok()) {
    EXPECT_TRUE(driver_->Unmap(*base, g).ok());
    EXPECT_TRUE(driver_->Unmap(*more, g).ok());
  }
  absl::StatusOr<PhysHandle> wide = driver_->Create(0, 2 * g, 0);
  ASSERT_TRUE(wide.ok());
  const absl::Status mapped = driver_->Map(*base, 2 * g, *wide);
  print("Map(one allocation across two reservations)", mapped);
  if (mapped.ok()) {
    EXPECT_TRUE(driver_->Unmap(*base, 2 * g).ok());
  }
  for (PhysHandle h : {*a, *b, *wide}) EXPECT_TRUE(driver_->Release(h).ok());
  EXPECT_TRUE(driver_->Unreserve(*more, g).ok());
  EXPECT_TRUE(driver_->Unreserve(*base, g).ok());
}

// Threads with no current context create, map, use and free memory at the same time.
TEST_F(CudaGpuTest, ConcurrentThreads) {
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        absl::StatusOr<PhysHandle> handle = driver_->Create(0, granularity_, kPosixFdBit);
        absl::StatusOr<DevPtr> ptr = driver_->Reserve(granularity_, 0);
        absl::StatusOr<Stream> stream = driver_->CreateStream(0);
        absl::StatusOr<Event> event = driver_->CreateEvent(0);
        if (!handle.ok() || !ptr.ok() || !stream.ok() || !event.ok()) {
          ++failures;
          return;
        }
        const int device0[] = {0};
        uint8_t byte = 0;
        bool ok =
            driver_->Map(*ptr, granularity_, *handle).ok() &&
            driver_->SetAccess(*ptr, granularity_, device0).ok() &&
            driver_->MemsetAsync(*ptr, static_cast<uint8_t>(t), granularity_, *stream).ok() &&
            driver_
                ->MemcpyAsync(reinterpret_cast<DevPtr>(&byte), *ptr + granularity_ - 1, 1, *stream)
                .ok() &&
            driver_->RecordEvent(*event, *stream).ok() && driver_->SynchronizeEvent(*event).ok() &&
            byte == t && driver_->Unmap(*ptr, granularity_).ok() &&
            driver_->Release(*handle).ok() && driver_->Unreserve(*ptr, granularity_).ok() &&
            driver_->DestroyEvent(*event).ok() && driver_->DestroyStream(*stream).ok();
        if (!ok) ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(CudaGpuTest, EventsFollowStreamOrder) {
  absl::StatusOr<Stream> stream = driver_->CreateStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<Event> event = driver_->CreateEvent(0);
  ASSERT_TRUE(event.ok()) << event.status();

  struct Gate {
    std::atomic<bool> open{false};
    std::atomic<bool> ran{false};
  } gate;
  auto wait_for_gate = [](void* arg) {
    auto* g = static_cast<Gate*>(arg);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!g->open.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    g->ran.store(true);
  };
  ASSERT_TRUE(driver_->LaunchHostFunc(*stream, wait_for_gate, &gate).ok());
  ASSERT_TRUE(driver_->RecordEvent(*event, *stream).ok());
  absl::StatusOr<bool> done = driver_->EventDone(*event);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done);
  gate.open.store(true);
  ASSERT_TRUE(driver_->SynchronizeEvent(*event).ok());
  EXPECT_TRUE(gate.ran.load());
  done = driver_->EventDone(*event);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);

  EXPECT_TRUE(driver_->DestroyEvent(*event).ok());
  EXPECT_EQ(driver_->EventDone(*event).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(driver_->DestroyStream(*stream).ok());
  EXPECT_EQ(driver_->DestroyStream(*stream).code(), absl::StatusCode::kInvalidArgument);
}

// Fabric memory works where an IMEX channel is granted, and otherwise fails with a status that
// says why; a forged handle of either kind is refused without a crash.
TEST_F(CudaGpuTest, FabricAndForgedHandles) {
  absl::StatusOr<PhysHandle> fabric = driver_->Create(0, granularity_, kFabricBit);
  std::printf("Create(fabric): %s\n", fabric.status().ToString().c_str());
  if (fabric.ok()) {
    absl::StatusOr<ShareableHandle> exported = driver_->Export(*fabric, HandleType::kFabric);
    ASSERT_TRUE(exported.ok()) << exported.status();
    absl::StatusOr<PhysHandle> imported = driver_->Import(*exported);
    ASSERT_TRUE(imported.ok()) << imported.status();
    EXPECT_TRUE(driver_->Release(*imported).ok());
    EXPECT_TRUE(driver_->Release(*fabric).ok());
  } else if (fabric.status().code() == absl::StatusCode::kPermissionDenied) {
    EXPECT_THAT(fabric.status().message(), HasSubstr("/dev/nvidia-caps-imex-channels"));
  } else {
    EXPECT_THAT(fabric.status().code(), ::testing::AnyOf(absl::StatusCode::kUnimplemented,
                                                         absl::StatusCode::kInvalidArgument));
  }

  ShareableHandle forged;
  forged.type = HandleType::kFabric;
  for (size_t i = 0; i < forged.fabric.size(); ++i) {
    forged.fabric[i] = static_cast<uint8_t>(i * 37);
  }
  absl::StatusOr<PhysHandle> imported = driver_->Import(forged);
  std::printf("Import(forged fabric): %s\n", imported.status().ToString().c_str());
  EXPECT_FALSE(imported.ok());

  ShareableHandle not_cuda;
  not_cuda.type = HandleType::kPosixFd;
  not_cuda.fd = UniqueFd(open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(not_cuda.fd.valid());
  imported = driver_->Import(not_cuda);
  std::printf("Import(/dev/null fd): %s\n", imported.status().ToString().c_str());
  EXPECT_FALSE(imported.ok());

  // Exporting a type that was not requested at Create() fails cleanly.
  absl::StatusOr<PhysHandle> plain = driver_->Create(0, granularity_, 0);
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<ShareableHandle> exported = driver_->Export(*plain, HandleType::kPosixFd);
  std::printf("Export(unrequested posix_fd): %s\n", exported.status().ToString().c_str());
  EXPECT_FALSE(exported.ok());
  EXPECT_TRUE(driver_->Release(*plain).ok());
}

}  // namespace
}  // namespace vmm
