/* vmm_c.h: vmm's C interface, the one the PyTorch plugin and other languages bind to.
 *
 * It lives in libvmm.so (only these symbols exported), which holds the process's allocator
 * state (torch_plugin/process_state.h): one pool per device for the registered allocator,
 * explicit pools, private pools (CUDA graph pools, torch.cuda.MemPool) and imported buffers.
 * Load it once per process (ctypes, dlopen).
 *
 * Errors: functions returning int give 0 on success and -1 on failure; functions returning a
 * pointer or an id give NULL / -1 (vmm_pool_device: -2). vmm_stats_json, vmm_snapshot_json,
 * vmm_reset_*_stats, vmm_private_pool_use_count and the deleters (vmm_block_free,
 * vmm_import_release, vmm_snapshot_entries_release; the first two log their errors) do not
 * fail, but for vmm_stats_json and vmm_snapshot_json's NULL when the host has no memory for
 * their text (VMM_RESOURCE_EXHAUSTED). vmm_last_error_code() then gives the failure's code (a
 * vmm_status_code, the numeric absl::StatusCode) and vmm_last_error() its message (per
 * thread; the message names what failed and does not repeat the code). Codes by meaning:
 * VMM_INVALID_ARGUMENT for bad input, VMM_RESOURCE_EXHAUSTED for out of memory,
 * VMM_NOT_FOUND for a stale descriptor, VMM_UNAVAILABLE for an exporter that has gone,
 * VMM_FAILED_PRECONDITION for a call in the wrong state or memory that cannot be shared.
 * Strings and buffers the library returns are released with vmm_release_buffer().
 *
 * Options are "key=value" pairs separated by commas, e.g. "handle_type=posix_fd,
 * memory_limit=40G,peer_devices=1:2" (allocator/pool_options.h: keys handle_type
 * (auto|none|posix_fd|fabric), reserve_size, memory_limit, release_threshold, small_size,
 * small_chunk, growth_fraction, max_growth_extra, max_chunk, large_page, growth_page,
 * growth_page_from, pressure_page, peer_devices, spare_export_bytes, isolate_sends). Sizes
 * accept K, M, G and T suffixes (powers of 1024; "64MiB" and "2KB" too; small_size,
 * large_page, growth_page, growth_page_from and pressure_page also "auto"; small_chunk,
 * reserve_size, large_page and pressure_page at most 256 TiB). An unknown key, a key
 * given twice or a malformed value (also "1 K" or "+5") is an error naming it.
 * Every pool of this interface grows in single chunks (large_page=0) unless told, until a
 * growth would take it past half of what it may hold: then in pressure_page pages (4 MiB),
 * which move (pool_options.h; not the private pools of CUDA graphs and MemPools, which keep
 * their memory); device pools (the registered allocator) also default to
 * growth_fraction=0 (exact growth, the smallest footprint); explicit pools otherwise take
 * PoolOptions' defaults.
 *
 * This header is the interface's one declaration: the LibTorch extension includes it, and the
 * Python package's ctypes signatures (vmm_torch/_signatures.py) are checked against it by a
 * test.
 */
#ifndef VMM_TORCH_PLUGIN_VMM_C_H_
#define VMM_TORCH_PLUGIN_VMM_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The codes of absl::StatusCode, by value. */
enum vmm_status_code {
  VMM_OK = 0,
  VMM_CANCELLED = 1,
  VMM_UNKNOWN = 2,
  VMM_INVALID_ARGUMENT = 3,
  VMM_DEADLINE_EXCEEDED = 4,
  VMM_NOT_FOUND = 5,
  VMM_ALREADY_EXISTS = 6,
  VMM_PERMISSION_DENIED = 7,
  VMM_RESOURCE_EXHAUSTED = 8,
  VMM_FAILED_PRECONDITION = 9,
  VMM_ABORTED = 10,
  VMM_OUT_OF_RANGE = 11,
  VMM_UNIMPLEMENTED = 12,
  VMM_INTERNAL = 13,
  VMM_UNAVAILABLE = 14,
  VMM_DATA_LOSS = 15,
  VMM_UNAUTHENTICATED = 16
};

/* Which driver backend: CUDA, or the host backend (CPU memory, no GPU needed). */
enum vmm_backend {
  VMM_BACKEND_DEFAULT = 0, /* as an argument: the best available (or the descriptor's own) */
  VMM_BACKEND_CUDA = 1,
  VMM_BACKEND_HOST = 2
};

