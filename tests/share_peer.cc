// share_peer: the other process of tests/sharing_test.cc (and of the GPU run).
//
//   share_peer import --descriptor=HEX --expect=BYTE [--write=BYTE] [--wait] [--die] [--pidfd]
//       Imports the buffer (fds fetched with pidfd_getfd when --pidfd), checks every byte equals `expect`, optionally writes `write` over
//       it. --wait: prints "imported", then waits for a line on stdin before checking (the
//       exporter may free or exit meanwhile). --die: aborts right after importing.
//   share_peer export --size=BYTES --fill=BYTE [--handle=posix_fd|fabric]
//       Allocates and fills a buffer in a pool, prints the descriptor as hex, then obeys lines
//       on stdin: "free" frees it and empties the cache, "exit" exits.
// The backend is the default one (VMM_BACKEND chooses). Exit codes: 0 ok, 1 usage, 2 setup,
// 3 import failed (status on stderr), 5 wrong bytes, 6 write failed.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
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

int Import(int argc, char** argv, vmm::Driver* driver) {
  const std::string bytes = absl::HexStringToBytes(Flag(argc, argv, "descriptor"));
  int expect = 0, write = -1;
  if (!absl::SimpleAtoi(Flag(argc, argv, "expect"), &expect)) return Fail(1, "need --expect");
  if (!Flag(argc, argv, "write").empty()) (void)absl::SimpleAtoi(Flag(argc, argv, "write"), &write);
  auto descriptor = vmm::BufferDescriptor::Decode(bytes);
  if (!descriptor.ok()) return Fail(3, std::string(descriptor.status().ToString()));
  vmm::ImportOptions options;
  if (Has(argc, argv, "pidfd")) options.fd_fetch = vmm::FdFetch::kPidfd;
  auto buffer = vmm::ImportBuffer(driver, *descriptor, options);
  if (!buffer.ok()) return Fail(3, std::string(buffer.status().ToString()));
  if (Has(argc, argv, "die")) std::abort();
  if (Has(argc, argv, "wait")) {
    std::printf("imported\n");
    std::fflush(stdout);
    std::string line;
    std::getline(std::cin, line);
  }
  std::vector<uint8_t> host((*buffer)->size());
  if (!driver->MemcpyAsync(reinterpret_cast<vmm::DevPtr>(host.data()), (*buffer)->ptr(),
                           host.size(), 0).ok() ||
      !driver->SynchronizeStream(0).ok()) {
    return Fail(5, "copy out failed");
  }
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] != expect) {
      return Fail(5, "byte " + std::to_string(i) + " is " + std::to_string(host[i]) +
                         ", expected " + std::to_string(expect));
    }
  }
  if (write >= 0) {
    if (!driver->MemsetAsync((*buffer)->ptr(), static_cast<uint8_t>(write), host.size(), 0).ok() ||
        !driver->SynchronizeStream(0).ok()) {
      return Fail(6, "write failed");
    }
  }
  std::printf("ok %zu bytes\n", host.size());
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
  const std::string handle = Flag(argc, argv, "handle");
  if (handle == "posix_fd") options.handle_type = vmm::HandleRequest::kPosixFd;
  if (handle == "fabric") options.handle_type = vmm::HandleRequest::kFabric;
  auto pool = vmm::Pool::Create(driver, options);
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
