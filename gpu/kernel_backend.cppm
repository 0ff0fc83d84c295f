// KernelBackend: the one interface gpu/kernels.cpp runs kernels through. Each kind of device has
// its backend — the CPU kernels for a simulated device (gpu/cpu_backend.cpp), the CUDA kernels for
// a CUDA device (gpu/cuda_backend.cpp, or gpu/cuda_absent.cpp in a build without CUDA, which
// answers DeviceUnavailable) — and kernel_backend(device) picks it.
//
// Every argument arrives validated and in the kernels' vocabulary (gpu/kernel_vocabulary.hpp);
// the work runs on `stream`, which gpu/kernels.cpp has ordered after the inputs' own streams.
// Pointers are the buffers' device memory. A backend takes its temporaries from the pool and
// keeps them until its queued work has run.
module;
#include "kernel_vocabulary.hpp"

#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <span>
#include <string_view>
#include <utility>
module gpupool:kernel_backend;
import :error;
import :precision;
import :device;
import :buffer;
import :pool;
import :kernels;
import :batch_planner;

namespace gpupool {

// A distance or kNN problem: every query row against every corpus row.
struct DistanceProblem {
  kernels::Matrix queries, corpus;
  std::size_t dim = 0;
  kernels::Metric metric = kernels::Metric::L2;
  bool tf32 = false;  // ComputeMode::Tf32: fp32 inputs may be multiplied in TF32
};

// Sorted top-k lists, rows × k: fp32 distances and int32 indices (knn's result, merge_topk's
// output, fold_topk's running lists).
struct TopkLists {
  float* distances = nullptr;
  std::int32_t* indices = nullptr;
};

// knn's exact re-rank: the fp32 originals of both inputs (rows × dim, rows of the corpus) and
// `candidates` corpus rows per query to re-rank into the k best.
struct RerankProblem {
  const float* queries = nullptr;
  const float* corpus = nullptr;
  std::size_t rows = 0, dim = 0;
  kernels::Metric metric = kernels::Metric::L2;
  std::size_t candidates = 0, k = 0;
};

// The selection's candidate lists (rows × candidates distances and int32 indices), handed to the
// re-rank, which keeps them until its work has run.
struct CandidateLists {
  ManagedBuffer distances, indices;
};

// knn's upper bounds (one per query) where the backend reads them: the caller's host values and,
// where the kernels read them on the device (the CUDA filter does), a copy there.
struct UpperBounds {
  std::span<const float> values;
  ManagedBuffer on_device;
  const float* device_values() const {
    return on_device.valid() ? static_cast<const float*>(on_device.raw_data()) : nullptr;
  }
};

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;

  // l2_distance: the whole Q × N matrix into out; temporaries come from out's pool.
  virtual Result<void> distances(const Device& device, const Stream& stream,
                                 const DistanceProblem& problem,
                                 const ManagedBuffer& out) const = 0;
  // knn without re-rank: the k nearest of every query into out (knn's order), the corpus in tiles
  // sized from the pool's headroom. path: the slowest path a block of queries took (raised, never
  // lowered). bounds: the upper bounds on the device, which a filter may use to keep fewer rows
  // (null: none; knn applies them to the result afterwards either way).
  virtual Result<void> select(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                              const DistanceProblem& problem, std::size_t k, TopkLists out,
                              KnnPath& path, const float* bounds) const = 0;
  // knn's re-rank: the exact fp32 distances of the selection's candidates, and their k best.
  virtual Result<void> rerank(const Device& device, const Stream& stream,
                              const RerankProblem& problem, CandidateLists lists,
                              TopkLists out) const = 0;
  // The upper bounds as apply_upper_bounds and select read them (a copy on the device where the
  // kernels need one, from the pool).
  virtual Result<UpperBounds> stage_upper_bounds(GpuMemoryPool& pool, const Device& device,
                                                 const Stream& stream,
                                                 std::span<const float> bounds) const = 0;
  // Entries of the queries × k lists beyond their query's bound become index -1, distance NaN.
  virtual Result<void> apply_upper_bounds(const Device& device, const Stream& stream,
                                          const UpperBounds& bounds, std::size_t k,
                                          TopkLists lists) const = 0;
  virtual Result<void> row_norms(const Device& device, const Stream& stream,
                                 const kernels::Matrix& vectors, std::size_t dim,
                                 float* out) const = 0;
  // fp32 → fp16 / bf16 / int8 (out_scales: int8's per-row scales), or back to fp32.
  virtual Result<void> convert(const Device& device, const Stream& stream,
                               const kernels::Matrix& in, std::size_t dim, kernels::Element to,
                               void* out, float* out_scales) const = 0;
  virtual Result<void> convert_stored(const Device& device, const Stream& stream, const void* in,
                                      std::size_t count, const StoredConvertOptions& options,
                                      kernels::Element to, void* out) const = 0;
  virtual Result<void> merge_topk(const Device& device, const Stream& stream,
                                  const float* distances, const std::int32_t* indices,
                                  const MergeTopkOptions& options, TopkLists out) const = 0;
  virtual Result<void> fold_topk(const Device& device, const Stream& stream,
                                 const float* distances, const std::int32_t* indices,
                                 const FoldTopkOptions& options, TopkLists running) const = 0;
};

const KernelBackend& cpu_kernel_backend();
const KernelBackend& cuda_kernel_backend();

inline const KernelBackend& kernel_backend(const Device& device) {
  return device.kind() == DeviceKind::Cuda ? cuda_kernel_backend() : cpu_kernel_backend();
}

// A pooled temporary of one knn call, on `stream`; an allocation error says which (`what`).
// Every kNN buffer is taken through it.
Result<ManagedBuffer> knn_temporary(GpuMemoryPool& pool, const Device& device,
                                    std::size_t elements, Precision precision,
                                    const Stream& stream, std::string_view what) {
  auto b = pool.get_managed_buffer(device, elements, precision, stream);
  if (!b) return std::unexpected(b.error().with_context(fmt::format("knn: allocating {}", what)));
  return std::move(*b);
}

// Bytes the pool may still take on `device` for temporaries (memory_headroom, the one definition
// batching and planning share); none when the device cannot say.
std::size_t pool_headroom(const GpuMemoryPool& pool, const Device& device) {
  auto headroom = memory_headroom(pool, device);
  return headroom ? headroom->bytes : 0;
}

}  // namespace gpupool