/* How memory is shared with another process. */
enum vmm_handle_type {
  VMM_HANDLE_NONE = 0,
  VMM_HANDLE_POSIX_FD = 1,
  VMM_HANDLE_FABRIC = 2
};

/* Bytes of one descriptor handle (a fabric handle, or a token naming a POSIX fd). */
#define VMM_HANDLE_BYTES 64

/* The code of this thread's last failure (VMM_OK if none). */
int vmm_last_error_code(void);
/* The CUDA driver's error (a CUresult) behind this thread's last failure, or 0 where that
 * failure was vmm's own, or the host backend's, rather than a CUDA driver call's. An out of
 * memory is told by its code (VMM_RESOURCE_EXHAUSTED), whatever its source: the pool's own
 * message for it carries no driver error. After a device-side assert, a call that
 * synchronises or waits on the GPU fails with CUDA_ERROR_ASSERT (710) here and VMM_INTERNAL
 * as its code (mapping new memory may still succeed). */
int vmm_last_driver_error(void);
/* The message of this thread's last failure, or "" if none. Once the thread's thread_local
 * objects are destroyed (at its exit; for the thread that calls exit(), before atexit
 * handlers and static destructors run) failures keep their code, and the message is a fixed
 * text saying so. */
const char* vmm_last_error(void);
/* VMM_BACKEND_CUDA when a CUDA driver and device are present, else VMM_BACKEND_HOST
 * (VMM_BACKEND=cuda|host in the environment forces one). */
int vmm_default_backend(void);
/* Releases a string or buffer returned by this library. */
void vmm_release_buffer(void* buffer);
/* Parses a byte count as pool options do ("512M", "2G", "4096"): 0 and *out set, or -1. */
int vmm_parse_byte_size(const char* text, uint64_t* out);
/* Whether `options` make a valid pool (the keys, values and limits of ParsePoolOptions and
 * CheckPoolOptions, allocator/pool_options.h; NULL or "" is none): 0, or -1 with
 * VMM_INVALID_ARGUMENT saying what is wrong. Creates nothing; what depends on the GPU (its
 * devices and peers, granularity, memory) and on the options of enable() that become the
 * defaults is checked when a pool is made. */
int vmm_check_pool_options(const char* options);

/* --- The device pools (what the registered PyTorch allocator uses) -------------------- */

/* Sets the options of device pools created from now on. Fails once a device pool exists. */
int vmm_configure(const char* options);
/* A stream passed to vmm_alloc / vmm_pool_alloc with this bit set is foreign: its owner may
 * destroy it once its work is done (torch.cuda.ExternalStream, a library's own stream). vmm
 * then makes no CUDA call on it after the allocation returns: the blocks cached for it stay its
 * own until a device synchronisation (the retry before out of memory, vmm_empty_cache), as
 * PyTorch's allocator keeps every stream's. */
#define VMM_FOREIGN_STREAM_BIT (1ull << 62)
/* `size` bytes on `device` for `stream` (a cudaStream_t / CUstream; NULL: default stream;
 * VMM_FOREIGN_STREAM_BIT may be set). NULL on failure (out of memory: VMM_RESOURCE_EXHAUSTED; more than the whole memory of the
 * device, checked before anything is reserved: VMM_INVALID_ARGUMENT). */
void* vmm_alloc(size_t size, int device, void* stream);
/* Frees a block of a device pool (device < 0: find it). */
int vmm_free(void* ptr, int device);
/* Marks `ptr` as used by `stream` too (torch.Tensor.record_stream). */
int vmm_record_stream(void* ptr, void* stream);
/* Releases the cached memory of `device`'s pool and of the private pools on it (device < 0:
 * all pools, explicit and private ones too). A private pool in use releases nothing.
 * VMM_INVALID_ARGUMENT for a device past 63 or, once a driver is loaded, one it does not have. */
int vmm_empty_cache(int device);
/* Caps what the device pool and the private pools of GPU `device` hold together at `fraction`
 * of its memory (0 <= fraction <= 1, 0 letting nothing more be mapped, as PyTorch takes it; a
 * pool's own memory_limit option still applies). VMM_INVALID_ARGUMENT for a fraction outside
 * [0, 1] or a device the driver does not have (before any driver is loaded, one past the 64
 * devices libvmm holds: loading the CUDA driver would run cuInit for the caller). */
