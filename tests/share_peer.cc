// share_peer: the other process of tests/sharing_test.cc (and of the GPU run).
//
//   share_peer import --descriptor=HEX --expect=BYTE [--write=BYTE] [--wait] [--die] [--pidfd]
//                     [--device=N] [--peers=N,M...]
//       Imports the buffer (fds fetched with pidfd_getfd when --pidfd), checks every byte
//       equals `expect`, optionally writes `write` over it. --wait: prints "imported", then
//       waits for a line on stdin before checking (the exporter may free or exit meanwhile).
//       --die: aborts right after importing. --device: the device to map on (default: the
//       exporting device, found by UUID, else 0); --peers: further devices granted access.
//       The import device and every peer must then have access (HasAccess), and the bytes are
//       read and written by copies on a stream of the import device.
//   share_peer export --size=BYTES --fill=BYTE [--handle=posix_fd|fabric] [--device=N]
//       Allocates and fills a buffer in a pool on `device` (default 0), prints the descriptor
//       as hex, then obeys lines on stdin: "free" frees it and empties the cache, "expect BYTE"
//       prints "match" when every byte of the buffer equals BYTE (else "mismatch ..."), "exit"
//       exits.
// The backend is the default one (VMM_BACKEND chooses; on the host backend VMM_HOST_DEVICES
// sets how many devices it emulates). Exit codes: 0 ok, 1 usage, 2 setup, 3 import failed
// (status on stderr), 5 wrong bytes, 6 write failed, 7 a device lacks access.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "allocator/descriptor.h"
#include "allocator/driver_factory.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"

namespace {

std::string Flag(int argc, char** argv, const std::string& name) {
  const std::string prefix = "--" + name + "=";
  for (int i = 2; i < argc; ++i) {
    if (absl::StartsWith(argv[i], prefix)) return argv[i] + prefix.size();
  }
  return "";
}

bool Has(int argc, char** argv, const std::string& name) {
  for (int i = 2; i < argc; ++i) {
    if (argv[i] == "--" + name) return true;
  }
  return false;
}

int Fail(int code, const std::string& what) {
  std::fprintf(stderr, "share_peer: %s\n", what.c_str());
  return code;
}

// --device=N (default `fallback`), or -2 when malformed.
int DeviceFlag(int argc, char** argv, int fallback) {
  const std::string text = Flag(argc, argv, "device");
  if (text.empty()) return fallback;
  int device = 0;
  return absl::SimpleAtoi(text, &device) && device >= 0 ? device : -2;
}

// --peers=N,M,... into `peers`; false when malformed.
bool PeersFlag(int argc, char** argv, std::vector<int>* peers) {
  for (absl::string_view part : absl::StrSplit(Flag(argc, argv, "peers"), ',', absl::SkipEmpty())) {
    int device = 0;
    if (!absl::SimpleAtoi(part, &device) || device < 0) return false;
    peers->push_back(device);
  }
  return true;
}

// "" when every byte of [ptr, ptr+size) equals `expect` (copied out on `stream`), else why not.
std::string Mismatch(vmm::Driver* driver, vmm::DevPtr ptr, size_t size, int expect,
                     vmm::Stream stream) {
  std::vector<uint8_t> host(size);
  if (!driver->MemcpyAsync(reinterpret_cast<vmm::DevPtr>(host.data()), ptr, size, stream).ok() ||
      !driver->SynchronizeStream(stream).ok()) {
    return "copy out failed";
  }
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] != expect) {
      return "byte " + std::to_string(i) + " is " + std::to_string(host[i]) + ", expected " +
             std::to_string(expect);
    }
  }
  return "";
}

// "" when the import device and every peer may access the buffer, else which may not.
std::string MissingAccess(vmm::Driver* driver, const vmm::ImportedBuffer& buffer,
                          const std::vector<int>& peers) {
  std::vector<int> devices = {buffer.device()};
  devices.insert(devices.end(), peers.begin(), peers.end());
  for (int device : devices) {
    absl::StatusOr<bool> granted = driver->HasAccess(buffer.ptr(), device);
    if (!granted.ok()) return std::string(granted.status().ToString());
    if (!*granted) return "device " + std::to_string(device) + " has no access";
  }
  return "";
}

