// gpupool — command line tool. Each subcommand lives in its own file (see commands.hpp).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <vector>
#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"gpupool: a GPU memory pool for vector search, and exact kNN over large data"};
  app.require_subcommand(0, 1);
  app.footer("With no subcommand: knn on Fashion-MNIST (k = 100, L2) when /usr/share/datasets/"
             "fashion-mnist exists (Debian package dataset-fashion-mnist), else info.\n"
             "Run `gpupool SUBCOMMAND --help` for a subcommand's options.");
  // In default-job order: the first runner that takes the default job runs it.
  std::vector<gpupool::cli::Runner> runners{gpupool::cli::add_knn_command(app),
                                            gpupool::cli::add_recall_command(app),
                                            gpupool::cli::add_replay_command(app),
                                            gpupool::cli::add_info_command(app)};
#if GPUPOOL_WITH_BENCH
  runners.push_back(gpupool::cli::add_bench_command(app));
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version exit 0; every usage error 2, as commands.hpp promises (CLI11's own
    // codes, like 106 for a missing option, would read as failures of the job).
    return app.exit(error) == 0 ? 0 : 2;
  }
  try {
    for (auto& run : runners)
      if (int code = run(false); code >= 0) return code;
    // No subcommand: the default job (knn on Fashion-MNIST if installed, else info).
    for (auto& run : runners)
      if (int code = run(true); code >= 0) return code;
  } catch (const std::exception& error) {  // host memory exhausted and the like: say so, exit 1
    std::fprintf(stderr, "gpupool: %s\n", error.what());
    return 1;
  }
  return 0;
}