int vmm_set_memory_fraction(double fraction, int device);
/* Counts `delta` bytes that another allocator holds for PyTorch on GPU `device` (the segments
 * of a torch.cuda.MemPool over a CUDAPluggableAllocator) against that GPU's memory fraction,
 * as PyTorch's allocator counts them: a delta > 0 that would take what the GPU's pools and
 * such segments hold past the fraction is refused (VMM_RESOURCE_EXHAUSTED) and not counted;
 * a delta < 0 gives bytes back (VMM_INVALID_ARGUMENT for more than is held), and holds of
 * more than 2^56 bytes on one GPU, which none has, are VMM_INVALID_ARGUMENT, as is a delta > 0
 * on a device the driver does not have (the driver's own error where it cannot load). Without
 * a fraction set, nothing but those is refused. */
int vmm_device_hold(int device, int64_t delta);
/* Counts `delta` bytes of blocks that such segments hand out (> 0) or take back (< 0) on GPU
 * `device` in the GPU's allocated bytes, whose peak (vmm_stats_json's allocated_bytes peak,
 * PyTorch's max_memory_allocated) is then the highest that vmm's pools and those blocks held
 * together, as the reserved peak is with vmm_device_hold's segments. VMM_INVALID_ARGUMENT,
 * nothing counted, for a delta > 0 on a device the driver does not have, a delta < 0 of more
 * than is counted, or more than 2^56 bytes. */
int vmm_device_hold_allocated(int device, int64_t delta);
/* Stats of `device`'s pool and the private pools on it (summed as vmm_device_torch_stats
 * says) as JSON: {"vmm": {...}, "torch": {PyTorch key: value}}. An unused device gives
 * zeros. */
char* vmm_stats_json(int device);
/* Reset the peaks / the cumulative counts of the same pools. */
int vmm_reset_peak_stats(int device);
int vmm_reset_accumulated_stats(int device);
/* All pools (device, explicit and private) in the structure of torch.cuda.memory._snapshot()
 * (a segment's "segment_pool_id" is its private pool's MempoolId, else [0, 0]; "vmm_pool" the
 * vmm_snapshot_get pool), plus "vmm_pools": vmm's own snapshot of each. */
char* vmm_snapshot_json(void);

/* --- Explicit pools ------------------------------------------------------------------- */

/* Creates a pool on `device` of `backend` (VMM_BACKEND_DEFAULT: the best available; the host
 * backend has one device unless VMM_HOST_DEVICES says more). Returns its id (> 0). */
int64_t vmm_pool_create(int backend, int device, const char* options);
/* Closes the pool; its memory goes back once its last block is freed. VMM_FAILED_PRECONDITION
 * for a private pool (vmm_private_pool_release closes it). */
int vmm_pool_destroy(int64_t pool);
/* `size` bytes from the pool (explicit or private); `shareable` != 0 gives the block chunks of
 * its own. */
void* vmm_pool_alloc(int64_t pool, size_t size, void* stream, int shareable);
int vmm_pool_empty_cache(int64_t pool);
/* From now on every block of the pool (explicit or private) gets a chunk of its own, handed
 * out whole and reused whole (torch.cuda.MemPool(no_split=True); Pool::SetNoSplit).
 * VMM_FAILED_PRECONDITION once the pool holds memory. */
int vmm_pool_set_no_split(int64_t pool);
char* vmm_pool_stats_json(int64_t pool);
/* The pool's vmm_handle_type, or -1. */
int vmm_pool_handle_type(int64_t pool);
/* Device index of the pool (-1 for the host backend's pools, -2 on failure). */
int vmm_pool_device(int64_t pool);

/* Frees a block of any vmm pool (a tensor deleter: errors are logged, not returned). NULL is
 * nothing to free, as for free(). */
void vmm_block_free(void* ptr);
/* 1 if `ptr` lies in the address range of a vmm pool (device, explicit or private), else 0. */
int vmm_owns(const void* ptr);

