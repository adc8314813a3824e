#include "allocator/host_memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace host {

// --- Boot identity ------------------------------------------------------------------------

// The 32 hex digits of /proc/sys/kernel/random/boot_id (same in every process during one
// boot), or an empty string when it cannot be read.
std::string ReadBootIdHex() {
  UniqueFd fd(::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return "";
  char buf[128];
  ssize_t n = ::read(fd.get(), buf, sizeof(buf));
  if (n <= 0) return "";
  std::string hex;
  for (ssize_t i = 0; i < n; ++i) {
    if (absl::ascii_isxdigit(static_cast<unsigned char>(buf[i]))) {
      hex.push_back(absl::ascii_tolower(static_cast<unsigned char>(buf[i])));
    }
  }
  return hex.size() == 32 ? hex : "";
}

// FNV-1a, 64 bits: a stable hash (unlike absl::Hash, which is seeded per process), so that
// every process of one boot computes the same value.
uint64_t StableHash(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// The 32 hex digits of `device`'s UUID: the boot id for device 0, else the boot id's first
// half and a hash of the boot id and the index, the same in every process of one boot.
std::string DeviceIdHex(const std::string& boot_id_hex, int device) {
  if (device == 0) return boot_id_hex;
  const uint64_t hash = StableHash(absl::StrCat(boot_id_hex, "/device/", device));
  return absl::StrCat(boot_id_hex.substr(0, 16), absl::Hex(hash, absl::kZeroPad16));
}

// --- The fabric handle ---------------------------------------------------------------------

namespace {

constexpr char kFabricMagic[8] = {'V', 'M', 'M', 'H', 'O', 'S', 'T', 'F'};
constexpr uint32_t kFabricVersion = 1;
constexpr absl::string_view kMemfdPrefix = "vmm-";

absl::Status ErrnoStatus(absl::string_view call) { return absl::ErrnoToStatus(errno, call); }

void PutLe(uint8_t* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

uint64_t GetLe(const uint8_t* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

// The target of /proc/self/fd/<fd>, e.g. "/memfd:vmm-<32 hex> (deleted)".
absl::StatusOr<std::string> FdLinkTarget(int fd) {
  const std::string path = absl::StrCat("/proc/self/fd/", fd);
  char buf[512];
  ssize_t n = ::readlink(path.c_str(), buf, sizeof(buf) - 1);
  if (n < 0) return ErrnoStatus(absl::StrCat("readlink ", path));
  return std::string(buf, static_cast<size_t>(n));
}

// The tag in a memfd link target "/memfd:vmm-<32 hex> (deleted)", if it has that form.
bool ParseMemfdTag(absl::string_view link, Tag* tag) {
  const std::string marker = absl::StrCat("/memfd:", kMemfdPrefix);
  if (!absl::StartsWith(link, marker) || link.size() < marker.size() + 2 * kTagSize) {
    return false;
  }
  const absl::string_view hex = link.substr(marker.size(), 2 * kTagSize);
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  std::memcpy(tag->data(), bytes.data(), kTagSize);
  return true;
}

}  // namespace

absl::StatusOr<struct stat> Fstat(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus("fstat");
  return st;
}

FabricHandle EncodeFabric(const FabricFields& f) {
  FabricHandle h{};
  std::memcpy(h.data(), kFabricMagic, sizeof(kFabricMagic));
  PutLe(h.data() + 8, kFabricVersion, 4);
  PutLe(h.data() + 12, f.pid, 4);
  PutLe(h.data() + 16, f.fd, 4);
  PutLe(h.data() + 20, 0, 4);
  PutLe(h.data() + 24, f.inode, 8);
  PutLe(h.data() + 32, f.size, 8);
  std::memcpy(h.data() + 40, f.tag.data(), kTagSize);
  PutLe(h.data() + 56, f.boot_hash, 8);
  return h;
}

// Checks the fixed fields; InvalidArgument for anything that is not a version 1 host handle.
absl::StatusOr<FabricFields> DecodeFabric(const FabricHandle& h) {
  if (std::memcmp(h.data(), kFabricMagic, sizeof(kFabricMagic)) != 0) {
    return absl::InvalidArgumentError("host: not a host fabric handle (bad magic)");
  }
  const uint64_t version = GetLe(h.data() + 8, 4);
  if (version != kFabricVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: unsupported host fabric handle version ", version));
  }
  if (GetLe(h.data() + 20, 4) != 0) {
    return absl::InvalidArgumentError("host: malformed host fabric handle (reserved field set)");
  }
  FabricFields f;
  f.pid = static_cast<uint32_t>(GetLe(h.data() + 12, 4));
  f.fd = static_cast<uint32_t>(GetLe(h.data() + 16, 4));
  f.inode = GetLe(h.data() + 24, 8);
  f.size = GetLe(h.data() + 32, 8);
  std::memcpy(f.tag.data(), h.data() + 40, kTagSize);
  f.boot_hash = GetLe(h.data() + 56, 8);
  if (f.pid == 0 || f.pid > static_cast<uint32_t>(INT_MAX) ||
      f.fd > static_cast<uint32_t>(INT_MAX) || f.size == 0) {
    return absl::InvalidArgumentError("host: malformed host fabric handle (pid, fd or size)");
  }
  return f;
}

// --- memfd files ---------------------------------------------------------------------------

std::string TagHex(const Tag& tag) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(tag.data()), tag.size()));
}

absl::StatusOr<Tag> RandomTag() {
  Tag tag;
  size_t filled = 0;
  while (filled < tag.size()) {
    ssize_t n = ::getrandom(tag.data() + filled, tag.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("getrandom");
    }
    filled += static_cast<size_t>(n);
  }
  return tag;
}

// Identifies an open memfd made by a host driver (any process). InvalidArgument when `fd` is
// not a non-empty regular file named "memfd:vmm-<32 hex>".
absl::StatusOr<FileIdentity> IdentifyMemfd(int fd) {
  VMM_ASSIGN_OR_RETURN(struct stat st, Fstat(fd));
  VMM_ASSIGN_OR_RETURN(std::string link, FdLinkTarget(fd));
  FileIdentity id;
  if (!S_ISREG(st.st_mode) || st.st_size <= 0 || !ParseMemfdTag(link, &id.tag)) {
    return absl::InvalidArgumentError(
        absl::StrCat("host: fd ", fd, " (", link, ") is not a host driver allocation"));
  }
  id.inode = static_cast<uint64_t>(st.st_ino);
  id.size = static_cast<uint64_t>(st.st_size);
  return id;
}

// A new memfd of `size` bytes named "vmm-<hex tag>", sealed with kRequiredSeals.
absl::StatusOr<UniqueFd> CreateMemfd(const Tag& tag, size_t size) {
  const std::string name = absl::StrCat(kMemfdPrefix, TagHex(tag));
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus("memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return ErrnoStatus("ftruncate");
  if (::fcntl(fd.get(), F_ADD_SEALS, kRequiredSeals) != 0) return ErrnoStatus("fcntl(F_ADD_SEALS)");
  return fd;
}

// PermissionDenied unless `fd` carries every seal of kRequiredSeals.
absl::Status CheckSealed(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && (seals & kRequiredSeals) == kRequiredSeals) return absl::OkStatus();
  const std::string why =
      seals < 0 ? absl::StrCat("it cannot be sealed (", std::strerror(errno), ")")
                : absl::StrCat("its seals are 0x", absl::Hex(seals), ", not 0x",
                               absl::Hex(kRequiredSeals), " (shrink, grow, seal)");
  return absl::PermissionDeniedError(absl::StrCat(
      "refusing to map a memfd that is not sealed against resizing: ", why,
      "; it could be truncated under the mapping, and touching the lost pages kills the "
      "process (SIGBUS)"));
}

}  // namespace host
}  // namespace vmm
