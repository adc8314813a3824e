// vmm_peer: the second process of everything that shares memory between processes — the
// driver conformance tests, the sharing tests, the demo and import_bench. One subcommand each:
//
//   vmm_peer driver-import --backend=host|cuda --type=fd|fabric (--fd=N | --fabric=HEX)
//                          --size=BYTES [--expect=BYTE] [--write=BYTE] [--device=N]
//       Through the bare driver interface: imports one exported allocation (--fd: a
//       descriptor inherited from the parent; --fabric: the 64-byte handle as 128 hex digits),
//       reserves, maps and grants access to `device` (default 0; checked with HasAccess),
//       checks every byte equals `expect`, writes `write` over them, and undoes everything.
//       Reads and writes are copies on a stream of `device`.
//
//   vmm_peer import --descriptor=HEX --expect=BYTE|pattern [--write=BYTE [--write_size=BYTES]]
//                   [--wait] [--die] [--pidfd] [--device=N] [--peers=N,M...] [--backend=NAME]
//       ImportBuffer of an encoded descriptor (fds fetched with pidfd_getfd when --pidfd);
//       checks every byte equals `expect` ("pattern": the bytes of byte_pattern.h), then
//       writes `write` over the first `write_size` bytes (default: all). --wait: prints
//       "imported", then waits for a line on stdin before checking (the exporter may free or
//       exit meanwhile). --die: aborts right after importing. --device: the device to map on
//       (default: the exporting device, found by UUID, else 0); --peers: further devices
//       granted access. The import device and every peer must then have access (HasAccess).
//       Prints one line starting with "ok" on success.
//
//   vmm_peer export --size=BYTES --fill=BYTE [--handle=posix_fd|fabric] [--device=N]
//                   [--backend=NAME]
//       Allocates and fills a buffer in a pool on `device` (default 0), prints its descriptor
//       as hex, then obeys lines on stdin: "free" frees it and empties the cache (answers
//       "freed"), "expect BYTE" answers "match" when every byte equals BYTE (else
//       "mismatch: ..."), "exit" exits.
//
//   vmm_peer reexport --descriptor=HEX [--expect=BYTE|pattern] [--backend=NAME]
//       The middle process of A -> B -> C: ImportBuffer of an encoded descriptor (checks every
//       byte equals `expect` when given), then ReExportImport, and prints the new descriptor
//       as hex. Then obeys lines on stdin: "again" prints the descriptor of another
//       ReExportImport (the cached one), "expect BYTE" answers "match" when every byte of the
//       import equals BYTE (else "mismatch: ..."), "drop" closes the import (answers
//       "dropped N": N fds left registered with this process's FdServer), "exit" exits.
//
//   vmm_peer import-loop [--backend=NAME]
//       Prints "ready" once the driver is up, then reads hex descriptors, one a line, imports
//       each and answers "ok FETCH_NS IMPORT_NS CLOSE_NS" (FETCH_NS: the fds of a posix_fd
//       descriptor fetched over the exporter's socket alone, else 0; IMPORT_NS: ImportBuffer,
//       fetch included; CLOSE_NS: closing the import) or "error MESSAGE". Until end of input.
//
// --backend picks the driver backend ("host" or "cuda"); without it the default one
// (driver_factory.h: VMM_BACKEND, else CUDA when present, else host; on the host backend
// VMM_HOST_DEVICES sets how many devices it emulates). BYTES accept K/M/G/T suffixes.
//
// Exit codes (the tests rely on them); on failure the step and the status go to stderr:
//   0 ok, 1 usage, 2 setup failed (driver, stream, pool, allocation, fill), 3 the import was
//   refused (stale, forged or malformed), 4 mapping or access failed, 5 the bytes are wrong,
//   6 the write failed, 7 cleanup failed, 8 the re-export failed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "allocator/byte_size.h"
#include "allocator/descriptor.h"
#include "allocator/driver.h"
#include "allocator/driver_factory.h"
#include "allocator/fd_share.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "allocator/status_macros.h"
#include "allocator/unique_fd.h"
#include "tools/byte_pattern.h"