/* --- Statistics as structs ----------------------------------------------------------- */
/* What vmm_stats_json gives under PyTorch's key names, in PyTorch's own struct, for a C++
 * allocator that answers torch.cuda.memory_stats() (one list, allocator/stats.h, makes both;
 * meanings as there: "segment" counts physical chunks, "inactive_split" every cached free
 * block, num_device_alloc/free growths and chunk releases). [VMM_STAT_ALL] holds the pool's,
 * [VMM_STAT_SMALL] and [VMM_STAT_LARGE] those of its small arena (requests up to the pool's
 * small_size: 1 MiB, PyTorch's small-block limit, unless the large arena grows in pages) and
 * of its large one. oversize_* are zero and max_split_size is -1 (what PyTorch reports
 * without a limit: vmm splits blocks of every size). */

/* One statistic as PyTorch counts it (current == allocated - freed). */
typedef struct vmm_stat {
  int64_t current, peak, allocated, freed;
} vmm_stat;
/* Index into the vmm_stat arrays below: all blocks, the small arena, the large arena
 * (PyTorch's StatType AGGREGATE, SMALL_POOL, LARGE_POOL). */
enum vmm_stat_type {
  VMM_STAT_ALL = 0,
  VMM_STAT_SMALL = 1,
  VMM_STAT_LARGE = 2,
  VMM_STAT_TYPES = 3
};
/* PyTorch's DeviceStats (c10/core/CachingDeviceAllocator.h), field for field. */
typedef struct vmm_torch_stats {
  vmm_stat allocation[3], segment[3], active[3], inactive_split[3];
  vmm_stat allocated_bytes[3], reserved_bytes[3], active_bytes[3], inactive_split_bytes[3],
      requested_bytes[3];
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc,
      num_device_free;
  vmm_stat oversize_allocations, oversize_segments;
  int64_t max_split_size;
} vmm_torch_stats;
/* The device pool of `device` plus the private pools on it (zeros where vmm has not
 * allocated), summed field by field, but for the peaks of allocated_bytes and reserved_bytes
 * [VMM_STAT_ALL]: the highest the pools held together, as PyTorch's (max_memory_allocated,
 * max_memory_reserved), with what vmm_device_hold and vmm_device_hold_allocated counted for
 * other allocators (their current bytes are not in the figures: the caller adds them, and
 * those peaks are already of the sum). Other peaks are the sum of the pools' peaks (exact
 * while one pool alone has allocated, else at least the true peak). */
int vmm_device_torch_stats(int device, vmm_torch_stats* out);
/* vmm_device_torch_stats's allocated_bytes[VMM_STAT_ALL].current and
 * reserved_bytes[VMM_STAT_ALL].current, plus what vmm_device_hold_allocated and
 * vmm_device_hold count for other allocators, read without visiting the private pools (its
 * cost does not grow with how many are alive): what the profiler's memory events report at
 * each allocation and free, as PyTorch's allocator reports every pool of the GPU. (While a
 * released private pool's teardown waits for a capture to end, its memory still counts here
 * and no longer there.) VMM_INVALID_ARGUMENT for a null output. */
int vmm_device_usage(int device, int64_t* allocated, int64_t* reserved);
/* How many allocations the calling thread has made, in any pool, that mapped memory for
 * themselves (created chunks or moved them to where the request went). Read before and after
 * an allocation, it tells whether that allocation mapped memory; a cached allocation changes
 * nothing. Never fails. */
uint64_t vmm_thread_growths(void);
/* A chunk a pool mapped or unmapped (vmm_set_mapping_callback). */
typedef struct vmm_mapping_event {
  int device;
  uint64_t mempool_id[2]; /* a private pool's MempoolId; {0, 0} for the device pool */
  uint64_t address, size;
  int mapped;             /* 1: mapped (a growth, or a chunk moved there); 0: unmapped */
} vmm_mapping_event;
typedef void (*vmm_mapping_fn)(const vmm_mapping_event* event, void* ctx);
/* From now on fn(event, ctx) is called for every chunk the device pools and the private
 * pools map or unmap, one call per chunk, once the driver's call succeeded: the memory of
 * vmm_snapshot_get's segments (explicit pools are not told). A private pool that goes (its
 * last use released with no live block, or its last block freed after that) is told unmapped
 * whole as it leaves vmm_snapshot_get, though its teardown may come later (after a capture).
 * So the chunks mapped less those unmapped since are what vmm_snapshot_get shows of those
 * pools. NULL fn: no more calls. fn runs on the thread that made the pool map or unmap (an
 * allocation, a free, vmm_empty_cache, vmm_private_pool_release), with that pool's lock held:
 * it must not call libvmm, and must take only locks that are never held while calling libvmm
 * (not Python's: a thread holding it may be waiting for that pool's lock). A callback once
 * set may still run after it is replaced (each call keeps a few bytes for the life of the
 * process). Never fails: 0. */
