/* gpupool's C ABI: the pool for code that cannot import C++ modules — C, Rust, Python's ctypes,
 * CUDA files, and the allocator hooks of PyTorch and CuPy. Link libgpupool_c.
 *
 * Conventions:
 *   - Every function returning gpupool_status validates its arguments and returns GPUPOOL_OK or
 *     the kind of what went wrong; gpupool_last_error() then holds a message a user can act on
 *     (per thread, until this thread's next gpupool call). Nothing throws across this boundary.
 *   - Devices are ints: a CUDA ordinal (0, 1, ...), or the id gpupool_device_open() returned for a
 *     simulated device (100 and up). GPUPOOL_ALL_DEVICES (-1) means every device a call may span.
 *   - Streams are void*: a cudaStream_t on CUDA devices (NULL is the default stream), or a stream
 *     from gpupool_stream_create() on simulated ones. gpupool never destroys a stream it did not
 *     make; its maker keeps it alive while memory freed on it may still be pending.
 *   - Pools are reference-counted handles: gpupool_pool_retain() for every extra owner,
 *     gpupool_pool_release() for each; memory still allocated when the last one goes returns to
 *     the device when it is freed.
 *   - Structs passed in and out start with struct_size = sizeof(the struct) as the caller knows it,
 *     so that later versions can add fields at the end.
 *   - Every function may be called from any thread, and memory may be freed on a thread other
 *     than the one that allocated it. As with free(), a free must not race with another call
 *     about the same pointer (a second free, gpupool_record_stream or gpupool_allocation_info on
 *     it from another thread): order those calls. A double free after the first is refused.
 */
#ifndef GPUPOOL_GPUPOOL_H
#define GPUPOOL_GPUPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define GPUPOOL_API __attribute__((visibility("default")))
#else
#define GPUPOOL_API
#endif

typedef enum gpupool_status {
  GPUPOOL_OK = 0,
  GPUPOOL_INVALID_INPUT = 1,       /* an argument is wrong: the message names it */
  GPUPOOL_OUT_OF_MEMORY = 2,       /* the device could not provide the bytes */
  GPUPOOL_POOL_LIMIT_EXCEEDED = 3, /* the pool's own hard limit for the device would be passed */
  GPUPOOL_DEVICE_UNAVAILABLE = 4,  /* no such device, or a build without its backend */
  GPUPOOL_CUDA_ERROR = 5,          /* a CUDA error other than out-of-memory */
  GPUPOOL_UNSUPPORTED = 6,         /* not for this device or build */
  GPUPOOL_INVALID_STATE = 7,       /* valid, but not now: a foreign or double free */
  GPUPOOL_INTERNAL_ERROR = 8       /* a bug in gpupool: please report the message */
} gpupool_status;

#define GPUPOOL_ALL_DEVICES (-1)
#define GPUPOOL_NO_LIMIT SIZE_MAX

/* gpupool_config.segments (docs/pool.md): device segments carved by the pool (the default);
   virtual segments, whose pages get memory as blocks touch them and give it back from anywhere
   in free space (plain segments where the device has no virtual memory); or none, each block a
   device allocation of its own. */
#define GPUPOOL_SEGMENTS_DEVICE 0
#define GPUPOOL_SEGMENTS_VIRTUAL 1
#define GPUPOOL_SEGMENTS_NONE 2
/* Every block is aligned to this many bytes (as cudaMalloc's); larger alignments are refused. */
#define GPUPOOL_ALIGNMENT ((size_t)256)

typedef struct gpupool_pool gpupool_pool;

typedef struct gpupool_config {
  size_t struct_size;         /* sizeof(gpupool_config) */
  size_t max_pool_size;       /* hard limit per device, bytes; GPUPOOL_NO_LIMIT = the device's memory */
  size_t max_cached_bytes;    /* soft cap on cached bytes per device; GPUPOOL_NO_LIMIT = none */
  size_t initial_reservation; /* bytes reserved on each device at its first use */
  int caching;                /* 0: pass-through, every free goes back to the device */
  double critical_pressure;   /* reserved / limit at which the cache is trimmed, in (0, 1] */
  int segments;               /* where large blocks come from: GPUPOOL_SEGMENTS_* (device
                                 segments above 64 KiB, virtual ones above 4 KiB) */
} gpupool_config;

