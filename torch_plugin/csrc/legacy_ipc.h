// PyTorch's own CUDA IPC handles, for memory vmm did not allocate: the blocks of a
// torch.cuda.MemPool over another allocator (foreign_segments.h), which PyTorch's allocator
// shares with cudaIpcGetMemHandle of their segment (the handle plus the block's offset in it),
// and the handles that a process whose CUDA allocator is PyTorch's own sends to one where vmm
// is. A storage of vmm's memory is shared as a vmm descriptor instead ("VMMD"...).
//
// The handle, as PyTorch writes it for a cudaMalloc segment: a version byte, 'c', then the
// 64-byte cudaIpcMemHandle_t; PyTorch also takes the bare 64 bytes (releases before the
// version byte). 'e' (an expandable segment of PyTorch's allocator) is not opened here.
// Version 1 is written: PyTorch's receivers take any version up to their own, and the 'c'
// layout has not changed since the byte came in.
//
// LegacyIpcMappings keeps one mapping per handle, shared by every storage opened from it
// (PyTorch sends each tensor of a segment with the segment's handle) and closed when the last
// of them goes: one open and one close per segment however many tensors of it arrive (older
// drivers refused a second open of one handle in a process; newer ones count opens).
// Failures: Open throws what the opener throws (nothing is kept then); a close that fails is
// the closer's to report (it must not throw; what it throws is dropped). Thread safe. Pure
// C++ (no CUDA, no PyTorch): the plugin gives it cudaIpcOpenMemHandle / cudaIpcCloseMemHandle;
// tests give it fakes (tests/legacy_ipc_test.cc).
#ifndef VMM_TORCH_PLUGIN_CSRC_LEGACY_IPC_H_
#define VMM_TORCH_PLUGIN_CSRC_LEGACY_IPC_H_

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace vmm_torch {

constexpr size_t kCudaIpcHandleSize = 64;  // sizeof(cudaIpcMemHandle_t)

// What a storage handle received by getIpcDevPtr is.
enum class IpcHandleKind {
  kVmm,         // a vmm descriptor (or anything else: vmm's import says what is wrong)
  kCudaMalloc,  // PyTorch's handle of a cudaMalloc segment: `raw` is its cudaIpcMemHandle_t
  kExpandable,  // PyTorch's handle of one of its expandable segments: not opened by vmm
};

struct ParsedIpcHandle {
  IpcHandleKind kind = IpcHandleKind::kVmm;
  std::string raw;  // kCudaMalloc: the 64 bytes of the cudaIpcMemHandle_t
};

// PyTorch's shareable handle of a cudaMalloc segment whose cudaIpcMemHandle_t is the 64
// bytes at `raw`.
inline std::string EncodeLegacyIpcHandle(const void* raw) {
  std::string out;
  out.reserve(2 + kCudaIpcHandleSize);
  out.push_back(static_cast<char>(1));  // version
  out.push_back('c');
  out.append(static_cast<const char*>(raw), kCudaIpcHandleSize);
  return out;
}

// As PyTorch reads a handle: 64 bytes are a bare cudaIpcMemHandle_t; otherwise a version
// byte, then the type ('c': the 64-byte handle follows).
inline ParsedIpcHandle ParseIpcHandle(const std::string& handle) {
  if (handle.compare(0, 4, "VMMD") == 0) return {};
  if (handle.size() == kCudaIpcHandleSize) return {IpcHandleKind::kCudaMalloc, handle};
  if (handle.size() >= 2 + kCudaIpcHandleSize && handle[1] == 'c') {
    return {IpcHandleKind::kCudaMalloc, handle.substr(2, kCudaIpcHandleSize)};
  }
  if (handle.size() >= 2 && handle[1] == 'e') return {IpcHandleKind::kExpandable, {}};
  return {};
}

class LegacyIpcMappings {
 public:
  // Maps the segment of a 64-byte handle on `device` (returns its address, or throws).
  using Opener = std::function<void*(const std::string& raw, int device)>;
  // Unmaps what Opener mapped.
  using Closer = std::function<void(void* ptr, int device)>;

  LegacyIpcMappings(Opener open, Closer close)
      : open_(std::move(open)), close_(std::move(close)) {}
  LegacyIpcMappings(const LegacyIpcMappings&) = delete;
  LegacyIpcMappings& operator=(const LegacyIpcMappings&) = delete;

  // The segment of handle `raw` mapped in this process (opened on `device` if it is not
  // mapped yet); the mapping stays while any pointer returned for it lives, and the returned
  // pointer must not outlive this object.
  std::shared_ptr<void> Open(const std::string& raw, int device) {
    auto drop = [this, raw](void*) { Drop(raw); };  // made first: copying may throw
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = mappings_.find(raw);
      if (it == mappings_.end()) {
        void* opened = open_(raw, device);  // throws: nothing kept
        it = mappings_.emplace(raw, Mapping{opened, device, 0}).first;
      }
      ++it->second.users;
      ptr = it->second.ptr;
    }
    // Outside the lock: where the shared_ptr cannot be made, it calls `drop` itself.
    return std::shared_ptr<void>(ptr, std::move(drop));
  }

  // Handles mapped now (tests).
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return mappings_.size();
  }

 private:
  struct Mapping {
    void* ptr = nullptr;
    int device = 0;
    size_t users = 0;
  };

  void Drop(const std::string& raw) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = mappings_.find(raw);
    if (it == mappings_.end() || --it->second.users > 0) return;
    const Mapping gone = it->second;
    mappings_.erase(it);
    // Closed under the lock, deliberately: an Open of the same handle meanwhile waits for the
    // close rather than open the handle again beside a mapping on its way out. In a
    // shared_ptr's deleter nothing may throw: a closer that does is caught here.
    try {
      close_(gone.ptr, gone.device);
    } catch (...) {
    }
  }

  const Opener open_;
  const Closer close_;
  mutable std::mutex mu_;
  std::map<std::string, Mapping> mappings_;  // by the handle's 64 bytes
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_LEGACY_IPC_H_