int vmm_set_mapping_callback(vmm_mapping_fn fn, void* ctx);
/* One pool by id (explicit or private). */
int vmm_pool_torch_stats(int64_t pool, vmm_torch_stats* out);
/* The largest free block cached by the device pool of `device` and the private pools on it
 * (0 where there is none); VMM_INVALID_ARGUMENT for a null `out`. */
int vmm_device_largest_free_block(int device, uint64_t* out);

/* --- Snapshot as structs ------------------------------------------------------------- */
/* vmm_snapshot_json's segments and blocks (torch.cuda.memory._snapshot()) as structs, for the
 * same adapter (one set of rules, allocator/stats_json.h, makes both). */

enum vmm_block_state {
  VMM_BLOCK_INACTIVE = 0,           /* free (or retired: free memory of an exported chunk) */
  VMM_BLOCK_ACTIVE_ALLOCATED = 1,   /* allocated */
  VMM_BLOCK_ACTIVE_PENDING_FREE = 2 /* freed, other streams still use it */
};
typedef struct vmm_block_entry {
  uint64_t address, size;
  uint64_t requested_size; /* the caller's size while active, else 0 */
  uint64_t stream;         /* its stream; for a free block the one that may reuse it at once
                              (0: any stream) */
  int state;               /* vmm_block_state */
} vmm_block_entry;
typedef struct vmm_segment_entry {
  int device;       /* CUDA device index (host backend: its device index) */
  int64_t pool;     /* 0: the device pool of `device`; else the pool's id */
  uint64_t address, total_size;
  uint64_t allocated_size; /* bytes of its VMM_BLOCK_ACTIVE_ALLOCATED blocks */
  uint64_t active_size;    /* ... and of its VMM_BLOCK_ACTIVE_PENDING_FREE ones */
  uint64_t requested_size; /* bytes asked for its VMM_BLOCK_ACTIVE_ALLOCATED blocks */
  uint64_t stream;         /* the stream its active blocks share, else 0 */
  int is_large;     /* 1 for the large arena */
  size_t num_blocks;
  vmm_block_entry* blocks;
  uint64_t mempool_id[2]; /* a private pool's MempoolId, also once closed; else {0, 0} */
} vmm_segment_entry;
typedef struct vmm_snapshot_entries {
  size_t num_segments;
  vmm_segment_entry* segments;
} vmm_snapshot_entries;
/* Every pool of the process (device, explicit and private pools); segments as in
 * vmm_snapshot_json (maximal runs of mapped chunks of one arena) and blocks covering each
 * segment in address order. Release with vmm_snapshot_entries_release. */
int vmm_snapshot_get(vmm_snapshot_entries** out);
void vmm_snapshot_entries_release(vmm_snapshot_entries* snapshot);

/* --- Private pools (CUDA graph pools, MemPools) -------------------------------------- */
/* A private pool is named by PyTorch's MempoolId (two 64-bit halves) and a device. Only
 * allocations made into it use its memory, and none of its memory goes back to the driver
 * while its use count is above zero (a captured CUDA graph replays into its blocks, free
 * or not): vmm_empty_cache, the retry after a failed growth (a pool never takes memory from
 * another pool), memory limits etc. never release its chunks then. Its id works with the
 * vmm_pool_* functions (not vmm_pool_destroy); its blocks are freed with vmm_block_free or
 * vmm_free and exported and sent as an explicit pool's. See docs/DESIGN.md, private pools. */

/* Adds one use of private pool (id0, id1) on `device` of `backend`, creating it on first use
 * with the device pools' options (vmm_configure's), `options` applied on top (NULL or "":
 * those alone). Returns its vmm pool id (> 0); a later use returns the same id (backend and
 * options ignored). */
int64_t vmm_private_pool_use(int backend, int device, uint64_t id0, uint64_t id1,
                             const char* options);
/* Drops one use; returns the uses left (>= 0). At zero the pool closes: its cached (free)
 * memory is released at once and what its live blocks hold when they are freed (the pool
 * is destroyed with its last block); a later vmm_private_pool_use of the same id creates a
 * fresh pool. VMM_NOT_FOUND for an unknown pool. */
