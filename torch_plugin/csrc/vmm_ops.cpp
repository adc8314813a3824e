// vmm's LibTorch extension: tensors over vmm memory, and the functions PyTorch's
// CUDAPluggableAllocator calls.
//
// The allocator state lives in libvmm.so (vmm_c.h, included here for the functions' types).
// This extension does not link it: bind() opens the same libvmm.so that Python loaded (same
// path, so the same instance) and looks up the few functions it calls. Built by Bazel against
// Debian's LibTorch for CI, and by `pip install` against the user's torch.
//
// Ops (torch.ops.vmm.*):
//   bind(str libvmm_path) -> ()
//   wrap(int ptr, int nbytes, int[] sizes, int[] strides, int storage_offset, ScalarType dtype,
//        Device device) -> Tensor
//       A tensor over the vmm pool block [ptr, ptr + nbytes), freed when the storage dies.
//       A failed wrap takes nothing over (the caller still owns the block).
//   wrap_import(int import_id, int[] sizes, int[] strides, int storage_offset,
//               ScalarType dtype) -> Tensor
//       A tensor over the whole buffer of import `import_id`, on the device it is mapped on
//       (CPU for the host backend), that releases one reference of the import when its
//       storage dies. The consumer's half of a share in one call: address, size and device
//       come from libvmm.so (vmm_import_info), not from Python. Takes nothing over on failure.
//   storage_info(Tensor t) -> (int data_ptr, int nbytes)
//       Where the tensor's storage starts and how big it is (across torch versions).
//   storage_bytes(Tensor t) -> Tensor
//       A flat uint8 view of the whole storage of `t` (across torch versions).
//   swap_storage(Tensor a, Tensor b) -> ()
//       Swaps the memory under the storages of `a` and `b` (same device, same byte size):
//       every view of either storage now reads the other's memory, and each memory is still
//       freed by its own deleter. How a block that shares its chunks moves to chunks of its
//       own before it is sent (vmm_torch.sharing.relocate_storage). Nothing changes on error.
// Exported C functions for CUDAPluggableAllocator: vmm_torch_malloc, vmm_torch_free,
// vmm_torch_init, vmm_torch_empty_cache, vmm_torch_memory_fraction, vmm_torch_record_stream.
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>

#include <torch/library.h>
#include <ATen/ATen.h>

#include "torch_plugin/csrc/libvmm_symbols.h"
#include "torch_plugin/vmm_c.h"

namespace {

void RequireBound() { TORCH_CHECK(libvmm.alloc != nullptr, "vmm: call torch.ops.vmm.bind first"); }

void FreeBlock(void* ptr) { libvmm.block_free(ptr); }
void ReleaseImport(void* context) { libvmm.import_release(context); }

// Fails unless a view of `sizes`/`strides` at `storage_offset` (elements of `itemsize` bytes)
// lies inside `nbytes` bytes. Overflow-safe: the values come from other processes. Failures
// are bad arguments: c10::ValueError, which Python sees as ValueError.
void CheckViewFits(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t storage_offset,
                   int64_t itemsize, int64_t nbytes) {
  TORCH_CHECK_VALUE(sizes.size() == strides.size(), "vmm.wrap: ", sizes.size(),
                    " sizes but ", strides.size(), " strides");
  TORCH_CHECK_VALUE(storage_offset >= 0, "vmm.wrap: negative storage offset");
  int64_t last = storage_offset;  // index of the last element the view reaches
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK_VALUE(sizes[i] >= 0 && strides[i] >= 0, "vmm.wrap: negative size or stride");
    if (sizes[i] == 0) empty = true;
    int64_t reach = 0;
    TORCH_CHECK_VALUE(
        !__builtin_mul_overflow(sizes[i] == 0 ? 0 : sizes[i] - 1, strides[i], &reach) &&
            !__builtin_add_overflow(last, reach, &last),
        "vmm.wrap: the view's extent overflows");
  }
  if (empty) return;
  int64_t end = 0;
  TORCH_CHECK_VALUE(!__builtin_add_overflow(last, int64_t{1}, &end) &&
                        !__builtin_mul_overflow(end, itemsize, &end),
                    "vmm.wrap: the view's extent overflows");
  TORCH_CHECK_VALUE(end <= nbytes, "vmm.wrap: the view needs ", end,
                    " bytes, the storage has ", nbytes);
}

