// `gpupool bench`: the pool benchmark (bench/pool_benchmark.cpp) on the device of GPUPOOL_DEVICE:
// alloc+free pairs, a random trace, threads, fragmentation, and cudaMallocAsync beside it on a GPU.
#include <memory>
#include <string>
#include <vector>
#include "commands.hpp"
#include "pool_benchmark.hpp"

namespace gpupool::cli {

namespace {

struct BenchOptions {
  bool quick = false;
  std::string json;
  std::string threads;
  std::string only;
  std::string limit;
  std::vector<std::string> traces;
  std::string devices;
  std::string heap_pad;
};

int run_bench(const BenchOptions& options) {
  std::vector<std::string> args{"gpupool bench"};
  if (options.quick) args.push_back("--quick");
  if (!options.json.empty()) args.insert(args.end(), {"--json", options.json});
  if (!options.threads.empty()) args.insert(args.end(), {"--threads", options.threads});
  if (!options.only.empty()) args.insert(args.end(), {"--only", options.only});
  if (!options.limit.empty()) args.insert(args.end(), {"--limit", options.limit});
  for (const std::string& trace : options.traces) args.insert(args.end(), {"--trace", trace});
  if (!options.devices.empty()) args.insert(args.end(), {"--devices", options.devices});
  if (!options.heap_pad.empty()) args.insert(args.end(), {"--heap-pad", options.heap_pad});
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  return bench::run_pool_bench(static_cast<int>(argv.size()), argv.data());
}

}  // namespace

Runner add_bench_command(CLI::App& app) {
  auto options = std::make_shared<BenchOptions>();
  CLI::App* command = app.add_subcommand("bench", "the pool benchmarks (docs/benchmarks.md)");
  command->footer("The device comes from GPUPOOL_DEVICE (cuda:0, sim:64GiB, ...; default: the GPU "
                  "if there is one). Example: GPUPOOL_DEVICE=sim:64GiB gpupool bench --quick");
  command->add_flag("--quick", options->quick, "fewer rounds and shorter traces (seconds, not a minute)");
  command->add_option("--json", options->json, "also write one JSON object per result line to FILE");
  command->add_option("--threads", options->threads,
                      "thread counts, e.g. 1,2,4,8,16 (each 1 to 1024)");
  command->add_option("--only", options->only, "one benchmark: pair, trace, threads or fragmentation")
      ->check(CLI::IsMember({"pair", "trace", "threads", "fragmentation"}));
  command->add_option("--limit", options->limit,
                      "the hard limit of the limited fragmentation rows, as a multiple of the "
                      "trace's peak (1 to 4, default 1.02)");
  command->add_option("--trace", options->traces,
                      "also this recorded pool trace in the fragmentation rows (gpupool replay's "
                      "CSV or JSON; repeatable)");
  command->add_option("--devices", options->devices,
                      "N or all: the threads rows put thread t on device t % N (every GPU, or N "
                      "simulated devices), and each device's pool figures follow");
  command->add_option("--heap-pad", options->heap_pad,
                      "hold this many bytes (0 to 1 MiB) on the heap first, moving the pools and "
                      "the benchmark's buffers against the stack, to tell layout effects apart");
  return [options, command](bool) -> int { return command->parsed() ? run_bench(*options) : -1; };
}

}  // namespace gpupool::cli
