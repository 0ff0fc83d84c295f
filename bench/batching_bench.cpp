// batching_bench: adaptive batching against the best fixed batch size of a sweep.
//
// The work: for a batch of b items, one pool buffer of b × item_bytes (device memory grows
// linearly with the batch) is filled on the device and synchronized. On a GPU the fill covers
// the whole buffer and the fixed cost per call is the real launch and synchronization. On the
// simulated device, where a fill is a host memset whose speed depends on the CPU caches (which
// would make the answer a cache size, not a memory limit), the first 4 KiB are filled and the
// costs are modelled: --call-overhead-us per call and --item-ns per item, spun on the host.
// Small batches pay the fixed cost often, batches past the memory limit fail: the best fixed
// size is near the largest that fits, which the sweep finds by trying sizes and which
// process_in_batches must find by itself.
//
// Printed: one row per fixed size (items/s or OOM) and the adaptive run (items/s, retries, the
// sizes it used), then adaptive ÷ best fixed (target ≥ 0.95). --json FILE writes the same.
// Runs on a simulated device, and on CUDA device 0 as well when the build has CUDA and one is
// present (Device::from_environment("auto")).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <ranges>
#include <string>
#include <vector>
import gpupool;

using namespace gpupool;
using Clock = std::chrono::steady_clock;

namespace {

struct Workload {
  std::size_t items = 0;
  std::size_t item_bytes = 0;
  std::chrono::microseconds call_overhead{0};
  std::chrono::nanoseconds item_cost{0};
  std::size_t pool_limit = 0;
  bool fill_whole = true;  // false: the first 4 KiB only (simulated device)
};

void spin_for(std::chrono::nanoseconds duration) {
  if (duration.count() == 0) return;
  auto until = Clock::now() + duration;
  while (Clock::now() < until) {
  }
}

// The batch function: memory linear in the batch, one fill, one synchronize.
struct FillWork {
  GpuMemoryPool& pool;
  Device device;
  const Workload& workload;