// PyTorch sets its CUDA state up (allocator, streams) when the first CUDA tensor of a
// process is allocated. TensorOver allocates nothing, so the first CUDA tensor it makes
// allocates an empty one for that (at::globalContext()'s lazy-init call differs across torch
// versions; at::empty is stable). Later calls cost one atomic load.
void InitCudaOnce(c10::Device device) {
  static std::once_flag once;
  std::call_once(once, [device] { (void)at::empty({0}, at::TensorOptions().device(device)); });
}

// A tensor over [data, data + nbytes) with `sizes`, `strides` and `storage_offset`, built
// directly like at::from_blob: no placeholder tensor from the allocator of the device (on CUDA a
// malloc and a free through CUDAPluggableAllocator, with device guards, per call), no set_
// through the dispatcher. `deleter(context)` runs when the storage dies.
// Everything that can fail happens before the storage takes the memory over, so that a
// failure takes nothing over: the caller still owns the block or reference.
at::Tensor TensorOver(void* data, int64_t nbytes, at::IntArrayRef sizes,
                      at::IntArrayRef strides, int64_t storage_offset, at::ScalarType dtype,
                      c10::Device device, c10::DeleterFnPtr deleter, void* context) {
  TORCH_CHECK(nbytes >= 0, "vmm.wrap: negative nbytes");
  TORCH_CHECK(device.is_cpu() || (device.is_cuda() && device.has_index()),
              "vmm.wrap: device ", device, " is neither the CPU nor an indexed CUDA device");
  TORCH_CHECK_VALUE(dtype != at::ScalarType::Undefined && !c10::isQIntType(dtype),
                    "vmm.wrap: dtype ", dtype, " cannot be wrapped");
  CheckViewFits(sizes, strides, storage_offset, static_cast<int64_t>(c10::elementSize(dtype)),
                nbytes);
  if (device.is_cuda()) InitCudaOnce(device);
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                       c10::DataPtr(nullptr, device), /*allocator=*/nullptr,
                       /*resizable=*/false);
  const c10::DispatchKeySet keys(c10::computeDispatchKey(dtype, at::kStrided, device));
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys,
                                                          c10::scalarTypeToTypeMeta(dtype));
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(sizes, strides);
  impl->set_storage_offset(storage_offset);
  // Last, and it cannot fail: the storage takes the memory over.
  impl->storage().set_data_ptr_noswap(c10::DataPtr(data, context, deleter, device));
  return t;
}

at::Tensor Wrap(int64_t ptr, int64_t nbytes, at::IntArrayRef sizes, at::IntArrayRef strides,
                int64_t storage_offset, at::ScalarType dtype, at::Device device) {
  RequireBound();
  void* data = reinterpret_cast<void*>(ptr);
  return TensorOver(data, nbytes, sizes, strides, storage_offset, dtype, device, &FreeBlock,
                    data);
}

at::Tensor WrapImport(int64_t import_id, at::IntArrayRef sizes, at::IntArrayRef strides,
                      int64_t storage_offset, at::ScalarType dtype) {
  RequireBound();
  uint64_t ptr = 0;
  size_t size = 0;
  int device = -1;
  TORCH_CHECK(libvmm.import_info(import_id, &ptr, &size, &device) == 0, "vmm.wrap_import: ",
              libvmm.last_error());
  TORCH_CHECK(size <= static_cast<uint64_t>(INT64_MAX), "vmm.wrap_import: size overflows");
  const c10::Device where =
      device < 0 ? c10::Device(c10::kCPU)
                 : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  return TensorOver(reinterpret_cast<void*>(ptr), static_cast<int64_t>(size), sizes, strides,
                    storage_offset, dtype, where, &ReleaseImport,
                    reinterpret_cast<void*>(import_id));
}

std::tuple<int64_t, int64_t> StorageInfo(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  return {reinterpret_cast<int64_t>(s.data()), static_cast<int64_t>(s.nbytes())};
}

