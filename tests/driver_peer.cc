// driver_peer: the other process of the cross-process conformance tests.
//
// It imports an allocation that the test process exported, maps it, checks that every byte
// has the value the test wrote, overwrites it with a new value, and undoes everything:
//
//   driver_peer --backend=host|cuda --type=fd|fabric (--fd=N | --fabric=HEX) --size=BYTES
//               [--expect=BYTE] [--write=BYTE] [--device=N]
//
// --fd names a descriptor inherited from the test process; --fabric is the 64-byte fabric
// handle as 128 hex digits. BYTE values are decimal. --device (default 0) is the device the
// mapping is made for: access is granted to it alone (checked with HasAccess), and the bytes
// are read and written by copies on a stream of that device, so that with --device=1 and
// memory exported from device 0 every access goes over the peer link. (The host backend has
// one device unless VMM_HOST_DEVICES says otherwise.) On failure the status goes to stderr
// and the exit code says which step failed (tests/driver_conformance_test.cc relies on these).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "allocator/driver.h"
#include "allocator/driver_factory.h"
#include "allocator/status_macros.h"
#include "allocator/unique_fd.h"

namespace vmm {
namespace {

// Exit codes, one per step.
enum PeerExit : int {
  kOk = 0,
  kUsage = 1,          // bad command line
  kNoDriver = 2,       // the backend is unavailable
  kImportFailed = 3,   // Import() refused the handle (e.g. stale or forged)
  kMapFailed = 4,      // CreateStream/Reserve/Map/SetAccess failed, or HasAccess says no
  kMismatch = 5,       // the bytes are not what the exporter wrote
  kWriteFailed = 6,    // writing the new value failed
  kCleanupFailed = 7,  // Unmap/Release/Unreserve failed
};

struct PeerOptions {
  std::string backend;
  HandleType type = HandleType::kNone;
  int fd = -1;
  FabricHandle fabric{};
  size_t size = 0;
  int expect = -1;  // -1: do not check
  int write = -1;   // -1: do not write
  int device = 0;   // the device the mapping is for
};

absl::StatusOr<int> ParseByte(absl::string_view flag, absl::string_view value) {
  int byte = 0;
  if (!absl::SimpleAtoi(value, &byte) || byte < 0 || byte > 255) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": not a byte value: ", value));
  }
  return byte;
}

absl::StatusOr<FabricHandle> ParseFabric(absl::string_view hex) {
  if (hex.size() != 2 * kFabricHandleSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fabric: expected ", 2 * kFabricHandleSize, " hex digits"));
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError("--fabric: not hex");
    }
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  FabricHandle handle;
  std::copy(bytes.begin(), bytes.end(), handle.begin());
  return handle;
}

// Applies one "--name=value" argument to `options`.
absl::Status ParseFlag(absl::string_view arg, PeerOptions* options) {
  const size_t eq = arg.find('=');
  if (!absl::StartsWith(arg, "--") || eq == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("expected --name=value, got ", arg));
  }
  const absl::string_view name = arg.substr(0, eq);
  const absl::string_view value = arg.substr(eq + 1);
  if (name == "--backend") {
    options->backend = std::string(value);
  } else if (name == "--type") {
    if (value == "fd") {
      options->type = HandleType::kPosixFd;
    } else if (value == "fabric") {
      options->type = HandleType::kFabric;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--type: unknown type ", value));
    }
  } else if (name == "--fd") {
    if (!absl::SimpleAtoi(value, &options->fd) || options->fd < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--fd: bad descriptor ", value));
    }
  } else if (name == "--fabric") {
    VMM_ASSIGN_OR_RETURN(options->fabric, ParseFabric(value));
  } else if (name == "--size") {
    if (!absl::SimpleAtoi(value, &options->size) || options->size == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--size: bad size ", value));
    }
  } else if (name == "--expect") {
    VMM_ASSIGN_OR_RETURN(options->expect, ParseByte(name, value));
  } else if (name == "--write") {
    VMM_ASSIGN_OR_RETURN(options->write, ParseByte(name, value));
  } else if (name == "--device") {
    if (!absl::SimpleAtoi(value, &options->device) || options->device < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--device: bad device ", value));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name));
  }
  return absl::OkStatus();
}

