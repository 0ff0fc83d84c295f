// PoolConfig from the environment, as CUDA.jl does it: GPUPOOL_MEMORY_LIMIT, GPUPOOL_CACHE_LIMIT,
// GPUPOOL_POOL.
module;
#include <cstdlib>
#include <expected>
#include <fmt/format.h>
#include <optional>
#include <string>
#include <string_view>
module gpupool;

namespace gpupool {

namespace {

std::optional<std::string_view> env(const char* name) {
  const char* value = std::getenv(name);
  if (!value || !*value) return std::nullopt;
  return std::string_view(value);
}

// Sizes may be percentages; they resolve against cuda:0's memory, or the simulated default.
Result<std::optional<std::size_t>> env_size(const char* name) {
  auto text = env(name);
  if (!text) return std::optional<std::size_t>{};
  auto size = parse_byte_size(*text);
  if (!size || (size->bytes && *size->bytes == 0) || (size->fraction && *size->fraction <= 0))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}='{}' is not a size: expected bytes such as 8GiB or 4000000000, "
                                  "or a share of device memory such as 80%", name, *text));
  if (size->bytes) return std::optional<std::size_t>(*size->bytes);
  auto device = Device::from_environment();
  if (!device) return std::unexpected(device.error().with_context(name));
  auto memory = device->memory_info();
  if (!memory) return std::unexpected(memory.error().with_context(name));
  return std::optional<std::size_t>(size->resolve(memory->total));
}

}  // namespace

Result<PoolConfig> PoolConfig::from_environment() {
  PoolConfig config;
  auto limit = env_size("GPUPOOL_MEMORY_LIMIT");
  if (!limit) return std::unexpected(limit.error());
  config.max_pool_size = *limit;
  auto cache = env_size("GPUPOOL_CACHE_LIMIT");
  if (!cache) return std::unexpected(cache.error());
  config.max_cached_bytes = *cache;
  if (auto mode = env("GPUPOOL_POOL")) {
    if (*mode == "none")
      config.caching = false;
    else if (*mode != "caching")
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("GPUPOOL_POOL='{}' is not a pool mode: expected caching or none",
                                    *mode));
  }
  return config;
}

}  // namespace gpupool
