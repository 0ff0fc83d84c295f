// `gpupool recall`: recall@k of a kNN result against ground truth, tolerant of ties when distance
// files are given (the rule is in tools/knn/recall.hpp and docs/cli.md).
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include "commands.hpp"
#include "validators.hpp"
#include "recall.hpp"

namespace gpupool::cli {

namespace {

struct RecallOptions {
  std::string truth, result, truth_distances, result_distances;
  std::size_t k = 10;
  double tolerance = 1e-5;
  std::optional<double> min_recall;
  bool json = false;
};

std::optional<std::filesystem::path> optional_path(const std::string& text) {
  if (text.empty()) return std::nullopt;
  return std::filesystem::path(text);
}

int run_recall(const RecallOptions& options) {
  exact::RecallFiles files{options.truth, options.result, optional_path(options.truth_distances),
                           optional_path(options.result_distances)};
  auto report = exact::recall_from_files(files, options.k, options.tolerance);
  if (!report) {
    fmt::print(stderr, "gpupool recall: {}\n", report.error().to_string());
    return 1;
  }
  if (options.json) {
    nlohmann::json json = {{"k", report->k}, {"queries", report->queries}, {"recall", report->recall},
                           {"hits", report->hits}, {"tie_hits", report->tie_hits},
                           {"worst_query_recall", report->worst_query_recall},
                           {"tie_tolerant", report->tie_tolerant}};
    fmt::print("{}\n", json.dump(2));
  } else {
    fmt::print("recall@{} = {:.6f} over {} queries ({} of {} neighbours found, {} of them as ties; "
               "worst query {:.4f}){}\n",
               report->k, report->recall, report->queries, report->hits, report->queries * report->k,
               report->tie_hits, report->worst_query_recall,
               report->tie_tolerant ? "" : "; no distances given, ties not recognised");
  }
  if (options.min_recall && report->recall < *options.min_recall) {
    fmt::print(stderr, "gpupool recall: recall@{} = {:.6f} is below --min-recall {}\n", report->k,
               report->recall, *options.min_recall);
    return 1;
  }
  return 0;
}

}  // namespace

Runner add_recall_command(CLI::App& app) {
  auto options = std::make_shared<RecallOptions>();
  CLI::App* command = app.add_subcommand("recall", "recall@k of a kNN result against ground truth");
  command->footer(
      "A result neighbour counts if it is among the first k true neighbours, or, when both "
      "distance files are given, if its distance is at most the k-th true distance + tolerance × "
      "max(1, |k-th true distance|), so that equally distant neighbours (ties) count.\nExample: "
      "gpupool recall --truth gt.ivecs --truth-distances gt.fvecs --result out/run.neighbors.ivecs "
      "--result-distances out/run.distances.fvecs --k 10");
  command->add_option("--truth", options->truth, "true neighbour ids (.ivecs or int .npy)")->required();
  command->add_option("--result", options->result, "neighbour ids to check")->required();
  command->add_option("--k", options->k, "the k of recall@k")
      ->check(whole_number(1, std::uint64_t{1} << 31))
      ->capture_default_str();
  command->add_option("--truth-distances", options->truth_distances, "true distances (.fvecs/.npy)");
  command->add_option("--result-distances", options->result_distances, "the result's distances");
  command->add_option("--tolerance", options->tolerance, "relative tolerance for ties")
      ->check(finite_number(0, 1))
      ->capture_default_str();
  command->add_option("--min-recall", options->min_recall, "exit with status 1 below this recall")
      ->check(finite_number(0, 1));
  command->add_flag("--json", options->json, "print the report as JSON on stdout");
  return [options, command](bool) -> int { return command->parsed() ? run_recall(*options) : -1; };
}

}  // namespace gpupool::cli