typedef struct gpupool_stats {
  size_t struct_size;         /* sizeof(gpupool_stats) */
  size_t in_use_bytes;        /* blocks of live allocations */
  size_t requested_bytes;     /* what live allocations asked for */
  size_t cached_bytes;        /* freed blocks kept for reuse */
  size_t reserved_bytes;      /* in use + cached: what the pool holds from the device */
  size_t peak_in_use_bytes;
  size_t peak_reserved_bytes;
  size_t stranded_bytes;      /* cached, but in segments live blocks still use */
  uint64_t allocations;
  uint64_t frees;
  uint64_t cache_hits;
  uint64_t device_allocations;
  uint64_t device_frees;
  uint64_t out_of_memory_errors;
  uint64_t live_allocations;
} gpupool_stats;

/* Called (on the allocating thread) when a device's pressure crosses `threshold` upwards. */
typedef void (*gpupool_pressure_callback)(int device, double pressure, void* user_data);

/* ---- errors ---------------------------------------------------------------------------------- */
/* The message of this thread's last failed call ("" after a successful one). Valid until this
 * thread's next gpupool call. */
GPUPOOL_API const char* gpupool_last_error(void);
GPUPOOL_API const char* gpupool_status_name(gpupool_status status);

/* ---- devices and streams --------------------------------------------------------------------- */
/* "cuda", "cuda:N", "sim", "sim:SIZE" (e.g. sim:2GiB), "auto"; NULL reads GPUPOOL_DEVICE (else
 * "auto"). Every call opens a new simulated device; a CUDA device is its ordinal. */
GPUPOOL_API gpupool_status gpupool_device_open(const char* spec, int* device);
GPUPOOL_API gpupool_status gpupool_device_memory(int device, size_t* free_bytes, size_t* total_bytes);
/* A stream of `device` that gpupool makes and owns (for simulated devices, or for C code that
 * has no CUDA streams of its own). */
GPUPOOL_API gpupool_status gpupool_stream_create(int device, void** stream);
GPUPOOL_API gpupool_status gpupool_stream_destroy(int device, void* stream);
GPUPOOL_API gpupool_status gpupool_stream_synchronize(int device, void* stream);

/* ---- pools ----------------------------------------------------------------------------------- */
GPUPOOL_API void gpupool_config_init(gpupool_config* config); /* the defaults, struct_size set */
GPUPOOL_API gpupool_status gpupool_pool_create(const gpupool_config* config, gpupool_pool** pool);
/* GPUPOOL_MEMORY_LIMIT, GPUPOOL_CACHE_LIMIT and GPUPOOL_POOL (docs/pool.md), percentages of
 * GPUPOOL_DEVICE's device. */
GPUPOOL_API gpupool_status gpupool_pool_create_from_environment(gpupool_pool** pool);
GPUPOOL_API gpupool_pool* gpupool_pool_retain(gpupool_pool* pool);
GPUPOOL_API void gpupool_pool_release(gpupool_pool* pool);

/* ---- memory ---------------------------------------------------------------------------------- */
/* `bytes` (at least 1) on `device`, ordered on `stream`: usable at once by work on that stream,
 * by other streams after synchronizing with it. */
GPUPOOL_API gpupool_status gpupool_allocate(gpupool_pool* pool, int device, size_t bytes, void* stream,
                                            void** ptr);
/* As gpupool_allocate, refusing alignments above GPUPOOL_ALIGNMENT (and ones not a power of two). */
GPUPOOL_API gpupool_status gpupool_allocate_aligned(gpupool_pool* pool, int device, size_t bytes,
                                                    size_t alignment, void* stream, void** ptr);