  template <class BatchT>
  Result<std::vector<std::uint8_t>> operator()(const BatchT& batch) const {
    return run(batch.size());
  }
  Result<std::vector<std::uint8_t>> run(std::size_t items) const {
    auto buffer = pool.allocate_bytes(device, items * workload.item_bytes, device.default_stream());
    if (!buffer) return std::unexpected(buffer.error());
    spin_for(workload.call_overhead + workload.item_cost * static_cast<std::int64_t>(items));
    std::size_t fill_bytes = workload.fill_whole ? buffer->size_bytes() : std::min<std::size_t>(4096, buffer->size_bytes());
    if (auto ok = device.fill(buffer->raw_data(), 0x5a, fill_bytes, buffer->stream()); !ok)
      return std::unexpected(ok.error());
    if (auto ok = buffer->stream().synchronize(); !ok) return std::unexpected(ok.error());
    return std::vector<std::uint8_t>(items, 1);
  }
};

struct RunResult {
  bool fits = true;
  double seconds = 0;
  double items_per_second = 0;
  BatchingReport report{};  // adaptive runs only
};

RunResult out_of_memory() {
  RunResult result;
  result.fits = false;
  return result;
}

RunResult timed(std::size_t items, Clock::time_point start, BatchingReport report = {}) {
  RunResult result;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.items_per_second = static_cast<double>(items) / result.seconds;
  result.report = report;
  return result;
}

// All items at one fixed size; fits = false at the first out-of-memory.
RunResult run_fixed(GpuMemoryPool& pool, const Device& device, const Workload& w, std::size_t size) {
  FillWork work{pool, device, w};
  auto start = Clock::now();
  for (std::size_t done = 0; done < w.items; done += size) {
    auto out = work.run(std::min(size, w.items - done));
    if (!out) return out_of_memory();
  }
  return timed(w.items, start);
}

RunResult run_adaptive(GpuMemoryPool& pool, const Device& device, const Workload& w) {
  FillWork work{pool, device, w};
  auto indices = std::views::iota(std::size_t{0}, w.items);
  auto start = Clock::now();
  auto out = process_in_batches(pool, device, work, indices);
  if (!out) {
    fmt::print(stderr, "adaptive run failed: {}\n", out.error().to_string());
    return out_of_memory();
  }
  return timed(w.items, start, out->report);
}

// Best of `repeats` (the least disturbed by other work on the machine), on a clean pool.
template <class Run>
RunResult best_of(int repeats, GpuMemoryPool& pool, const Device& device, Run run) {
  RunResult best = out_of_memory();
  for (int r = 0; r < repeats; ++r) {
    pool.emergency_cleanup(device);
    RunResult result = run();
    if (!result.fits) return result;
    if (!best.fits || result.seconds < best.seconds) best = result;
  }
  return best;
}

std::vector<std::size_t> sweep_sizes(std::size_t items) {
  std::vector<std::size_t> sizes;
  for (std::size_t p = 256; p <= items; p *= 2) {
    sizes.push_back(p);
    if (p + p / 2 <= items) sizes.push_back(p + p / 2);
  }
  return sizes;
}

nlohmann::json bench_device(const Device& device, const Workload& w, int repeats) {
  PoolConfig config;
  config.max_pool_size = w.pool_limit;
  GpuMemoryPool pool(config);
  fmt::print("\n{}: {} items of {} each, pool limit {}, modelled cost {} us per call + {} ns per item\n",
             device.describe(), w.items, format_bytes(w.item_bytes), format_bytes(w.pool_limit),
             w.call_overhead.count(), w.item_cost.count());
  fmt::print("{:>12} {:>14} {:>10}\n", "batch size", "items/s", "seconds");
  nlohmann::json fixed = nlohmann::json::array();
  RunResult best = out_of_memory();
  std::size_t best_size = 0;
  for (std::size_t size : sweep_sizes(w.items)) {
    RunResult r = best_of(repeats, pool, device, [&] { return run_fixed(pool, device, w, size); });
    if (!r.fits) {
      fmt::print("{:>12} {:>14} {:>10}\n", size, "OOM", "-");
      fixed.push_back({{"batch_size", size}, {"fits", false}});
      break;  // larger sizes do not fit either
    }
    fmt::print("{:>12} {:>14.0f} {:>10.4f}\n", size, r.items_per_second, r.seconds);
    fixed.push_back({{"batch_size", size}, {"fits", true}, {"items_per_second", r.items_per_second},
                     {"seconds", r.seconds}});
    if (!best.fits || r.items_per_second > best.items_per_second) {
      best = r;
      best_size = size;
    }
  }
  RunResult adaptive = best_of(repeats, pool, device, [&] { return run_adaptive(pool, device, w); });
  nlohmann::json result = {{"device", device.describe()}, {"items", w.items}, {"item_bytes", w.item_bytes},
                           {"pool_limit", w.pool_limit}, {"call_overhead_us", w.call_overhead.count()},
                           {"item_cost_ns", w.item_cost.count()}, {"fill_whole", w.fill_whole},
                           {"fixed", fixed}};
  if (!adaptive.fits || !best.fits) {
    result["error"] = "a run failed";
    return result;
  }
  const BatchingReport& rep = adaptive.report;
  double ratio = adaptive.items_per_second / best.items_per_second;
  fmt::print("{:>12} {:>14.0f} {:>10.4f}   first {} (probe {} B/item), final {}, largest {}, "
             "{} batches, {} retries\n",
             "adaptive", adaptive.items_per_second, adaptive.seconds, rep.first_batch_size,
             rep.bytes_per_item, rep.final_batch_size, rep.largest_batch, rep.batches, rep.retries);
  fmt::print("adaptive / best fixed ({}) = {:.3f}  (target >= 0.95)\n", best_size, ratio);
  result["best_fixed"] = {{"batch_size", best_size}, {"items_per_second", best.items_per_second}};
  result["adaptive"] = {{"items_per_second", adaptive.items_per_second}, {"seconds", adaptive.seconds},
                        {"first_batch_size", rep.first_batch_size}, {"bytes_per_item", rep.bytes_per_item},
                        {"final_batch_size", rep.final_batch_size}, {"largest_batch", rep.largest_batch},
                        {"batches", rep.batches}, {"retries", rep.retries}};
  result["ratio"] = ratio;
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpupool batching benchmark: adaptive batch size vs the best fixed size of a sweep"};
  std::string json_path;
  Workload sim_work{.items = std::size_t{1} << 19, .item_bytes = 1024,
                    .call_overhead = std::chrono::microseconds(200), .item_cost = std::chrono::nanoseconds(100),
                    .pool_limit = 32 * MiB, .fill_whole = false};
  // 2 TiB of fills, ~0.7 s on an H100: long enough that the adaptive run's one-time costs (the
  // probe, the batches at 0.8 of the fit, a cudaFree when it grows: ~10 ms, docs/batching.md)
  // weigh what they would in a real job rather than decide the ratio.
  Workload gpu_work{.items = std::size_t{1} << 25, .item_bytes = 64 * 1024,
                    .call_overhead = std::chrono::microseconds(0), .item_cost = std::chrono::nanoseconds(0),
                    .pool_limit = 4 * GiB, .fill_whole = true};
  int repeats = 3;
  std::size_t overhead_us = 200, item_ns = 100;
  app.add_option("--json", json_path, "also write the results as JSON to this file");
  app.add_option("--items", sim_work.items, "items on the simulated device");
  app.add_option("--item-bytes", sim_work.item_bytes, "device bytes per item on the simulated device");
  app.add_option("--gpu-items", gpu_work.items, "items on a CUDA device (64 KiB each, 4 GiB pool limit)");
  app.add_option("--call-overhead-us", overhead_us, "modelled cost per call on the simulated device");
  app.add_option("--item-ns", item_ns, "modelled cost per item on the simulated device");
  app.add_option("--repeats", repeats, "runs per configuration (the best counts)")->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);
  sim_work.call_overhead = std::chrono::microseconds(overhead_us);
  sim_work.item_cost = std::chrono::nanoseconds(item_ns);

  nlohmann::json runs = nlohmann::json::array();
  auto sim = Device::simulated({.capacity = 4 * sim_work.pool_limit});
  if (!sim) {
    fmt::print(stderr, "{}\n", sim.error().to_string());
    return 1;
  }
  runs.push_back(bench_device(*sim, sim_work, repeats));
  if (auto gpu = Device::from_environment("auto"); gpu && gpu->kind() == DeviceKind::Cuda)
    runs.push_back(bench_device(*gpu, gpu_work, repeats));
  else
    fmt::print("\nno CUDA device: the GPU rows are skipped\n");

  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << nlohmann::json{{"bench", "batching"}, {"runs", runs}}.dump(2) << "\n";
    if (!out) {
      fmt::print(stderr, "cannot write {}\n", json_path);
      return 1;
    }
  }
  for (const auto& run : runs)
    if (run.contains("error")) return 1;
  return 0;
}
