// The gpupool command's subcommands: each registers its options on the CLI11 app and runs when
// chosen. Exit codes: 0 success, 1 a GpuError (printed), 2 bad usage (CLI11).
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace gpupool::cli {

// Returns the exit code when its subcommand was chosen (or it runs as the default job), else -1.
using Runner = std::function<int(bool run_as_default)>;

// `gpupool info`: devices, memory, an allocate/copy round trip, and the pool configuration.
Runner add_info_command(CLI::App& app);
// `gpupool knn`: exact kNN over streamed vector files; the default job on Fashion-MNIST.
Runner add_knn_command(CLI::App& app);
// `gpupool recall`: recall@k against ground truth, tolerant of ties.
Runner add_recall_command(CLI::App& app);
// `gpupool bench`: the pool benchmarks (bench/pool_benchmark.cpp); only in builds with benchmarks.
Runner add_bench_command(CLI::App& app);
// `gpupool replay TRACE`: a recorded pool trace against a pool configuration.
Runner add_replay_command(CLI::App& app);

}  // namespace gpupool::cli