absl::StatusOr<PeerOptions> ParseArgs(int argc, char** argv) {
  PeerOptions options;
  for (int i = 1; i < argc; ++i) VMM_RETURN_IF_ERROR(ParseFlag(argv[i], &options));
  if (options.backend.empty() || options.type == HandleType::kNone || options.size == 0) {
    return absl::InvalidArgumentError("--backend, --type and --size are required");
  }
  if (options.type == HandleType::kPosixFd && options.fd < 0) {
    return absl::InvalidArgumentError("--type=fd needs --fd");
  }
  return options;
}

int Fail(PeerExit code, absl::string_view step, const absl::Status& status) {
  std::fprintf(stderr, "driver_peer: %.*s: %s\n", static_cast<int>(step.size()), step.data(),
               status.ToString().c_str());
  return code;
}

// Checks that all `size` bytes at `ptr` equal `expect` (copied out through the driver on
// `stream`, since device memory cannot be read directly).
absl::Status CheckBytes(Driver* driver, DevPtr ptr, size_t size, uint8_t expect, Stream stream) {
  std::vector<uint8_t> host(size);
  VMM_RETURN_IF_ERROR(driver->MemcpyAsync(
      static_cast<DevPtr>(reinterpret_cast<uintptr_t>(host.data())), ptr, size, stream));
  VMM_RETURN_IF_ERROR(driver->SynchronizeStream(stream));
  for (size_t i = 0; i < size; ++i) {
    if (host[i] != expect) {
      return absl::DataLossError(absl::StrCat("byte ", i, " is ", host[i], ", expected ", expect));
    }
  }
  return absl::OkStatus();
}

// Fails unless `device` may access `ptr`.
absl::Status CheckAccess(Driver* driver, DevPtr ptr, int device) {
  VMM_ASSIGN_OR_RETURN(bool granted, driver->HasAccess(ptr, device));
  if (!granted) {
    return absl::FailedPreconditionError(
        absl::StrCat("HasAccess: device ", device, " has no access after SetAccess"));
  }
  return absl::OkStatus();
}

int Run(const PeerOptions& options) {
  absl::StatusOr<Driver*> driver_or = DriverByName(options.backend);
  if (!driver_or.ok()) return Fail(kNoDriver, "DriverByName", driver_or.status());
  Driver* driver = *driver_or;
  const int device = options.device;
  // First, so that on CUDA the calls below work in this device's context (cuda_driver.cc).
  absl::StatusOr<Stream> stream = driver->CreateStream(device);
  if (!stream.ok()) return Fail(kMapFailed, "CreateStream", stream.status());

  ShareableHandle shared;
  shared.type = options.type;
  shared.fd.reset(options.fd);  // inherited; closed when `shared` goes away
  shared.fabric = options.fabric;
  absl::StatusOr<PhysHandle> handle = driver->Import(shared);
  if (!handle.ok()) return Fail(kImportFailed, "Import", handle.status());

  absl::StatusOr<DevPtr> va = driver->Reserve(options.size, 0);
  if (!va.ok()) return Fail(kMapFailed, "Reserve", va.status());
  if (absl::Status s = driver->Map(*va, options.size, *handle); !s.ok()) {
    return Fail(kMapFailed, "Map", s);
  }
  if (absl::Status s = driver->SetAccess(*va, options.size, {device}); !s.ok()) {
    return Fail(kMapFailed, "SetAccess", s);
  }
  if (absl::Status s = CheckAccess(driver, *va, device); !s.ok()) {
    return Fail(kMapFailed, "HasAccess", s);
  }

  if (options.expect >= 0) {
    absl::Status s =
        CheckBytes(driver, *va, options.size, static_cast<uint8_t>(options.expect), *stream);
    if (!s.ok()) return Fail(kMismatch, "check", s);
  }
  if (options.write >= 0) {
    absl::Status s =
        driver->MemsetAsync(*va, static_cast<uint8_t>(options.write), options.size, *stream);
    if (s.ok()) s = driver->SynchronizeStream(*stream);
    if (!s.ok()) return Fail(kWriteFailed, "write", s);
  }

  absl::Status s = driver->Unmap(*va, options.size);
  s.Update(driver->Release(*handle));
  s.Update(driver->Unreserve(*va, options.size));
  s.Update(driver->DestroyStream(*stream));
  if (!s.ok()) return Fail(kCleanupFailed, "cleanup", s);
  return kOk;
}

}  // namespace
}  // namespace vmm

int main(int argc, char** argv) {
  absl::StatusOr<vmm::PeerOptions> options = vmm::ParseArgs(argc, argv);
  if (!options.ok()) return vmm::Fail(vmm::kUsage, "usage", options.status());
  return vmm::Run(*options);
}
