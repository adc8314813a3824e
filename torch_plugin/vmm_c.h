/* vmm_c.h: vmm's C interface, the one the PyTorch plugin and other languages bind to.
 *
 * It lives in libvmm.so (Abseil linked in statically, only these symbols exported), which
 * holds the process's allocator state: one pool per device for the registered allocator,
 * explicit pools, and imported buffers. Load it once per process (ctypes, dlopen).
 *
 * Errors: functions returning int give 0 on success and -1 on failure; functions returning a
 * pointer or an id give NULL / -1. vmm_last_error() then describes the failure (per thread).
 * Strings and buffers the library returns are released with vmm_release_buffer().
 *
 * Options are "key=value" pairs separated by commas, e.g. "handle_type=posix_fd,
 * memory_limit=40G,peer_devices=1:2". Sizes accept K, M, G and T suffixes (powers of 1024).
 * Keys: handle_type (auto|none|posix_fd|fabric), reserve_size, memory_limit,
 * release_threshold, small_size, small_chunk, growth_fraction, max_growth_extra, max_chunk,
 * peer_devices. An unknown key or malformed value is an error naming it. Device pools (the
 * registered allocator) default to growth_fraction=0 (exact growth, the smallest footprint);
 * explicit pools take PoolOptions' defaults.
 */
#ifndef VMM_TORCH_PLUGIN_VMM_C_H_
#define VMM_TORCH_PLUGIN_VMM_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The last failure of this thread, or "" if none. */
const char* vmm_last_error(void);
/* "cuda" when a CUDA driver and device are present, else "host" (VMM_BACKEND forces). */
const char* vmm_backend(void);
/* Releases a string or buffer returned by this library. */
void vmm_release_buffer(void* buffer);

/* --- The device pools (what the registered PyTorch allocator uses) -------------------- */

/* Sets the options of device pools created from now on. Fails once a device pool exists. */
int vmm_configure(const char* options);
/* `size` bytes on `device` for `stream` (a cudaStream_t / CUstream; NULL: default stream).
 * NULL on failure; out-of-memory messages start with "out of memory". */
void* vmm_alloc(size_t size, int device, void* stream);
/* Frees a block of a device pool (device < 0: find it). */
int vmm_free(void* ptr, int device);
/* Marks `ptr` as used by `stream` too (torch.Tensor.record_stream). */
int vmm_record_stream(void* ptr, void* stream);
/* Releases the cached memory of `device`'s pool (device < 0: all pools, explicit ones too). */
int vmm_empty_cache(int device);
/* Caps `device`'s pool at `fraction` of the device's memory (0 < fraction <= 1). */
int vmm_set_memory_fraction(double fraction, int device);
/* Stats of `device`'s pool as JSON: {"vmm": {...}, "torch": {PyTorch key: value}}. An unused
 * device gives zeros. */
char* vmm_stats_json(int device);
int vmm_reset_peak_stats(int device);
int vmm_reset_accumulated_stats(int device);
/* All pools (device and explicit) in the structure of torch.cuda.memory._snapshot(), plus
 * "vmm_pools": vmm's own snapshot of each. */
char* vmm_snapshot_json(void);

/* --- Explicit pools ------------------------------------------------------------------- */

/* Creates a pool on `device` ("host", or a CUDA device index as text). Returns its id. */
int64_t vmm_pool_create(const char* device, const char* options);
/* Closes the pool; its memory goes back once its last block is freed. */
int vmm_pool_destroy(int64_t pool);
/* `size` bytes from the pool; `shareable` != 0 gives the block chunks of its own. */
void* vmm_pool_alloc(int64_t pool, size_t size, void* stream, int shareable);
int vmm_pool_empty_cache(int64_t pool);
char* vmm_pool_stats_json(int64_t pool);
/* "fabric", "posix_fd" or "none". */
const char* vmm_pool_handle_type(int64_t pool);
/* Device index of the pool (-1 for the host backend's pools, -2 on failure). */
int vmm_pool_device(int64_t pool);

/* Frees a block of any vmm pool (a tensor deleter: errors are logged, not returned). */
void vmm_block_free(void* ptr);
/* 1 if `ptr` lies in the address range of a vmm pool (device or explicit), else 0. */
int vmm_owns(const void* ptr);

/* --- Sharing ------------------------------------------------------------------------- */

/* Exports the live block starting at `ptr` (of any vmm pool): the descriptor's canonical
 * bytes in *out (release with vmm_release_buffer). */
int vmm_export(const void* ptr, uint8_t** out, size_t* out_len);
/* Imports a descriptor; returns an import id holding one reference. `device` < 0: the
 * owner's device. `backend`: "cuda", "host" or NULL (from the owner's UUID). `pidfd` != 0
 * fetches POSIX fds with pidfd_getfd instead of the exporter's socket. */
int64_t vmm_import(const uint8_t* descriptor, size_t len, int device, const char* backend,
                   int pidfd);
/* Address, size and device of the imported buffer: *device is the CUDA device it is mapped
 * on, or -1 for the host backend (what a tensor over it needs). */
int vmm_import_info(int64_t import_id, uint64_t* ptr, size_t* size, int* device);
/* Reference counting: the mapping goes away when the last reference is released. */
int vmm_import_retain(int64_t import_id);
/* (A tensor deleter: takes the id as a pointer-sized integer.) */
void vmm_import_release(void* import_id);

/* Builds a descriptor from received parts (handle_type 1: posix_fd, 2: fabric). `size` < 0:
 * the default; `owner` may be NULL. Errors follow the descriptor rules (InvalidArgument). */
int vmm_descriptor_from_handles(int handle_type, const uint8_t* const* handles,
                                const size_t* handle_lens, const int64_t* sizes, size_t count,
                                int64_t size, const char* owner, int64_t offset, uint8_t** out,
                                size_t* out_len);
/* A descriptor's fields as JSON (handles as hex). Fails for bytes that are not one. */
char* vmm_descriptor_json(const uint8_t* descriptor, size_t len);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* VMM_TORCH_PLUGIN_VMM_C_H_ */
