// libvmm_symbols.h: the table of libvmm.so's C functions (torch_plugin/vmm_c.h) that the
// LibTorch extension (vmm_ops.cpp) and vmm's CUDA allocator module (vmm_cuda_allocator.cpp)
// call, looked up by name. Neither links libvmm.so: each binds the very instance Python
// loaded (same path, so the same allocator state) with Bind(). Include it in one source file
// of a module (it defines that module's table, `libvmm`: not `vmm`, which is the namespace of
// the pool's plain headers, such as allocator/stat.h, that a module may include). Bind throws
// c10::Error naming the library or the missing function.
#ifndef VMM_TORCH_PLUGIN_CSRC_LIBVMM_SYMBOLS_H_
#define VMM_TORCH_PLUGIN_CSRC_LIBVMM_SYMBOLS_H_

#include <dlfcn.h>

#include <string>

#include <c10/util/Exception.h>

#include "torch_plugin/vmm_c.h"

namespace {

// A handle of libvmm.so at `path` (already loaded by Python: dlopen finds that instance).
inline void* OpenLibvmm(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(lib != nullptr, "vmm: cannot load ", path, ": ", dlerror());
  return lib;
}

// `*out` = the function `name` of `lib`, typed as its declaration in vmm_c.h.
template <typename F>
void Lookup(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(*out != nullptr, "vmm: libvmm.so lacks ", name);
}

// The functions of libvmm.so the extension and the CUDA module call, typed by vmm_c.h.
struct Vmm {
  decltype(&vmm_last_error_code) last_error_code = nullptr;
  decltype(&vmm_last_driver_error) last_driver_error = nullptr;
  decltype(&vmm_last_error) last_error = nullptr;
  decltype(&vmm_alloc) alloc = nullptr;
  decltype(&vmm_free) free = nullptr;
  decltype(&vmm_record_stream) record_stream = nullptr;
  decltype(&vmm_empty_cache) empty_cache = nullptr;
  decltype(&vmm_set_memory_fraction) set_memory_fraction = nullptr;
  decltype(&vmm_device_hold) device_hold = nullptr;
  decltype(&vmm_device_hold_allocated) device_hold_allocated = nullptr;
  decltype(&vmm_block_free) block_free = nullptr;
  decltype(&vmm_export) export_block = nullptr;
  decltype(&vmm_import) import_descriptor = nullptr;
  decltype(&vmm_import_info) import_info = nullptr;
  decltype(&vmm_import_release) import_release = nullptr;
  decltype(&vmm_reset_peak_stats) reset_peak_stats = nullptr;
  decltype(&vmm_reset_accumulated_stats) reset_accumulated_stats = nullptr;
  decltype(&vmm_device_torch_stats) device_torch_stats = nullptr;
  decltype(&vmm_device_usage) device_usage = nullptr;
  decltype(&vmm_thread_growths) thread_growths = nullptr;
  decltype(&vmm_set_mapping_callback) set_mapping_callback = nullptr;
  decltype(&vmm_device_largest_free_block) device_largest_free_block = nullptr;
  decltype(&vmm_snapshot_get) snapshot_get = nullptr;
  decltype(&vmm_snapshot_entries_release) snapshot_release = nullptr;
  decltype(&vmm_pool_alloc) pool_alloc = nullptr;
  decltype(&vmm_pool_set_no_split) pool_set_no_split = nullptr;
  decltype(&vmm_pool_create) pool_create = nullptr;
  decltype(&vmm_pool_destroy) pool_destroy = nullptr;
  decltype(&vmm_pool_empty_cache) pool_empty_cache = nullptr;
  decltype(&vmm_private_pool_use) private_pool_use = nullptr;
  decltype(&vmm_private_pool_release) private_pool_release = nullptr;
  decltype(&vmm_private_pool_use_count) private_pool_use_count = nullptr;
  decltype(&vmm_private_pool_find) private_pool_find = nullptr;
  decltype(&vmm_pool_live_blocks) pool_live_blocks = nullptr;
  decltype(&vmm_pool_alloc_at) pool_alloc_at = nullptr;
  decltype(&vmm_send_prepare) send_prepare = nullptr;
  decltype(&vmm_send_kind) send_kind = nullptr;
  decltype(&vmm_export_send) export_send = nullptr;
  decltype(&vmm_release_buffer) release_buffer = nullptr;
  decltype(&vmm_imports_hold_closing) imports_hold_closing = nullptr;
  decltype(&vmm_imports_release_closing) imports_release_closing = nullptr;
};

// This module's binding (Bind).
Vmm libvmm;

// Looks every function of Vmm up in libvmm.so at `path` (the instance Python loaded).
inline void Bind(const std::string& path) {
  void* lib = OpenLibvmm(path);
  Vmm v;
  Lookup(lib, "vmm_last_error_code", &v.last_error_code);
  Lookup(lib, "vmm_last_driver_error", &v.last_driver_error);
  Lookup(lib, "vmm_last_error", &v.last_error);
  Lookup(lib, "vmm_alloc", &v.alloc);
  Lookup(lib, "vmm_free", &v.free);
  Lookup(lib, "vmm_record_stream", &v.record_stream);
  Lookup(lib, "vmm_empty_cache", &v.empty_cache);
  Lookup(lib, "vmm_set_memory_fraction", &v.set_memory_fraction);
  Lookup(lib, "vmm_device_hold", &v.device_hold);
  Lookup(lib, "vmm_device_hold_allocated", &v.device_hold_allocated);
  Lookup(lib, "vmm_block_free", &v.block_free);
  Lookup(lib, "vmm_export", &v.export_block);
  Lookup(lib, "vmm_import", &v.import_descriptor);
  Lookup(lib, "vmm_import_info", &v.import_info);
  Lookup(lib, "vmm_import_release", &v.import_release);
  Lookup(lib, "vmm_reset_peak_stats", &v.reset_peak_stats);
  Lookup(lib, "vmm_reset_accumulated_stats", &v.reset_accumulated_stats);
  Lookup(lib, "vmm_device_torch_stats", &v.device_torch_stats);
  Lookup(lib, "vmm_device_usage", &v.device_usage);
  Lookup(lib, "vmm_thread_growths", &v.thread_growths);
  Lookup(lib, "vmm_set_mapping_callback", &v.set_mapping_callback);
  Lookup(lib, "vmm_device_largest_free_block", &v.device_largest_free_block);
  Lookup(lib, "vmm_snapshot_get", &v.snapshot_get);
  Lookup(lib, "vmm_snapshot_entries_release", &v.snapshot_release);
  Lookup(lib, "vmm_pool_alloc", &v.pool_alloc);
  Lookup(lib, "vmm_pool_set_no_split", &v.pool_set_no_split);
  Lookup(lib, "vmm_pool_create", &v.pool_create);
  Lookup(lib, "vmm_pool_destroy", &v.pool_destroy);
  Lookup(lib, "vmm_pool_empty_cache", &v.pool_empty_cache);
  Lookup(lib, "vmm_private_pool_use", &v.private_pool_use);
  Lookup(lib, "vmm_private_pool_release", &v.private_pool_release);
  Lookup(lib, "vmm_private_pool_use_count", &v.private_pool_use_count);
  Lookup(lib, "vmm_private_pool_find", &v.private_pool_find);
  Lookup(lib, "vmm_pool_live_blocks", &v.pool_live_blocks);
  Lookup(lib, "vmm_pool_alloc_at", &v.pool_alloc_at);
  Lookup(lib, "vmm_send_prepare", &v.send_prepare);
  Lookup(lib, "vmm_send_kind", &v.send_kind);
  Lookup(lib, "vmm_export_send", &v.export_send);
  Lookup(lib, "vmm_release_buffer", &v.release_buffer);
  Lookup(lib, "vmm_imports_hold_closing", &v.imports_hold_closing);
  Lookup(lib, "vmm_imports_release_closing", &v.imports_release_closing);
  libvmm = v;
}

}  // namespace

#endif  // VMM_TORCH_PLUGIN_CSRC_LIBVMM_SYMBOLS_H_