int vmm_private_pool_release(int device, uint64_t id0, uint64_t id1);
/* Uses of the pool (0 if there is none). */
int vmm_private_pool_use_count(int device, uint64_t id0, uint64_t id1);
/* The vmm id of the open private pool (id0, id1) on `device`, or -1 (VMM_NOT_FOUND). */
int64_t vmm_private_pool_find(int device, uint64_t id0, uint64_t id1);
/* The live (allocated, or pending free) blocks of pool `pool` (an explicit or private pool's
 * id) in address order: writes at most `cap` entries to `out` (NULL if `cap` is 0) and returns
 * how many blocks there are (call again with a larger buffer if more), or -1. */
int64_t vmm_pool_live_blocks(int64_t pool, vmm_block_entry* out, size_t cap);
/* Allocates exactly the range [addr, addr + size) of pool `pool` on `stream` (restoring a
 * CUDA graph tree's checkpoint): VMM_FAILED_PRECONDITION unless that whole range is free
 * space of the pool backed by memory it has mapped (no growth, no mapping; free blocks of the
 * range still tagged for other streams cost a device synchronisation). VMM_INVALID_ARGUMENT
 * for an address or size that is not a positive multiple of 512, a range outside the pool,
 * or a size the arena at `addr` does not serve (a block of up to small_size bytes lies in the
 * small arena, a larger one in the large arena). The block's requested size is `size`. Freed
 * like any block. */
void* vmm_pool_alloc_at(int64_t pool, uint64_t addr, size_t size, void* stream);

/* --- Sharing ------------------------------------------------------------------------- */

/* Exports the live block starting at `ptr` (of any vmm pool): the descriptor's canonical
 * bytes in *out (release with vmm_release_buffer). */
int vmm_export(const void* ptr, uint8_t** out, size_t* out_len);
/* Imports a descriptor's canonical bytes; returns an import id holding one reference.
 * `device` < 0: the owner's device. `backend`: a vmm_backend (VMM_BACKEND_DEFAULT: the
 * descriptor's own backend if its owner says, else the best available). `pidfd` != 0 fetches
 * POSIX fds with pidfd_getfd instead of the exporter's socket. */
int64_t vmm_import(const uint8_t* descriptor, size_t len, int device, int backend, int pidfd);
/* Address, size and device of the imported buffer: *device is the CUDA device it is mapped
 * on, or -1 for the host backend (what a tensor over it needs). */
int vmm_import_info(int64_t import_id, uint64_t* ptr, size_t* size, int* device);
/* Reference counting: the mapping goes away when the last reference is released. */
int vmm_import_retain(int64_t import_id);
/* (A tensor deleter: takes the id as a pointer-sized integer.) */
void vmm_import_release(void* import_id);

/* --- Sends (torch.multiprocessing and other one-receiver transfers) ------------------
 * A send is an export whose memory stays valid until its receiver has imported it, even
 * when the sender frees the tensor at once: the sender holds it (a pool block's free is
 * deferred; an import keeps one more reference) until the receiver acknowledges the send's
 * ticket (vmm_send_ack) or the send's lease ends (vmm_send_set_lease; default 600 s, or
 * VMM_SEND_LEASE_S). See docs/DESIGN.md §3b and §4 (send holds). */

/* How the storage starting at `ptr` can be sent. */
enum vmm_send_kind {
  VMM_SEND_NOT_VMM = 0,        /* not vmm memory: another sharing mechanism's business */
  VMM_SEND_IN_PLACE = 1,       /* a pool block: exported where it lies (with the other
                                  blocks of its chunks, unless its pool isolates sends) */
  VMM_SEND_RELOCATE = 2,       /* a block of a pool with isolate_sends that shares a chunk
                                  with another live block, or lies in its small arena: move
                                  it (vmm_alloc_beside, copy, swap) before sending */
  VMM_SEND_IMPORT = 3,         /* an imported buffer: forwarded with this process's handles */
  VMM_SEND_NOT_EXPORTABLE = 4  /* a block of a pool whose handle type is none */
};

/* Bytes of a send's ticket. */
#define VMM_TICKET_BYTES 64