at::Tensor StorageBytes(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  at::Tensor out = at::empty({0}, t.options().dtype(at::kByte));
  out.set_(s, 0, {static_cast<int64_t>(s.nbytes())}, {1});
  return out;
}

void SwapStorage(const at::Tensor& a, const at::Tensor& b) {
  c10::StorageImpl* x = a.storage().unsafeGetStorageImpl();
  c10::StorageImpl* y = b.storage().unsafeGetStorageImpl();
  TORCH_CHECK_VALUE(x != nullptr && y != nullptr, "vmm.swap_storage: a tensor has no storage");
  if (x == y) return;
  TORCH_CHECK_VALUE(x->nbytes() == y->nbytes(), "vmm.swap_storage: storages of ", x->nbytes(),
                    " and ", y->nbytes(), " bytes");
  TORCH_CHECK_VALUE(x->device() == y->device(), "vmm.swap_storage: storages on ", x->device(),
                    " and ", y->device());
  c10::DataPtr from_x = x->set_data_ptr(c10::DataPtr(nullptr, x->device()));
  c10::DataPtr from_y = y->set_data_ptr(std::move(from_x));
  x->set_data_ptr_noswap(std::move(from_y));
}

}  // namespace

TORCH_LIBRARY(vmm, m) {
  m.def("bind(str libvmm_path) -> ()", &Bind);
  m.def("wrap(int ptr, int nbytes, int[] sizes, int[] strides, int storage_offset, "
        "ScalarType dtype, Device device) -> Tensor",
        &Wrap);
  m.def("wrap_import(int import_id, int[] sizes, int[] strides, int storage_offset, "
        "ScalarType dtype) -> Tensor",
        &WrapImport);
  m.def("storage_info(Tensor t) -> (int, int)", &StorageInfo);
  m.def("storage_bytes(Tensor t) -> Tensor", &StorageBytes);
  m.def("swap_storage(Tensor a, Tensor b) -> ()", &SwapStorage);
}

// --- CUDAPluggableAllocator entry points ----------------------------------------------------

extern "C" {

__attribute__((visibility("default"))) void* vmm_torch_malloc(size_t size, int device,
                                                               void* stream) {
  RequireBound();
  void* p = libvmm.alloc(size, device, stream);
  if (p == nullptr) {
    const std::string error = libvmm.last_error();
    if (libvmm.last_error_code() == VMM_RESOURCE_EXHAUSTED) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", size,
                       " bytes on device ", device, ". vmm: ", error);
    }
    TORCH_CHECK(false, "vmm: allocation of ", size, " bytes on device ", device, " failed: ",
                error);
  }
  return p;
}

__attribute__((visibility("default"))) void vmm_torch_free(void* ptr, size_t size, int device,
                                                             void* stream) {
  if (libvmm.free != nullptr && libvmm.free(ptr, device) != 0) {
    TORCH_WARN("vmm: free failed: ", libvmm.last_error());
  }
}

__attribute__((visibility("default"))) void vmm_torch_init(int device_count) {}

__attribute__((visibility("default"))) void vmm_torch_empty_cache() {
  if (libvmm.empty_cache != nullptr && libvmm.empty_cache(-1) != 0) {
    TORCH_WARN("vmm: empty_cache failed: ", libvmm.last_error());
  }
}

__attribute__((visibility("default"))) void vmm_torch_memory_fraction(double fraction,
                                                                      int device) {
  RequireBound();
  TORCH_CHECK(libvmm.set_memory_fraction(fraction, device) == 0, "vmm: ", libvmm.last_error());
}

__attribute__((visibility("default"))) void vmm_torch_record_stream(void* ptr, void* stream) {
  RequireBound();
  // Memory vmm does not own (an import, DLPack) is left alone, as PyTorch's allocator ignores
  // pointers it did not allocate.
  TORCH_CHECK(libvmm.record_stream(ptr, stream) == 0 ||
                  libvmm.last_error_code() == VMM_INVALID_ARGUMENT,
              "vmm: ", libvmm.last_error());
}

}  // extern "C"
