// `gpupool replay TRACE`: runs a recorded pool trace (CSV or JSON, from write_trace) against a
// pool configuration, on a simulated device as large as the trace's largest limit or on the
// device given, and prints peak reserved, fragmentation and time (docs/diagnostics.md).
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include "commands.hpp"
import gpupool;

namespace gpupool::cli {

namespace {

struct ReplayOptions {
  std::string trace;
  std::string device;        // empty: a simulated device sized from the trace
  std::string memory_limit;  // empty: none
  std::string cache_limit;
  bool no_cache = false;
  std::string segments = "device";  // virtual | device | none
  bool json = false;
};

// "8GiB" or "80%" of the device's memory; InvalidInput naming the option otherwise.
// `text` as bytes; a percentage of `whole` (the device's memory). 0 only where `zero_allowed`.
Result<std::size_t> byte_option(const std::string& option, const std::string& text, std::size_t whole,
                                bool zero_allowed) {
  auto size = parse_byte_size(text);
  const bool zero = size && ((size->bytes && *size->bytes == 0) ||
                             (size->fraction && *size->fraction <= 0));
  if (!size || (zero && !zero_allowed))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} {:?}: expected a size like 512MiB, 8GiB or 80%{}", option, text,
                                  zero_allowed ? "" : " (not 0: leave the option out for no limit)"));
  if (size->fraction && whole == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} {}: a percentage needs --device to say of what", option, text));
  return static_cast<std::size_t>(size->resolve(whole));
}

Result<ReplayResult> replay(const ReplayOptions& options) {
  std::optional<Device> device;
  if (!options.device.empty()) {
    auto chosen = Device::from_string(options.device);
    if (!chosen) return std::unexpected(chosen.error());
    device = *chosen;
  }
  PoolConfig config;
  config.caching = !options.no_cache;
  config.segments = options.segments != "none";
  config.virtual_segments = options.segments == "virtual";
  std::size_t whole = device ? device->properties().total_memory : 0;
  if (!options.memory_limit.empty()) {
    auto limit = byte_option("--memory-limit", options.memory_limit, whole, false);
    if (!limit) return std::unexpected(limit.error());
    config.max_pool_size = *limit;
  }
  if (!options.cache_limit.empty()) {
    auto cap = byte_option("--cache-limit", options.cache_limit, whole, true);
    if (!cap) return std::unexpected(cap.error());
    config.max_cached_bytes = *cap;
  }
  return replay_trace_file(options.trace, device, config, options.json ? nullptr : stdout);
}

int run_replay(const ReplayOptions& options) {
  auto result = replay(options);
  if (!result) {
    fmt::print(stderr, "gpupool replay: {}\n", result.error().to_string());
    return 1;
  }
  if (options.json) {
    nlohmann::json json = {{"events", result->events}, {"allocations", result->allocations},
                           {"frees", result->frees}, {"trims", result->trims},
                           {"recorded_ooms", result->recorded_ooms}, {"replay_ooms", result->replay_ooms},
                           {"recorded_peak_reserved", result->recorded_peak_reserved},
                           {"peak_reserved", result->peak_reserved},
                           {"peak_requested", result->peak_requested},
                           {"fragmentation", result->fragmentation}, {"seconds", result->seconds}};
    fmt::print("{}\n", json.dump(2));
  }
  return 0;
}

}  // namespace

Runner add_replay_command(CLI::App& app) {
  auto options = std::make_shared<ReplayOptions>();
  CLI::App* command = app.add_subcommand("replay", "replay a recorded pool trace under a configuration");
  command->footer(
      "Record a trace with enable_tracing(pool, {.history_capacity = N}) and write_trace(history(pool), "
      "path, TraceFormat::Csv); then compare configurations on it, e.g.\n"
      "  gpupool replay run.csv\n  gpupool replay run.csv --memory-limit 2GiB --cache-limit 256MiB");
  command->add_option("trace", options->trace, "the trace file (.csv or .json)")->required();
  command->add_option("--device", options->device,
                      "cuda:N, sim or sim:SIZE (default: a simulated device of the trace's size)");
  command->add_option("--memory-limit", options->memory_limit, "hard limit of the pool (bytes or %)");
  command->add_option("--cache-limit", options->cache_limit, "soft cap on cached bytes (bytes or %)");
  command->add_flag("--no-cache", options->no_cache, "pass-through mode: every free goes to the device");
  command->add_option("--segments", options->segments,
                      "blocks above 4 KiB from virtual segments, above 64 KiB from device segments, or none "
                      "(PoolConfig::virtual_segments, ::segments)")
      ->check(CLI::IsMember({"virtual", "device", "none"}));
  command->add_flag("--json", options->json, "print the result as JSON on stdout");
  return [options, command](bool) -> int { return command->parsed() ? run_replay(*options) : -1; };
}

}  // namespace gpupool::cli