/* The vmm_send_kind of the storage starting at `ptr` (never fails: VMM_SEND_NOT_VMM for
 * anything vmm does not know, including addresses inside a block). In a forked child, a block
 * of a pool its parent made reads as in the parent, and vmm_export_send refuses it
 * (VMM_FAILED_PRECONDITION): the plugin then sends a copy, as PyTorch sends a CPU tensor. */
int vmm_send_kind(const void* ptr);
/* vmm_send_kind, and in a pool that isolates sends, for VMM_SEND_IN_PLACE, also marks the
 * block's chunks exported, so that no block lands beside it before another thread sends it
 * (VMM_SEND_RELOCATE if one did). What the sending thread calls before a queue's feeder thread
 * pickles the tensor. */
int vmm_send_prepare(const void* ptr);
/* A block of at least `size` bytes in chunks of its own, from the pool that owns `ptr`, for
 * `stream`: where a VMM_SEND_RELOCATE block moves to. Freed with vmm_block_free. A closed
 * pool (vmm_pool_destroy, vmm_private_pool_release) takes it too: the pool goes with its last
 * block. */
void* vmm_alloc_beside(const void* ptr, size_t size, void* stream);
/* Exports the storage starting at `ptr` (VMM_SEND_IN_PLACE or VMM_SEND_IMPORT) for one
 * receiver and holds it until that receiver acknowledges `ticket` (VMM_TICKET_BYTES written)
 * or the lease ends. The descriptor's bytes in *out (vmm_release_buffer).
 * VMM_FAILED_PRECONDITION for a block sharing its chunks or of a pool that cannot export. */
int vmm_export_send(const void* ptr, uint8_t** out, size_t* out_len, uint8_t* ticket);
/* The receiver's acknowledgement of a send (after importing it, or failing to): the sender
 * lets go of the memory. VMM_UNAVAILABLE when the sender is gone, VMM_NOT_FOUND when it no
 * longer holds the send (acknowledged or expired), VMM_INVALID_ARGUMENT for bytes that are
 * not a ticket of this machine. */
int vmm_send_ack(const uint8_t* ticket, size_t len);
/* vmm_send_ack without waiting: the ticket is queued and a background thread acknowledges it
 * (batched per sender). VMM_INVALID_ARGUMENT for a length other than VMM_TICKET_BYTES. */
int vmm_send_ack_later(const uint8_t* ticket, size_t len);
/* The sender withdraws one of its own sends whose payload never left the process (the message
 * failed to pickle): its hold ends at once. VMM_FAILED_PRECONDITION for another process's
 * ticket or a send already acknowledged (left as it is), VMM_NOT_FOUND if the hold is gone,
 * VMM_INVALID_ARGUMENT if not a ticket. */
int vmm_send_cancel(const uint8_t* ticket, size_t len);
/* The calling thread's send token: a number (from 1) that no other thread of this process
 * has had or will have, which each send records (a Linux thread id comes round again). */
int64_t vmm_send_thread_token(void);
/* The sender withdraws every unacknowledged send that the thread whose token is
 * `thread_token` (vmm_send_thread_token, called on that thread) made in this process: what a
 * queue's feeder thread sent for a queue whose data the program gave up at exit. Their
 * memory is never reused (a fabric payload still imports while the process lives; a POSIX-fd
 * one is NOT_FOUND). Returns how many (never fails; 0 for a token that made none). */
int64_t vmm_send_withdraw_token(int64_t thread_token);
/* How many sends of this process are not yet acknowledged, leaving out those made by the
 * `count` threads whose tokens `thread_tokens` holds (counted in one step).
 * -1 (VMM_INVALID_ARGUMENT) if `thread_tokens` is null and `count` is not 0. */
int64_t vmm_send_held_except(const int64_t* thread_tokens, size_t count);
/* The receiver's half after importing a send as import `import_id` (vmm_import): queues the
 * ack (as vmm_send_ack_later) and, for when that import's mapping is unmapped, the report that
 * the memory is no longer mapped here, which lets the sender reuse it for a later send. An
 * `import_id` of 0 (the import failed) reports at once. VMM_INVALID_ARGUMENT for a length
 * other than VMM_TICKET_BYTES. */
int vmm_send_received(int64_t import_id, const uint8_t* ticket, size_t len);
/* Before importing a send: VMM_NOT_FOUND if this process imported `ticket` already and has
 * unmapped it since (a send is imported once: its sender may have reused the memory). */