namespace vmm {
namespace {

enum ExitCode : int {
  kOk = 0,
  kUsage = 1,
  kSetupFailed = 2,
  kImportFailed = 3,
  kMapFailed = 4,
  kMismatch = 5,
  kWriteFailed = 6,
  kCleanupFailed = 7,
  kReExportFailed = 8,
};

// The subcommand being run, for messages.
std::string g_command = "vmm_peer";

int Fail(ExitCode code, absl::string_view step, const absl::Status& status) {
  std::fprintf(stderr, "%s: %.*s: %s\n", g_command.c_str(), static_cast<int>(step.size()),
               step.data(), status.ToString().c_str());
  return code;
}

void PrintLine(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// --- Command line ---------------------------------------------------------------------------

// A subcommand's flags: "--name=value" and bare "--name" switches.
class Flags {
 public:
  // Parses `args`; only the names in `valued` may have a value and only those in `switches`
  // may stand alone.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args,
                                     const std::set<std::string>& valued,
                                     const std::set<std::string>& switches) {
    Flags flags;
    for (const std::string& arg : args) {
      if (!absl::StartsWith(arg, "--")) {
        return absl::InvalidArgumentError(absl::StrCat("expected --name[=value], got ", arg));
      }
      const size_t eq = arg.find('=');
      const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (eq != std::string::npos && valued.count(name) != 0) {
        flags.values_[name] = arg.substr(eq + 1);
      } else if (eq == std::string::npos && switches.count(name) != 0) {
        flags.switches_.insert(name);
      } else {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg));
      }
    }
    return flags;
  }

  bool Has(const std::string& name) const {
    return values_.count(name) != 0 || switches_.count(name) != 0;
  }
  // The value of --name, or `fallback` when absent.
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }

  // --name as a whole number in [min, max]; `fallback` when absent.
  absl::StatusOr<int> Int(const std::string& name, int fallback, int min, int max) const {
    if (!Has(name)) return fallback;
    int n = 0;
    if (!absl::SimpleAtoi(Get(name), &n) || n < min || n > max) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=", Get(name), ": expected a number in [", min, ", ", max,
                       "]"));
    }
    return n;
  }
  // --name as a byte value 0..255, or -1 when absent.
  absl::StatusOr<int> Byte(const std::string& name) const { return Int(name, -1, 0, 255); }
  // --name as a size in bytes (byte_size.h); `fallback` when absent.
  absl::StatusOr<uint64_t> Size(const std::string& name, uint64_t fallback) const {
    if (!Has(name)) return fallback;
    absl::StatusOr<uint64_t> size = ParseByteSize(Get(name));
    if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ",
                                                                   size.status().message()));
    return size;
  }
  // --name as a comma-separated list of device indices.
  absl::StatusOr<std::vector<int>> Devices(const std::string& name) const {
    std::vector<int> devices;
    for (absl::string_view part : absl::StrSplit(Get(name), ',', absl::SkipEmpty())) {
      int device = 0;
      if (!absl::SimpleAtoi(part, &device) || device < 0) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": bad device ", part));
      }
      devices.push_back(device);
    }
    return devices;
  }

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
};

// --backend's driver, else the default one.
absl::StatusOr<Driver*> PeerDriver(const Flags& flags) {
  if (flags.Has("backend")) return DriverByName(flags.Get("backend"));
  return DefaultDriver();
}

// The handle of --fabric: 128 hex digits.
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

// --- Device memory --------------------------------------------------------------------------

// What the bytes of a buffer should be: one value, or the pattern of byte_pattern.h.
struct Expected {
  bool pattern = false;
  uint8_t value = 0;
  uint8_t At(size_t i) const { return pattern ? PatternByte(i) : value; }
};

absl::StatusOr<Expected> ParseExpected(const Flags& flags) {
  if (flags.Get("expect") == "pattern") return Expected{true, 0};
  VMM_ASSIGN_OR_RETURN(int byte, flags.Byte("expect"));
  if (byte < 0) return absl::InvalidArgumentError("--expect=BYTE|pattern is required");
  return Expected{false, static_cast<uint8_t>(byte)};
}

