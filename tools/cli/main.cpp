// gpupool — command line tool. Each subcommand lives in its own file (see commands.hpp).
#include <CLI/CLI.hpp>
#include <vector>
#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"gpupool: a GPU memory pool for vector search, and exact kNN over large data"};
  app.require_subcommand(0, 1);
  std::vector<gpupool::cli::Runner> runners{gpupool::cli::add_info_command(app)};
  CLI11_PARSE(app, argc, argv);
  for (auto& run : runners)
    if (int code = run(false); code >= 0) return code;
  // No subcommand: the default job.
  return runners.front()(true);
}
