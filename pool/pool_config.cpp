// PoolConfig from the environment, as CUDA.jl does it: GPUPOOL_MEMORY_LIMIT, GPUPOOL_CACHE_LIMIT,
// GPUPOOL_POOL, GPUPOOL_SEGMENTS, GPUPOOL_PAGE_SLACK.
module;
#include <charconv>
#include <cmath>
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

// Sizes may be percentages of `device`'s memory.
Result<std::optional<std::size_t>> env_size(const char* name, const Device& device,
                                            bool zero_allowed) {
  auto text = env(name);
  if (!text) return std::optional<std::size_t>{};
  auto size = parse_byte_size(*text);
  const bool zero = size && ((size->bytes && *size->bytes == 0) ||
                             (size->fraction && *size->fraction <= 0));
  if (!size || (zero && !zero_allowed))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}='{}' is not a size: expected bytes such as 8GiB or 4000000000, "
                                  "or a share of device memory such as 80%{}", name, *text,
                                  zero_allowed ? "" : " (not 0)"));
  if (size->bytes) return std::optional<std::size_t>(*size->bytes);
  auto memory = device.memory_info();
  if (!memory) return std::unexpected(memory.error().with_context(name));
  return std::optional<std::size_t>(size->resolve(memory->total));
}

}  // namespace

Result<PoolConfig> PoolConfig::from_environment() {
  auto device = Device::from_environment();
  if (!device) return std::unexpected(device.error().with_context("GPUPOOL_DEVICE"));
  return from_environment(*device);
}

Result<PoolConfig> PoolConfig::from_environment(const Device& device) {
  PoolConfig config;
  auto limit = env_size("GPUPOOL_MEMORY_LIMIT", device, false);
  if (!limit) return std::unexpected(limit.error());
  config.max_pool_size = *limit;
  auto cache = env_size("GPUPOOL_CACHE_LIMIT", device, true);
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
  if (auto segments = env("GPUPOOL_SEGMENTS")) {
    if (*segments == "none")
      config.segments = false;
    else if (*segments == "virtual")
      config.virtual_segments = true;
    else if (*segments != "device")
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("GPUPOOL_SEGMENTS='{}' is not a kind of segment: expected "
                                    "virtual, device or none", *segments));
  }
  if (auto slack = env("GPUPOOL_PAGE_SLACK")) {
    double value = 0;
    const auto [end, error] = std::from_chars(slack->data(), slack->data() + slack->size(), value);
    if (error != std::errc{} || end != slack->data() + slack->size() || !std::isfinite(value) ||
        value < 0)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("GPUPOOL_PAGE_SLACK='{}' is not a page budget: expected a "
                                    "share of the most bytes in use such as 0.01 (virtual "
                                    "segments; docs/pool.md)", *slack));
    config.virtual_page_slack = value;
  }
  return config;
}

}  // namespace gpupool