// DataLoss unless every byte of [ptr, ptr+size) is as expected (copied out on `stream`).
absl::Status CheckBytes(Driver* driver, DevPtr ptr, size_t size, const Expected& expected,
                        Stream stream) {
  std::vector<uint8_t> host(size);
  VMM_RETURN_IF_ERROR(
      driver->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), ptr, size, stream));
  VMM_RETURN_IF_ERROR(driver->SynchronizeStream(stream));
  for (size_t i = 0; i < size; ++i) {
    if (host[i] != expected.At(i)) {
      return absl::DataLossError(
          absl::StrCat("byte ", i, " is ", host[i], ", expected ", expected.At(i)));
    }
  }
  return absl::OkStatus();
}

// Writes `value` over [ptr, ptr+size) on `stream` and waits for it.
absl::Status WriteBytes(Driver* driver, DevPtr ptr, size_t size, uint8_t value, Stream stream) {
  VMM_RETURN_IF_ERROR(driver->MemsetAsync(ptr, value, size, stream));
  return driver->SynchronizeStream(stream);
}

// FailedPrecondition unless every device in `devices` may access `ptr`.
absl::Status CheckAccess(Driver* driver, DevPtr ptr, const std::vector<int>& devices) {
  for (int device : devices) {
    VMM_ASSIGN_OR_RETURN(bool granted, driver->HasAccess(ptr, device));
    if (!granted) {
      return absl::FailedPreconditionError(absl::StrCat("device ", device, " has no access"));
    }
  }
  return absl::OkStatus();
}

// --- driver-import ----------------------------------------------------------------------------

struct DriverImportOptions {
  HandleType type = HandleType::kNone;
  int fd = -1;
  FabricHandle fabric{};
  size_t size = 0;
  int expect = -1;  // -1: do not check
  int write = -1;   // -1: do not write
  int device = 0;   // the device the mapping is for
};

absl::StatusOr<DriverImportOptions> ParseDriverImport(const Flags& flags) {
  DriverImportOptions options;
  const std::string type = flags.Get("type");
  if (type == "fd") {
    options.type = HandleType::kPosixFd;
  } else if (type == "fabric") {
    options.type = HandleType::kFabric;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--type=fd|fabric is required, got '", type,
                                                   "'"));
  }
  if (!flags.Has("backend")) return absl::InvalidArgumentError("--backend is required");
  VMM_ASSIGN_OR_RETURN(options.fd, flags.Int("fd", -1, 0, INT32_MAX));
  if (options.type == HandleType::kPosixFd && options.fd < 0) {
    return absl::InvalidArgumentError("--type=fd needs --fd");
  }
  if (flags.Has("fabric")) {
    VMM_ASSIGN_OR_RETURN(options.fabric, ParseFabric(flags.Get("fabric")));
  }
  VMM_ASSIGN_OR_RETURN(options.size, flags.Size("size", 0));
  if (options.size == 0) return absl::InvalidArgumentError("--size=BYTES (not 0) is required");
  VMM_ASSIGN_OR_RETURN(options.expect, flags.Byte("expect"));
  VMM_ASSIGN_OR_RETURN(options.write, flags.Byte("write"));
  VMM_ASSIGN_OR_RETURN(options.device, flags.Int("device", 0, 0, INT32_MAX));
  return options;
}

// Imports, maps, checks and writes, then undoes it all; an exit code.
int DriverImport(Driver* driver, const DriverImportOptions& options) {
  const int device = options.device;
  // First, so that on CUDA the calls below work in the context of this device (cuda_driver.cc).
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
  if (absl::Status s = CheckAccess(driver, *va, {device}); !s.ok()) {
    return Fail(kMapFailed, "HasAccess", s);
  }
  if (options.expect >= 0) {
    const Expected expected{false, static_cast<uint8_t>(options.expect)};
    if (absl::Status s = CheckBytes(driver, *va, options.size, expected, *stream); !s.ok()) {
      return Fail(kMismatch, "check", s);
    }
  }
  if (options.write >= 0) {
    absl::Status s =
        WriteBytes(driver, *va, options.size, static_cast<uint8_t>(options.write), *stream);
    if (!s.ok()) return Fail(kWriteFailed, "write", s);
  }

  absl::Status s = driver->Unmap(*va, options.size);
  s.Update(driver->Release(*handle));
  s.Update(driver->Unreserve(*va, options.size));
  s.Update(driver->DestroyStream(*stream));
  if (!s.ok()) return Fail(kCleanupFailed, "cleanup", s);
  return kOk;
}

