// The CUDA backends of a build without the CUDA toolkit: there are no CUDA devices, and asking for
// one, or for a kernel on one, says how to get them.
module;
#include "kernel_vocabulary.hpp"

#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <span>
#include <string_view>
module gpupool;
import :kernel_backend;

namespace gpupool {

Result<std::shared_ptr<DeviceBackend>> make_cuda_backend(int ordinal) {
  return make_error(ErrorKind::DeviceUnavailable,
                    fmt::format("cuda:{} is unavailable: this gpupool was built without the CUDA "
                                "backend (configure with the 'cuda' preset, or use a simulated "
                                "device such as GPUPOOL_DEVICE=sim:2GiB)", ordinal));
}

int cuda_backend_device_count() noexcept { return 0; }

namespace {

std::unexpected<GpuError> no_cuda(const Device& device, std::string_view op) {
  return make_error(ErrorKind::DeviceUnavailable,
                    fmt::format("{}: {} is a CUDA device but this gpupool was built without the "
                                "CUDA backend (configure with the 'cuda' preset)",
                                op, device.describe()), device.id());
}

// Every kernel refuses, naming the public call it serves.
class AbsentCudaKernelBackend final : public KernelBackend {
 public:
  Result<void> distances(const Device& device, const Stream&, const DistanceProblem&,
                         const ManagedBuffer&) const override {
    return no_cuda(device, "l2_distance");
  }
  Result<void> select(GpuMemoryPool&, const Device& device, const Stream&,
                      const DistanceProblem&, std::size_t, TopkLists, KnnPath&,
                      const float*) const override {
    return no_cuda(device, "knn");
  }
  Result<void> rerank(const Device& device, const Stream&, const RerankProblem&, CandidateLists,
                      TopkLists) const override {
    return no_cuda(device, "knn");
  }
  Result<UpperBounds> stage_upper_bounds(GpuMemoryPool&, const Device& device, const Stream&,
                                         std::span<const float>) const override {
    return no_cuda(device, "knn");
  }
  Result<void> apply_upper_bounds(const Device& device, const Stream&, const UpperBounds&,
                                  std::size_t, TopkLists) const override {
    return no_cuda(device, "knn");
  }
  Result<void> row_norms(const Device& device, const Stream&, const kernels::Matrix&,
                         std::size_t, float*) const override {
    return no_cuda(device, "row_norms");
  }
  Result<void> convert(const Device& device, const Stream&, const kernels::Matrix&, std::size_t,
                       kernels::Element, void*, float*) const override {
    return no_cuda(device, "convert");
  }
  Result<void> convert_stored(const Device& device, const Stream&, const void*, std::size_t,
                              const StoredConvertOptions&, kernels::Element,
                              void*) const override {
    return no_cuda(device, "convert_stored");
  }
  Result<void> merge_topk(const Device& device, const Stream&, const float*, const std::int32_t*,
                          const MergeTopkOptions&, TopkLists) const override {
    return no_cuda(device, "merge_topk");
  }
  Result<void> fold_topk(const Device& device, const Stream&, const float*, const std::int32_t*,
                         const FoldTopkOptions&, TopkLists) const override {
    return no_cuda(device, "fold_topk");
  }
};

}  // namespace

const KernelBackend& cuda_kernel_backend() {
  static const AbsentCudaKernelBackend backend;
  return backend;
}

}  // namespace gpupool
