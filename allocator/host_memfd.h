// host_memfd.h: what identifies the host backend's memory (internal to host_driver.cc).
//
// Physical memory of the host backend is a memfd named "vmm-<32 hex tag>". This file knows
// that naming, the machine's boot identity (device UUIDs are derived from it), and the host
// backend's 64-byte fabric handle, which names the exporter's fd as /proc/<pid>/fd/<fd> and
// carries the file's inode, size, tag and the boot id's hash so that an importer can check
// what it opened. Every function is thread safe; failures are statuses naming the call.
//
// Fabric handle, 64 bytes, little-endian:
//   0 "VMMHOSTF"  8 u32 version (1)  12 u32 exporter pid  16 u32 fd in exporter
//   20 u32 reserved (0)  24 u64 inode  32 u64 size  40 16-byte tag  56 u64 boot id hash
#ifndef VMM_ALLOCATOR_HOST_MEMFD_H_
#define VMM_ALLOCATOR_HOST_MEMFD_H_

#include <fcntl.h>
#include <sys/stat.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/driver.h"
#include "allocator/unique_fd.h"

namespace vmm {
namespace host {

constexpr size_t kTagSize = 16;
using Tag = std::array<uint8_t, kTagSize>;

// The 32 hex digits of /proc/sys/kernel/random/boot_id (same in every process during one
// boot), or an empty string when it cannot be read.
std::string ReadBootIdHex();
// FNV-1a, 64 bits: a stable hash (unlike absl::Hash, which is seeded per process), so that
// every process of one boot computes the same value.
uint64_t StableHash(absl::string_view s);
// The 32 hex digits of `device`'s UUID: the boot id for device 0, else the boot id's first
// half and a hash of the boot id and the index, the same in every process of one boot.
std::string DeviceIdHex(const std::string& boot_id_hex, int device);

// The fields of a host fabric handle.
struct FabricFields {
  uint32_t pid = 0;
  uint32_t fd = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  Tag tag{};
  uint64_t boot_hash = 0;
};
FabricHandle EncodeFabric(const FabricFields& f);
// Checks the fixed fields; InvalidArgument for anything that is not a version 1 host handle.
absl::StatusOr<FabricFields> DecodeFabric(const FabricHandle& h);

std::string TagHex(const Tag& tag);
// 16 random bytes (getrandom).
absl::StatusOr<Tag> RandomTag();

// What a memfd is known by: its inode, size, and the tag in its name.
struct FileIdentity {
  uint64_t inode = 0;
  uint64_t size = 0;
  Tag tag{};
};
// Identifies an open memfd made by a host driver (any process). InvalidArgument when `fd` is
// not a non-empty regular file named "memfd:vmm-<32 hex>".
absl::StatusOr<FileIdentity> IdentifyMemfd(int fd);
// fstat(2) as a status.
absl::StatusOr<struct stat> Fstat(int fd);
// The seals every host memfd carries from its creation on: its size can never change, so no
// process holding it (through an export, or /proc/<pid>/fd) can truncate it under another's
// mapping (SIGBUS), and no further seal (F_SEAL_WRITE) can be added.
constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
// A new memfd of `size` bytes named "vmm-<hex tag>" (close-on-exec), sealed with
// kRequiredSeals right after it is sized.
absl::StatusOr<UniqueFd> CreateMemfd(const Tag& tag, size_t size);
// PermissionDenied, saying why, unless `fd` carries every seal of kRequiredSeals: importers
// refuse to map a file that could be resized under them.
absl::Status CheckSealed(int fd);

}  // namespace host
}  // namespace vmm

#endif  // VMM_ALLOCATOR_HOST_MEMFD_H_