int RunDriverImport(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(
      args, {"backend", "type", "fd", "fabric", "size", "expect", "write", "device"}, {});
  if (!flags.ok()) return Fail(kUsage, "usage", flags.status());
  absl::StatusOr<DriverImportOptions> options = ParseDriverImport(*flags);
  if (!options.ok()) return Fail(kUsage, "usage", options.status());
  absl::StatusOr<Driver*> driver = DriverByName(flags->Get("backend"));
  if (!driver.ok()) return Fail(kSetupFailed, "DriverByName", driver.status());
  return DriverImport(*driver, *options);
}

// --- import -----------------------------------------------------------------------------------

struct ImportCommand {
  std::string descriptor;  // encoded
  Expected expected;
  int write = -1;          // -1: do not write
  uint64_t write_size = 0;  // 0: the whole buffer
  bool wait = false;
  bool die = false;
  ImportOptions options;
};

absl::StatusOr<ImportCommand> ParseImport(const Flags& flags) {
  ImportCommand command;
  if (!flags.Has("descriptor")) return absl::InvalidArgumentError("--descriptor=HEX is required");
  command.descriptor = absl::HexStringToBytes(flags.Get("descriptor"));
  VMM_ASSIGN_OR_RETURN(command.expected, ParseExpected(flags));
  VMM_ASSIGN_OR_RETURN(command.write, flags.Byte("write"));
  VMM_ASSIGN_OR_RETURN(command.write_size, flags.Size("write_size", 0));
  command.wait = flags.Has("wait");
  command.die = flags.Has("die");
  VMM_ASSIGN_OR_RETURN(command.options.device, flags.Int("device", -1, 0, INT32_MAX));
  VMM_ASSIGN_OR_RETURN(command.options.peer_devices, flags.Devices("peers"));
  if (flags.Has("pidfd")) command.options.fd_fetch = FdFetch::kPidfd;
  return command;
}

// Prints "imported" and waits for a line on stdin.
void WaitForGo() {
  PrintLine("imported");
  std::string line;
  std::getline(std::cin, line);
}

int Import(Driver* driver, const ImportCommand& command) {
  absl::StatusOr<BufferDescriptor> descriptor = BufferDescriptor::Decode(command.descriptor);
  if (!descriptor.ok()) return Fail(kImportFailed, "Decode", descriptor.status());
  // A stream of the import device first when it is known, so that on CUDA the import works in
  // the context of that device rather than creating one on device 0 (cuda_driver.cc).
  const int device = command.options.device;
  absl::StatusOr<Stream> stream = device >= 0 ? driver->CreateStream(device) : Stream{0};
  if (!stream.ok()) return Fail(kSetupFailed, "CreateStream", stream.status());
  absl::StatusOr<std::unique_ptr<ImportedBuffer>> buffer =
      ImportBuffer(driver, *descriptor, command.options);
  if (!buffer.ok()) return Fail(kImportFailed, "ImportBuffer", buffer.status());
  if (command.die) std::abort();
  if (command.wait) WaitForGo();

  std::vector<int> devices = {(*buffer)->device()};
  devices.insert(devices.end(), command.options.peer_devices.begin(),
                 command.options.peer_devices.end());
  if (absl::Status s = CheckAccess(driver, (*buffer)->ptr(), devices); !s.ok()) {
    return Fail(kMapFailed, "HasAccess", s);
  }
  const size_t size = (*buffer)->size();
  if (absl::Status s = CheckBytes(driver, (*buffer)->ptr(), size, command.expected, *stream);
      !s.ok()) {
    return Fail(kMismatch, "check", s);
  }
  const size_t written =
      command.write_size == 0 ? size : std::min<size_t>(command.write_size, size);
  if (command.write >= 0) {
    absl::Status s = WriteBytes(driver, (*buffer)->ptr(), written,
                                static_cast<uint8_t>(command.write), *stream);
    if (!s.ok()) return Fail(kWriteFailed, "write", s);
  }
  buffer->reset();
  if (*stream != 0) {
    if (absl::Status s = driver->DestroyStream(*stream); !s.ok()) {
      return Fail(kCleanupFailed, "DestroyStream", s);
    }
  }
  PrintLine(absl::StrFormat(
      "ok: imported %d bytes (%d handle(s), %s) from %s, all as expected%s", size,
      descriptor->handles().size(), HandleTypeName(descriptor->handle_type()),
      descriptor->owner_uuid().value_or("?"),
      command.write >= 0 ? absl::StrFormat("; wrote %d over %d bytes", command.write, written)
                         : ""));
  return kOk;
}

