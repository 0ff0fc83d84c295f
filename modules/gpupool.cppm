// gpupool — a GPU memory pool for vector-search engines.
//
// import gpupool; gives the whole public API; each concern is a partition of its own:
//   :error      GpuError, ErrorKind, Result<T>
//   :units      byte sizes, parsing and formatting
//   :precision  element types (fp32, fp16, bf16, int8, bytes)
//   :device     Device (CUDA or host-simulated), Stream, Event
//   :buffer     ManagedBuffer, the owned handle of pooled device memory
//   :pool       GpuMemoryPool, BufferBatch, limits, stats, pressure, cleanup
//   :kernels    distances, k-nearest neighbours, norms, conversions, top-k merge
//   :sharded_corpus  one corpus over several devices, searched as one
//   :staging    pinned host staging memory (Boost.Pool) for uploads and downloads
//   :profiler   MemoryProfiler snapshots, peaks and phases; memory monitoring helpers
//   :report     memory_report: per-device figures and recommendations, as text or JSON
//   :planning   will_oom, auto_chunk, recommended batch sizes
//   :tracing    leak tracing, event history, trace files and their replay
//   :timeline   an SVG picture of a trace
//   :batching   OOM-safe adaptive batching over ranges and streams (process_in_batches), with
//     :batch_planner   the headroom and the batch-size policy
//     :batch_engine    the batching loop, its options, progress and report
//     :device_batches  DeviceBatches: host rows uploaded batch by batch
export module gpupool;
export import :error;
export import :units;
export import :precision;
export import :device;
export import :buffer;
export import :pool;
export import :kernels;
export import :sharded_corpus;
export import :staging;
export import :profiler;
export import :report;
export import :planning;
export import :tracing;
export import :timeline;
export import :batching;
