// diagnostics_bench: what the diagnostics cost, and what a replay shows.
//
//   hooks    alloc + free of 4 KiB on a pool hit, ns per pair: tracing off (the hooks' one branch),
//            leak tracing, history, both, and leak tracing with stack traces
//   replay   the peers' random trace (≤ 1000 live buffers, sizes uniform 1 B .. 4 MiB, alloc/free
//            coin flip; peers.md) recorded once through a pool with history, then replayed under
//            several pool configurations: peak reserved, peak requested, fragmentation (peak
//            reserved / peak requested), out-of-memory errors, ns per event
//
// Device: GPUPOOL_DEVICE (default: cuda:0 when there is a GPU, else sim:8GiB).
// Options: --json FILE (one JSON object per line), --only hooks|replay, --ops N (trace length, default 20000),
//          --limit BYTES (hard limit while recording, default none), --trace FILE (the recorded
//          trace as CSV), --svg FILE (its timeline), --report FILE (memory_report after recording)
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {

struct Options {
  std::string json_path, trace_path, svg_path, report_path;
  std::size_t ops = 20000;
  std::optional<std::size_t> limit;
  bool hooks = true, replay = true;
};

class Output {
 public:
  explicit Output(const std::string& path) {
    if (!path.empty()) json_.open(path);
  }
  void add(nlohmann::json row) {
    if (json_) json_ << row.dump() << '\n';
  }

 private:
  std::ofstream json_;
};

// splitmix64, as bench/pool_bench.cpp uses: small and reproducible.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

double pair_ns(GpuMemoryPool& pool, const Device& device, std::size_t pairs) {
  const auto began = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < pairs; ++i) {
    auto buffer = pool.get_managed_buffer(device, 4096, Precision::Bytes);
    if (!buffer) std::abort();
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - began).count() /
         static_cast<double>(pairs);
}

TracingConfig tracing(bool track, bool stacks, std::size_t history) {
  TracingConfig config;
  config.track_allocations = track;
  config.capture_stack_traces = stacks;
  config.history_capacity = history;
  return config;
}

PoolConfig limited(std::optional<std::size_t> limit) {
  PoolConfig config;
  config.max_pool_size = limit;
  return config;
}

void bench_hooks(const Device& device, Output& out) {
  struct Mode { const char* name; std::optional<TracingConfig> config; std::size_t pairs; };
  const Mode modes[] = {
      {"off", std::nullopt, 400000},
      {"leak tracing", tracing(true, false, 0), 400000},
      {"history", tracing(false, false, 1 << 16), 400000},
      {"both", tracing(true, false, 1 << 16), 400000},
      {"stack traces", tracing(true, true, 0), 4000}};
  fmt::print("hooks: alloc + free of 4 KiB on a pool hit ({})\n{:<14} {:>12}\n", device.describe(),
             "tracing", "ns/pair");
  for (const Mode& mode : modes) {
    GpuMemoryPool pool;
    if (mode.config && !enable_tracing(pool, *mode.config)) std::abort();
    pair_ns(pool, device, 1000);  // warm: the block is cached
    double best = 1e300;
    for (int round = 0; round < 5; ++round) best = std::min(best, pair_ns(pool, device, mode.pairs));
    fmt::print("{:<14} {:>12.1f}\n", mode.name, best);
    out.add({{"bench", "hooks"}, {"tracing", mode.name}, {"device", device.describe()}, {"ns_per_pair", best}});
  }
}

// Records the random trace through a pool with history; returns it.
Trace record_trace(const Device& device, const Options& options, std::size_t& ooms) {
  GpuMemoryPool pool(limited(options.limit));
  if (!enable_tracing(pool, tracing(false, false, options.ops * 2 + 16))) std::abort();
  SplitMix64 random{42};
  std::vector<ManagedBuffer> live;
  for (std::size_t op = 0; op < options.ops; ++op) {
    if (live.empty() || (live.size() < 1000 && random.next() % 2 == 0)) {
      auto buffer = pool.get_managed_buffer(device, 1 + random.next() % (4 * MiB), Precision::Bytes);
      if (buffer) live.push_back(std::move(*buffer));
      else ++ooms;
    } else {
      std::size_t index = random.next() % live.size();
      std::swap(live[index], live.back());
      live.pop_back();
    }
  }
  if (!options.report_path.empty()) {
    auto report = memory_report(pool, device);
    if (report) std::ofstream(options.report_path) << to_text(*report);
  }
  live.clear();
  return history(pool);
}