int RunImport(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(args,
                   {"backend", "descriptor", "expect", "write", "write_size", "device", "peers"},
                   {"wait", "die", "pidfd"});
  if (!flags.ok()) return Fail(kUsage, "usage", flags.status());
  absl::StatusOr<ImportCommand> command = ParseImport(*flags);
  if (!command.ok()) return Fail(kUsage, "usage", command.status());
  absl::StatusOr<Driver*> driver = PeerDriver(*flags);
  if (!driver.ok()) return Fail(kSetupFailed, "driver", driver.status());
  return Import(*driver, *command);
}

// --- export -----------------------------------------------------------------------------------

// The one place this program creates a pool whose blocks it exports.
absl::StatusOr<std::unique_ptr<Pool>> CreateExportingPool(Driver* driver,
                                                          const PoolOptions& options) {
  return CreateExportablePool(driver, options);
}

struct ExportCommand {
  size_t size = 0;
  uint8_t fill = 0;
  PoolOptions pool;
};

absl::StatusOr<ExportCommand> ParseExport(const Flags& flags) {
  ExportCommand command;
  VMM_ASSIGN_OR_RETURN(command.size, flags.Size("size", 0));
  VMM_ASSIGN_OR_RETURN(int fill, flags.Byte("fill"));
  if (command.size == 0 || fill < 0) {
    return absl::InvalidArgumentError("--size=BYTES (not 0) and --fill=BYTE are required");
  }
  command.fill = static_cast<uint8_t>(fill);
  command.pool.reserve_size = size_t{4} << 30;
  VMM_ASSIGN_OR_RETURN(command.pool.device, flags.Int("device", 0, 0, INT32_MAX));
  const std::string handle = flags.Get("handle");
  if (handle == "posix_fd") {
    command.pool.handle_type = HandleRequest::kPosixFd;
  } else if (handle == "fabric") {
    command.pool.handle_type = HandleRequest::kFabric;
  } else if (!handle.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--handle=posix_fd|fabric, got ", handle));
  }
  return command;
}

// Answers the exporter's commands on stdin until "exit" or end of input.
int ServeExport(Driver* driver, Pool& pool, void* ptr, size_t size) {
  const auto dev = reinterpret_cast<DevPtr>(ptr);
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "free") {
      absl::Status s = pool.Free(ptr);
      s.Update(pool.EmptyCache());
      if (!s.ok()) return Fail(kCleanupFailed, "free", s);
      PrintLine("freed");
    } else if (absl::StartsWith(line, "expect ")) {
      int value = 0;
      if (!absl::SimpleAtoi(line.substr(7), &value) || value < 0 || value > 255) {
        return Fail(kUsage, "stdin", absl::InvalidArgumentError("bad expect line: " + line));
      }
      const absl::Status s =
          CheckBytes(driver, dev, size, Expected{false, static_cast<uint8_t>(value)}, 0);
      PrintLine(s.ok() ? "match" : absl::StrCat("mismatch: ", s.message()));
    } else if (line == "exit") {
      break;
    }
  }
  return kOk;
}

