// The CUDA backend of a build without the CUDA toolkit: there are no CUDA devices, and asking for
// one says how to get them.
module;
#include <fmt/format.h>
#include <memory>
module gpupool;

namespace gpupool {

Result<std::shared_ptr<DeviceBackend>> make_cuda_backend(int ordinal) {
  return make_error(ErrorKind::DeviceUnavailable,
                    fmt::format("cuda:{} is unavailable: this gpupool was built without the CUDA "
                                "backend (configure with the 'cuda' preset, or use a simulated "
                                "device such as GPUPOOL_DEVICE=sim:2GiB)", ordinal));
}

int cuda_backend_device_count() noexcept { return 0; }

}  // namespace gpupool