int Import(int argc, char** argv, vmm::Driver* driver) {
  const std::string bytes = absl::HexStringToBytes(Flag(argc, argv, "descriptor"));
  int expect = 0, write = -1;
  if (!absl::SimpleAtoi(Flag(argc, argv, "expect"), &expect)) return Fail(1, "need --expect");
  if (!Flag(argc, argv, "write").empty()) (void)absl::SimpleAtoi(Flag(argc, argv, "write"), &write);
  vmm::ImportOptions options;
  options.device = DeviceFlag(argc, argv, -1);
  if (options.device == -2 || !PeersFlag(argc, argv, &options.peer_devices)) {
    return Fail(1, "bad --device or --peers");
  }
  if (Has(argc, argv, "pidfd")) options.fd_fetch = vmm::FdFetch::kPidfd;
  auto descriptor = vmm::BufferDescriptor::Decode(bytes);
  if (!descriptor.ok()) return Fail(3, std::string(descriptor.status().ToString()));
  // A stream of the import device first when it is known, so that on CUDA the import works in
  // that device's context rather than creating one on device 0 (cuda_driver.cc).
  absl::StatusOr<vmm::Stream> stream = vmm::Stream{0};
  if (options.device >= 0) stream = driver->CreateStream(options.device);
  if (!stream.ok()) return Fail(2, std::string(stream.status().ToString()));
  auto buffer = vmm::ImportBuffer(driver, *descriptor, options);
  if (!buffer.ok()) return Fail(3, std::string(buffer.status().ToString()));
  if (Has(argc, argv, "die")) std::abort();
  if (Has(argc, argv, "wait")) {
    std::printf("imported\n");
    std::fflush(stdout);
    std::string line;
    std::getline(std::cin, line);
  }
  if (const std::string why = MissingAccess(driver, **buffer, options.peer_devices); !why.empty()) {
    return Fail(7, why);
  }
  const size_t size = (*buffer)->size();
  if (const std::string why = Mismatch(driver, (*buffer)->ptr(), size, expect, *stream);
      !why.empty()) {
    return Fail(5, why);
  }
  if (write >= 0) {
    if (!driver->MemsetAsync((*buffer)->ptr(), static_cast<uint8_t>(write), size, *stream).ok() ||
        !driver->SynchronizeStream(*stream).ok()) {
      return Fail(6, "write failed");
    }
  }
  buffer->reset();
  if (*stream != 0 && !driver->DestroyStream(*stream).ok()) return Fail(2, "DestroyStream failed");
  std::printf("ok %zu bytes\n", size);
  return 0;
}

int Export(int argc, char** argv, vmm::Driver* driver) {
  size_t size = 0;
  int fill = 0;
  if (!absl::SimpleAtoi(Flag(argc, argv, "size"), &size) ||
      !absl::SimpleAtoi(Flag(argc, argv, "fill"), &fill)) {
    return Fail(1, "need --size and --fill");
  }
  vmm::PoolOptions options;
  options.reserve_size = size_t{4} << 30;
  options.device = DeviceFlag(argc, argv, 0);
  if (options.device < 0) return Fail(1, "bad --device");
  const std::string handle = Flag(argc, argv, "handle");
  if (handle == "posix_fd") options.handle_type = vmm::HandleRequest::kPosixFd;
  if (handle == "fabric") options.handle_type = vmm::HandleRequest::kFabric;
  auto pool = vmm::CreateExportablePool(driver, options);
  if (!pool.ok()) return Fail(2, std::string(pool.status().ToString()));
  auto ptr = (*pool)->Allocate(size, 0);
  if (!ptr.ok()) return Fail(2, std::string(ptr.status().ToString()));
  const auto dev = reinterpret_cast<vmm::DevPtr>(*ptr);
  if (!driver->MemsetAsync(dev, static_cast<uint8_t>(fill), size, 0).ok() ||
      !driver->SynchronizeStream(0).ok()) {
    return Fail(2, "fill failed");
  }
  auto descriptor = vmm::ExportBuffer(**pool, *ptr);
  if (!descriptor.ok()) return Fail(2, std::string(descriptor.status().ToString()));
  std::printf("%s\n", absl::BytesToHexString(descriptor->Encode()).c_str());
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "free") {
      if (!(*pool)->Free(*ptr).ok() || !(*pool)->EmptyCache().ok()) return Fail(2, "free failed");
      std::printf("freed\n");
      std::fflush(stdout);
    } else if (absl::StartsWith(line, "expect ")) {
      int value = 0;
      if (!absl::SimpleAtoi(line.substr(7), &value)) return Fail(1, "bad expect line: " + line);
      const std::string why = Mismatch(driver, dev, size, value, 0);
      std::printf("%s\n", why.empty() ? "match" : ("mismatch: " + why).c_str());
      std::fflush(stdout);
    } else if (line == "exit") {
      break;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Fail(1, "usage: share_peer import|export ...");
  auto driver = vmm::DefaultDriver();
  if (!driver.ok()) return Fail(2, std::string(driver.status().ToString()));
  const std::string mode = argv[1];
  if (mode == "import") return Import(argc, argv, *driver);
  if (mode == "export") return Export(argc, argv, *driver);
  return Fail(1, "unknown mode " + mode);
}