int Export(Driver* driver, const ExportCommand& command) {
  absl::StatusOr<std::unique_ptr<Pool>> pool = CreateExportingPool(driver, command.pool);
  if (!pool.ok()) return Fail(kSetupFailed, "pool", pool.status());
  absl::StatusOr<void*> ptr = (*pool)->Allocate(command.size, 0);
  if (!ptr.ok()) return Fail(kSetupFailed, "Allocate", ptr.status());
  if (absl::Status s =
          WriteBytes(driver, reinterpret_cast<DevPtr>(*ptr), command.size, command.fill, 0);
      !s.ok()) {
    return Fail(kSetupFailed, "fill", s);
  }
  absl::StatusOr<BufferDescriptor> descriptor = ExportBuffer(**pool, *ptr);
  if (!descriptor.ok()) return Fail(kSetupFailed, "ExportBuffer", descriptor.status());
  PrintLine(absl::BytesToHexString(descriptor->Encode()));
  return ServeExport(driver, **pool, *ptr, command.size);
}

int RunExport(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(args, {"backend", "size", "fill", "handle", "device"}, {});
  if (!flags.ok()) return Fail(kUsage, "usage", flags.status());
  absl::StatusOr<ExportCommand> command = ParseExport(*flags);
  if (!command.ok()) return Fail(kUsage, "usage", command.status());
  absl::StatusOr<Driver*> driver = PeerDriver(*flags);
  if (!driver.ok()) return Fail(kSetupFailed, "driver", driver.status());
  return Export(*driver, *command);
}

// --- reexport ---------------------------------------------------------------------------------

int ReExport(Driver* driver, const Flags& flags) {
  absl::StatusOr<BufferDescriptor> descriptor =
      BufferDescriptor::Decode(absl::HexStringToBytes(flags.Get("descriptor")));
  if (!descriptor.ok()) return Fail(kImportFailed, "Decode", descriptor.status());
  absl::StatusOr<std::unique_ptr<ImportedBuffer>> buffer = ImportBuffer(driver, *descriptor);
  if (!buffer.ok()) return Fail(kImportFailed, "ImportBuffer", buffer.status());
  if (flags.Has("expect")) {
    absl::StatusOr<Expected> expected = ParseExpected(flags);
    if (!expected.ok()) return Fail(kUsage, "usage", expected.status());
    if (absl::Status s = CheckBytes(driver, (*buffer)->ptr(), (*buffer)->size(), *expected, 0);
        !s.ok()) {
      return Fail(kMismatch, "check", s);
    }
  }
  auto print_reexport = [&]() {
    absl::StatusOr<BufferDescriptor> again = ReExportImport(**buffer);
    if (!again.ok()) return Fail(kReExportFailed, "ReExportImport", again.status());
    PrintLine(absl::BytesToHexString(again->Encode()));
    return static_cast<int>(kOk);
  };
  if (int code = print_reexport(); code != kOk) return code;
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "again") {
      if (*buffer == nullptr) return Fail(kUsage, "stdin", absl::FailedPreconditionError("dropped"));
      if (int code = print_reexport(); code != kOk) return code;
    } else if (absl::StartsWith(line, "expect ")) {
      int value = 0;
      if (*buffer == nullptr || !absl::SimpleAtoi(line.substr(7), &value) || value < 0 ||
          value > 255) {
        return Fail(kUsage, "stdin", absl::InvalidArgumentError("bad expect line: " + line));
      }
      const absl::Status s = CheckBytes(driver, (*buffer)->ptr(), (*buffer)->size(),
                                        Expected{false, static_cast<uint8_t>(value)}, 0);
      PrintLine(s.ok() ? "match" : absl::StrCat("mismatch: ", s.message()));
    } else if (line == "drop") {
      buffer->reset();
      PrintLine(absl::StrCat("dropped ", FdServer::Get().size()));
    } else if (line == "exit") {
      break;
    }
  }
  return kOk;
}