void bench_replay(const Device& device, const Options& options, Output& out) {
  std::size_t ooms = 0;
  Trace trace = record_trace(device, options, ooms);
  fmt::print("\nreplay: the random trace, {} operations, {} events, recorded peak reserved {}, {} OOM\n",
             options.ops, trace.events.size(), format_bytes(trace.peak_reserved_bytes()), ooms);
  if (!options.trace_path.empty() && !write_trace(trace, options.trace_path, TraceFormat::Csv)) std::abort();
  TimelineOptions timeline;
  timeline.title = "random trace (peers.md)";
  timeline.by_event = true;  // on a busy machine, time between events is mostly scheduling noise
  if (!options.svg_path.empty() && !write_timeline_svg(trace, options.svg_path, timeline)) std::abort();
  struct Config { const char* name; PoolConfig config; };
  Config configs[] = {{"as recorded", limited(options.limit)},
                      {"cache <= 256 MiB", limited(options.limit)},
                      {"cache <= 0", limited(options.limit)},
                      {"no caching", limited(options.limit)}};
  configs[1].config.max_cached_bytes = 256 * MiB;
  configs[2].config.max_cached_bytes = 0;
  configs[3].config.caching = false;
  fmt::print("{:<18} {:>14} {:>14} {:>14} {:>8} {:>6} {:>10}\n", "configuration", "peak reserved",
             "within events", "peak requested", "frag", "OOM", "ns/event");
  for (const Config& c : configs) {
    auto result = replay_trace(trace, device, c.config);
    if (!result) {
      fmt::print("{}: {}\n", c.name, result.error().to_string());
      continue;
    }
    fmt::print("{:<18} {:>14} {:>14} {:>14} {:>8.4f} {:>6} {:>10.1f}\n", c.name, result->peak_reserved,
               result->peak_reserved_within_events, result->peak_requested, result->fragmentation,
               result->replay_ooms, result->ns_per_event);
    out.add({{"bench", "replay"}, {"config", c.name}, {"device", result->device},
             {"events", result->events}, {"recorded_peak_reserved", result->recorded_peak_reserved},
             {"peak_reserved", result->peak_reserved},
             {"peak_reserved_within_events", result->peak_reserved_within_events},
             {"peak_requested", result->peak_requested},
             {"fragmentation", result->fragmentation}, {"replay_ooms", result->replay_ooms},
             {"ns_per_event", result->ns_per_event}});
  }
}

int run(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (arg == "--json") options.json_path = value();
    else if (arg == "--trace") options.trace_path = value();
    else if (arg == "--svg") options.svg_path = value();
    else if (arg == "--report") options.report_path = value();
    else if (arg == "--only") {
      std::string which = value();
      options.hooks = which == "hooks";
      options.replay = which == "replay";
      if (!options.hooks && !options.replay) {
        std::fprintf(stderr, "--only: expected hooks or replay, got \"%s\"\n", which.c_str());
        return 2;
      }
    } else if (arg == "--ops") options.ops = std::strtoull(value().c_str(), nullptr, 10);
    else if (arg == "--limit") {
      auto size = parse_byte_size(value());
      if (!size || !size->bytes) {
        std::fprintf(stderr, "--limit: expected a byte size like 512MiB\n");
        return 2;
      }
      options.limit = *size->bytes;
    } else {
      std::fprintf(stderr, "usage: diagnostics_bench [--json FILE] [--only hooks|replay] [--ops N] "
                           "[--limit BYTES] "
                           "[--trace FILE] [--svg FILE] [--report FILE]\n");
      return 2;
    }
  }
  if (options.ops == 0) {
    std::fprintf(stderr, "--ops: expected at least 1\n");
    return 2;
  }
  auto device = Device::from_environment(Device::cuda_device_count() > 0 ? "cuda:0" : "sim:8GiB");
  if (!device) {
    std::fprintf(stderr, "%s\n", device.error().to_string().c_str());
    return 1;
  }
  Output out(options.json_path);
  if (options.hooks) bench_hooks(*device, out);
  if (options.replay) bench_replay(*device, options, out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
