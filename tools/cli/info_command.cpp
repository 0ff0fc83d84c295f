#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <numeric>
#include <optional>
#include <string>
#include <vector>
#include "commands.hpp"
import gpupool;

namespace gpupool::cli {

namespace {

struct InfoOptions {
  std::string device_spec;
};

// Uploads and downloads a buffer to prove the device works end to end.
Result<void> round_trip(const Device& device) {
  std::vector<float> host(1 << 16), back(host.size(), -1.0f);
  std::iota(host.begin(), host.end(), 0.25f);
  std::size_t bytes = host.size() * sizeof(float);
  auto memory = device.allocate(bytes);
  if (!memory) return std::unexpected(memory.error());
  Stream stream = device.default_stream();
  auto result = device.copy(*memory, host.data(), bytes, CopyKind::HostToDevice, stream);
  if (result) result = device.copy(back.data(), *memory, bytes, CopyKind::DeviceToHost, stream);
  if (result) result = stream.synchronize();
  auto freed = device.deallocate(*memory);
  if (!result) return result;
  if (!freed) return freed;
  if (back != host) return make_error(ErrorKind::Internal, "round trip returned different bytes");
  return {};
}

// The pool configuration the environment gives (GPUPOOL_MEMORY_LIMIT, GPUPOOL_CACHE_LIMIT,
// GPUPOOL_POOL) on `device`: what every pool of the gpupool command runs with there.
bool print_pool_config(const Device& device) {
  auto config = PoolConfig::from_environment(device);
  if (!config) {
    fmt::print(stderr, "gpupool: {}\n", config.error().to_string());
    return false;
  }
  auto size_or = [](const std::optional<std::size_t>& bytes, const char* otherwise) {
    return bytes ? format_bytes(*bytes) : std::string(otherwise);
  };
  fmt::print("pool: {}, hard limit {}, cache limit {}, critical pressure {:.2f}\n",
             config->caching ? "caching" : "pass-through (GPUPOOL_POOL=none)",
             size_or(config->max_pool_size, "the device's memory"),
             size_or(config->max_cached_bytes, "none"), config->critical_pressure);
  return true;
}

int run_info(const InfoOptions& options) {
  fmt::print("CUDA devices: {}\n", Device::cuda_device_count());
  auto device = options.device_spec.empty() ? Device::from_environment()
                                            : Device::from_string(options.device_spec);
  if (!device) {
    fmt::print(stderr, "gpupool: {}\n", device.error().to_string());
    return 1;
  }
  fmt::print("device: {}\n", device->describe());
  if (auto memory = device->memory_info())
    fmt::print("memory: {} free of {}\n", format_bytes(memory->free), format_bytes(memory->total));
  if (auto ok = round_trip(*device); !ok) {
    fmt::print(stderr, "gpupool: round trip failed: {}\n", ok.error().to_string());
    return 1;
  }
  fmt::print("round trip: 256 KiB uploaded and downloaded intact\n");
  return print_pool_config(*device) ? 0 : 1;
}

}  // namespace

Runner add_info_command(CLI::App& app) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* command = app.add_subcommand(
      "info", "Show devices, memory and the pool configuration from the environment, and check a "
              "round trip");
  command->add_option("--device", options->device_spec,
                      "cuda:N, sim or sim:SIZE (default: GPUPOOL_DEVICE, else auto)");
  return [options, command](bool run_as_default) -> int {
    return command->parsed() || run_as_default ? run_info(*options) : -1;
  };
}

}  // namespace gpupool::cli