int RunReExport(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, {"backend", "descriptor", "expect"}, {});
  if (!flags.ok()) return Fail(kUsage, "usage", flags.status());
  if (!flags->Has("descriptor")) {
    return Fail(kUsage, "usage", absl::InvalidArgumentError("--descriptor=HEX is required"));
  }
  absl::StatusOr<Driver*> driver = PeerDriver(*flags);
  if (!driver.ok()) return Fail(kSetupFailed, "driver", driver.status());
  return ReExport(*driver, *flags);
}

// --- import-loop ------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

double NsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

// Sets up the driver's context (a reservation made and dropped) before anything is timed.
absl::Status WarmUp(Driver* driver) {
  VMM_ASSIGN_OR_RETURN(size_t granularity, driver->Granularity(0));
  VMM_ASSIGN_OR_RETURN(DevPtr p, driver->Reserve(granularity, 0));
  return driver->Unreserve(p, granularity);
}

// The fds of a posix_fd descriptor fetched over the exporter's socket (and closed): the ns it
// took; 0 for other handle types.
absl::StatusOr<double> TimeFdFetch(const BufferDescriptor& d) {
  if (d.handle_type() != HandleType::kPosixFd) return 0.0;
  std::vector<FdToken> tokens;
  for (const auto& bytes : d.handles()) {
    VMM_ASSIGN_OR_RETURN(FdToken token, FdToken::Decode(bytes));
    tokens.push_back(token);
  }
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::vector<UniqueFd>> fds = FetchFds(tokens);
  const double ns = NsSince(start);
  if (!fds.ok()) {
    return absl::Status(fds.status().code(), absl::StrCat("FetchFds: ", fds.status().message()));
  }
  return ns;
}

// One line of import-loop: "ok FETCH_NS IMPORT_NS CLOSE_NS" for an encoded descriptor in hex.
absl::StatusOr<std::string> TimeImport(Driver* driver, const std::string& hex) {
  VMM_ASSIGN_OR_RETURN(BufferDescriptor d, BufferDescriptor::Decode(absl::HexStringToBytes(hex)));
  VMM_ASSIGN_OR_RETURN(double fetch_ns, TimeFdFetch(d));
  Clock::time_point start = Clock::now();
  absl::StatusOr<std::unique_ptr<ImportedBuffer>> buffer = ImportBuffer(driver, d);
  const double import_ns = NsSince(start);
  if (!buffer.ok()) {
    return absl::Status(buffer.status().code(),
                        absl::StrCat("ImportBuffer: ", buffer.status().message()));
  }
  start = Clock::now();
  buffer->reset();
  const double close_ns = NsSince(start);
  return absl::StrFormat("ok %.0f %.0f %.0f", fetch_ns, import_ns, close_ns);
}

int RunImportLoop(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, {"backend"}, {});
  if (!flags.ok()) return Fail(kUsage, "usage", flags.status());
  absl::StatusOr<Driver*> driver = PeerDriver(*flags);
  const absl::Status warm = driver.ok() ? WarmUp(*driver) : driver.status();
  PrintLine(warm.ok() ? "ready" : absl::StrCat("error ", warm.ToString()));
  if (!warm.ok()) return kSetupFailed;
  for (std::string line; std::getline(std::cin, line);) {
    absl::StatusOr<std::string> answer = TimeImport(*driver, line);
    std::string out = answer.ok() ? *answer : absl::StrCat("error ", answer.status().ToString());
    for (char& c : out) c = c == '\n' ? ' ' : c;
    PrintLine(out);
  }
  return kOk;
}

// --- main -------------------------------------------------------------------------------------

int Usage() {
  std::fprintf(stderr,
               "usage: vmm_peer driver-import|import|export|reexport|import-loop "
               "--flag=value...\n"
               "(tools/vmm_peer.cc describes each subcommand)\n");
  return kUsage;
}

int Run(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  g_command = "vmm_peer " + command;
  if (command == "driver-import") return RunDriverImport(args);
  if (command == "import") return RunImport(args);
  if (command == "export") return RunExport(args);
  if (command == "reexport") return RunReExport(args);
  if (command == "import-loop") return RunImportLoop(args);
  return Usage();
}

}  // namespace
}  // namespace vmm

int main(int argc, char** argv) { return vmm::Run(argc, argv); }