int vmm_send_check(const uint8_t* ticket, size_t len);
/* Waits until every queued acknowledgement has been sent, at most `timeout_seconds`; returns
 * how many are still queued. */
int64_t vmm_send_ack_flush(double timeout_seconds);
/* Opens / closes a capture window (allocator/capture_window.h) around a CUDA graph capture
 * (and a MemPool's context), and pauses / resumes the thread that closes dropped imports
 * (import_closer.h) with it: closing synchronizes the devices, and an event query or an unmap
 * by any thread invalidates a capture in CUDA's global mode. Meanwhile the send ledger's
 * release thread waits and pools record and query no stream events. The pause returns once
 * no close and no release is running; holds nest. Return 0. */
int vmm_imports_hold_closing(void);
int vmm_imports_release_closing(void);
/* The lease of sends made from now on, in seconds (> 0). */
int vmm_send_set_lease(double seconds);
/* This process's sends: held now, and totals. */
typedef struct vmm_send_stats {
  uint64_t held;            /* sends held now */
  uint64_t held_bytes;      /* physical bytes they hold (whole chunks) */
  uint64_t peak_held_bytes; /* most bytes held at once */
  uint64_t holds;           /* sends made */
  uint64_t acked;           /* sends acknowledged by their receiver */
  uint64_t expired;         /* sends whose lease ended first */
  double lease_seconds;     /* the lease of new sends */
  uint64_t awaiting_release; /* acknowledged sends their receivers still map (now) */
  uint64_t released;        /* sends whose receivers reported they unmapped them */
} vmm_send_stats;
int vmm_send_stats_get(vmm_send_stats* out);
/* The send budget (bytes this process's unacknowledged sends may hold before a sender waits;
 * default 1 GiB or VMM_SEND_BUDGET; 0: none). vmm_send_over_budget: 1 if they hold more now,
 * else 0 (no wait). vmm_send_wait_for_room: waits while they hold more and their receivers keep
 * acknowledging, returning once no ack came for `stall_seconds` (receivers not reading); 1 if
 * it waited, else 0. */
int vmm_send_set_budget(int64_t bytes); /* VMM_INVALID_ARGUMENT if negative */
int vmm_send_over_budget(void);
int vmm_send_wait_for_room(double stall_seconds);
/* Waits until no send is held or `timeout_seconds` pass; returns the sends still held. */
int64_t vmm_send_wait(double timeout_seconds);

/* A descriptor's fields, as vmm_descriptor_decode fills them. */
typedef struct vmm_descriptor_fields {
  int32_t handle_type;  /* VMM_HANDLE_POSIX_FD or VMM_HANDLE_FABRIC */
  int32_t backend;      /* the exporter's vmm_backend from its owner UUID, or 0 if unknown */
  uint64_t count;       /* allocations */
  uint64_t size;        /* bytes of the buffer */
  uint64_t offset;      /* where the buffer starts in the first allocation */
  uint8_t* handles;     /* count * VMM_HANDLE_BYTES bytes, in address order */
  uint64_t* sizes;      /* count allocation sizes, in address order */
  char* owner_uuid;     /* NUL-terminated, NULL when the descriptor has none */
  uint64_t owner_uuid_len; /* bytes of owner_uuid (it may hold NULs) */
} vmm_descriptor_fields;

/* Decodes canonical descriptor bytes (hostile input: every rule is checked) into *out; 0, or
 * -1 with VMM_INVALID_ARGUMENT. Release *out with vmm_descriptor_fields_release. */
int vmm_descriptor_decode(const uint8_t* descriptor, size_t len, vmm_descriptor_fields* out);
/* Frees what vmm_descriptor_decode allocated in *fields (and zeroes it). */
void vmm_descriptor_fields_release(vmm_descriptor_fields* fields);
/* Builds a descriptor's canonical bytes from received parts (a vmm_handle_type, `count`
 * handles of handle_lens[i] bytes and `count` sizes). `size` < 0: the default; `owner` may be
 * NULL. Errors follow the descriptor rules (VMM_INVALID_ARGUMENT). */
int vmm_descriptor_from_handles(int handle_type, const uint8_t* const* handles,
                                const size_t* handle_lens, const int64_t* sizes, size_t count,
                                int64_t size, const char* owner, int64_t offset, uint8_t** out,
                                size_t* out_len);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* VMM_TORCH_PLUGIN_VMM_C_H_ */
