// libvmm_symbols.h: looking up libvmm.so's C functions (torch_plugin/vmm_c.h) by name. The
// LibTorch extension (vmm_ops.cpp) and vmm's CUDA allocator module (vmm_cuda_allocator.cpp)
// do not link libvmm.so: they bind the very instance Python loaded (same path, so the same
// allocator state). Both throw c10::Error naming the library or the missing function.
#ifndef VMM_TORCH_PLUGIN_CSRC_LIBVMM_SYMBOLS_H_
#define VMM_TORCH_PLUGIN_CSRC_LIBVMM_SYMBOLS_H_

#include <dlfcn.h>

#include <string>

#include <c10/util/Exception.h>

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

}  // namespace

#endif  // VMM_TORCH_PLUGIN_CSRC_LIBVMM_SYMBOLS_H_