/* Frees `ptr` (from this pool), ordered on `stream`. On the allocation's own stream the block is
 * reusable at once by work ordered after the free on that stream (and by other streams once that
 * work has finished). On another stream the block waits until the work queued on `stream` before
 * the free has finished, then returns to the allocation stream's cache. NULL ptr is a no-op; a
 * refused stream frees nothing (the memory stays the caller's). */
GPUPOOL_API gpupool_status gpupool_deallocate(gpupool_pool* pool, void* ptr, void* stream);
/* Declares that `ptr` is also used by work on `stream`: when it is freed, no stream reuses it
 * before that stream's work queued until then has finished. */
GPUPOOL_API gpupool_status gpupool_record_stream(gpupool_pool* pool, void* ptr, void* stream);
/* The bytes `ptr` was allocated with and its device. */
GPUPOOL_API gpupool_status gpupool_allocation_info(gpupool_pool* pool, const void* ptr, size_t* bytes,
                                                   int* device);

/* ---- figures and control --------------------------------------------------------------------- */
/* One device's figures, or GPUPOOL_ALL_DEVICES for the sums. `stats->struct_size` must be set. */
GPUPOOL_API gpupool_status gpupool_get_stats(gpupool_pool* pool, int device, gpupool_stats* stats);
GPUPOOL_API gpupool_status gpupool_reset_peaks(gpupool_pool* pool, int device);
/* The memory report (docs/pool.md) as JSON into `buffer` (NUL-terminated); `*needed` gets the
 * bytes it takes with the NUL. A NULL or short buffer gets nothing and GPUPOOL_INVALID_INPUT
 * unless capacity is 0 (the size query). */
GPUPOOL_API gpupool_status gpupool_report_json(gpupool_pool* pool, int device, char* buffer,
                                               size_t capacity, size_t* needed);
/* Gives cached blocks back until at most `keep_bytes` stay cached; `released` may be NULL. */
GPUPOOL_API gpupool_status gpupool_trim(gpupool_pool* pool, int device, size_t keep_bytes,
                                        size_t* released);
/* Waits for pending frees, then gives every cached block back (GPUPOOL_ALL_DEVICES: all). */
GPUPOOL_API gpupool_status gpupool_cleanup(gpupool_pool* pool, int device, size_t* released);
GPUPOOL_API gpupool_status gpupool_set_limit(gpupool_pool* pool, int device, size_t bytes);
GPUPOOL_API gpupool_status gpupool_get_limit(gpupool_pool* pool, int device, size_t* bytes);
GPUPOOL_API gpupool_status gpupool_set_cache_limit(gpupool_pool* pool, int device, size_t bytes);
GPUPOOL_API gpupool_status gpupool_pressure(gpupool_pool* pool, int device, double* pressure);
GPUPOOL_API gpupool_status gpupool_add_pressure_observer(gpupool_pool* pool, double threshold,
                                                         gpupool_pressure_callback callback,
                                                         void* user_data, uint64_t* id);
GPUPOOL_API gpupool_status gpupool_remove_pressure_observer(gpupool_pool* pool, uint64_t id);

/* ---- the process pool: what framework allocator hooks use ------------------------------------ */
/* One pool per process, made from the environment at first use. Borrowed: do not release it. */
GPUPOOL_API gpupool_status gpupool_process_pool(gpupool_pool** pool);

/* PyTorch's CUDAPluggableAllocator pair (torch.cuda.memory.CUDAPluggableAllocator(path,
 * "gpupool_torch_malloc", "gpupool_torch_free")), over the process pool. PyTorch does not check
 * the pointer it gets, so on failure malloc throws a C++ std::bad_alloc whose what() is
 * gpupool's message (PyTorch raises it in Python); it is meant for PyTorch only. 0 bytes give
 * NULL (empty tensors hold no memory). */
GPUPOOL_API void* gpupool_torch_malloc(size_t bytes, int device, void* stream);
GPUPOOL_API void gpupool_torch_free(void* ptr, size_t bytes, int device, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* GPUPOOL_GPUPOOL_H */
