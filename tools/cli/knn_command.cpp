// `gpupool knn`: exact k nearest neighbours of a query file among a base file streamed through the
// device, and the default job on Fashion-MNIST when the dataset is installed.
#include <algorithm>
#include <cstdio>
#include <expected>
#include <filesystem>
#include <fmt/format.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include "commands.hpp"
#include "validators.hpp"
#include "progress.hpp"
#include "exact_knn.hpp"

namespace gpupool::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct KnnOptions {
  std::string base, query;
  std::size_t k = 100;
  std::string metric = "l2";
  bool fast = false;
  std::string precision = "fp32";
  bool tf32 = false;
  std::size_t verify = 0;
  std::string out = "out/knn";
  std::string out_format = "ivecs";
  std::string distance_type = "fp32";
  std::string device_spec;
  std::string memory_limit;
  std::size_t max_chunk_rows = std::size_t{1} << 20;
  bool json = false;
  bool quiet = false;
  bool allow_non_finite = false;
};

Result<Metric> parse_metric(const std::string& text) {
  if (text == "l2") return Metric::L2;
  if (text == "ip") return Metric::InnerProduct;
  if (text == "cos") return Metric::Cosine;
  return make_error(ErrorKind::InvalidInput,
                    fmt::format("--metric {}; expected l2, ip or cos", text));
}

Result<Device> open_device(const std::string& spec) {
  return spec.empty() ? Device::from_environment() : Device::from_string(spec);
}

// GPUPOOL_* from the environment, with --memory-limit (bytes or a share of the device) on top.
Result<GpuMemoryPool> make_pool(const Device& device, const std::string& memory_limit) {
  auto config = PoolConfig::from_environment(device);
  if (!config) return std::unexpected(config.error());
  if (!memory_limit.empty()) {
    auto size = parse_byte_size(memory_limit);
    if (!size || size->resolve(device.properties().total_memory) == 0)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("--memory-limit {}; expected a positive size like 512MiB or a "
                                    "share of device memory like 80%", memory_limit));
    config->max_pool_size = size->resolve(device.properties().total_memory);
  }
  return GpuMemoryPool(*config);
}

Result<exact::JobOptions> job_options(const KnnOptions& options) {
  auto metric = parse_metric(options.metric);
  if (!metric) return std::unexpected(metric.error());
  auto precision = parse_precision(options.precision);
  if (!precision || *precision == Precision::Bytes)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("--precision {}; expected fp32, fp16, bf16 or int8",
                                  options.precision));
  if (!options.fast && (*precision != Precision::Fp32 || options.tf32))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("--precision {}{} chooses the arithmetic of --fast; the exact "
                                  "mode (the default) chooses its own (integer data on exact "
                                  "integer arithmetic, other data in fp32 re-ranked in fp64): "
                                  "add --fast, or leave them out",
                                  options.precision, options.tf32 ? " --tf32" : ""));
  if (options.fast && options.verify > 0)
    return make_error(ErrorKind::InvalidInput,
                      "--verify checks the exact mode's results against fp64; --fast's differ "
                      "from them by design: leave out one of the two");
  if (options.allow_non_finite && !options.fast)
    return make_error(ErrorKind::InvalidInput,
                      "--allow-non-finite applies to --fast only: the exact mode refuses NaN and "
                      "infinite values (fp64 has no exact answer for them)");
  return exact::JobOptions{.k = options.k, .metric = *metric, .fast = options.fast,
                           .precision = *precision,
                           .mode = options.tf32 ? ComputeMode::Tf32 : ComputeMode::Fp32Accurate,
                           .allow_non_finite = options.allow_non_finite,
                           .max_chunk_rows = options.max_chunk_rows, .on_progress = {}};
}

Result<exact::DistanceType> distance_type(const std::string& text, bool fast,
                                          exact::OutputFormat format) {
  exact::DistanceType type;
  if (text == "fp32") type = exact::DistanceType::Fp32;
  else if (text == "fp64") type = exact::DistanceType::Fp64;
  else if (text == "int64") type = exact::DistanceType::Int64;
  else
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("--distance-type {}; expected fp32, fp64 or int64", text));
  if (type != exact::DistanceType::Fp32 && (fast || format != exact::OutputFormat::Npy))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("--distance-type {} needs --out-format npy and the exact mode "
                                  "(no --fast)", text));
  return type;
}

Result<exact::OutputFormat> output_format(const std::string& text) {
  if (text == "ivecs") return exact::OutputFormat::Texmex;
  if (text == "npy") return exact::OutputFormat::Npy;
  return make_error(ErrorKind::InvalidInput,
                    fmt::format("--out-format {}; expected ivecs (with .fvecs distances) or npy", text));
}

Result<void> make_parent_directory(const fs::path& prefix) {
  std::error_code error;
  fs::path parent = fs::absolute(prefix, error).parent_path();
  if (!error) fs::create_directories(parent, error);
  if (error)
    return make_error(ErrorKind::Io, fmt::format("cannot create the output directory {}: {}",
                                                 parent.string(), error.message()));
  return {};
}

// Before any work: the prefix names files (not a folder), neither output is one of the inputs,
// and both can be written (the folder is created first).
Result<exact::OutputFiles> prepare_outputs(const KnnOptions& options, exact::OutputFormat format) {
  if (options.out.empty() || options.out.back() == '/' || fs::path(options.out).filename() == "." ||
      fs::path(options.out).filename() == "..")
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("--out '{}'; expected a prefix for the output files, like "
                                  "out/run (it names files, not a folder)", options.out));
  if (auto ok = make_parent_directory(options.out); !ok) return std::unexpected(ok.error());
  const exact::OutputFiles files = exact::output_files(options.out, format);
  for (const fs::path& output : {files.neighbours, files.distances})
    for (const std::string& input : {options.base, options.query}) {
      std::error_code error;
      if (fs::equivalent(output, input, error))
        return make_error(ErrorKind::InvalidInput,
                          fmt::format("--out {} would write {}, which is the input {}; choose "
                                      "another --out", options.out, output.string(), input));
    }
  for (const fs::path& output : {files.neighbours, files.distances})
    if (auto ok = io::check_writable(output); !ok) return std::unexpected(ok.error());
  return files;
}

nlohmann::json pool_json(const PoolStats& s) {
  return {{"peak_reserved_bytes", s.peak_reserved_bytes}, {"peak_in_use_bytes", s.peak_in_use_bytes},
          {"peak_cached_bytes", s.peak_cached_bytes},     {"reserved_bytes", s.reserved_bytes},
          {"cached_bytes", s.cached_bytes},               {"allocations", s.allocations},
          {"cache_hits", s.cache_hits},                   {"cache_misses", s.cache_misses},
          {"hit_rate", s.hit_rate()},                     {"device_allocations", s.device_allocations},
          {"out_of_memory_errors", s.out_of_memory_errors}, {"trims", s.trims}};
}

// The job's seconds outside its stages on the job's own thread (reading runs beside them).
double other_seconds(const exact::JobSummary& s) {
  const exact::JobTimes& t = s.times;
  return std::max(0.0, s.seconds - t.staged());
}

void print_json(const exact::JobSummary& s, const exact::OutputFiles& files) {
  nlohmann::json json = {
      {"device", s.device}, {"queries", s.queries}, {"base_rows", s.base_rows}, {"dim", s.dim},
      {"k", s.k}, {"metric", to_string(s.metric)}, {"mode", s.fast ? "fast" : "exact"},
      {"precision", s.fast ? to_string(s.precision) : "exact"},
      {"chunks", s.chunks}, {"retries", s.retries}, {"largest_chunk_rows", s.largest_chunk_rows},
      {"query_blocks", s.query_blocks}, {"largest_query_block", s.largest_query_block},
      {"query_block_retries", s.query_block_retries},
      {"seconds", s.seconds}, {"distances_per_second", s.distances_per_second()},
      {"times", {{"reading", s.times.reading},
                 {"preparing_queries", s.times.preparing_queries},
                 {"starting_device", s.times.starting_device},
                 {"waiting_for_base", s.times.waiting_for_base},
                 {"uploading", s.times.uploading},
                 {"searching", s.times.searching},
                 {"merging", s.times.merging},
                 {"other", other_seconds(s)}}},
      {"bytes", {{"read", s.counts.bytes_read}, {"uploaded", s.counts.bytes_uploaded},
                 {"distances", static_cast<double>(s.queries) * static_cast<double>(s.base_rows)}}},
      {"exact", {{"integer_chunks", s.counts.integer_chunks},
                 {"float_chunks", s.counts.float_chunks},
                 {"candidates", s.counts.fold.candidates},
                 {"recomputed_fp64", s.counts.fold.recomputed},
                 {"widened_queries", s.counts.widened_queries},
                 {"exhaustive_queries", s.counts.exhaustive_queries}}},
      {"non_finite_distances", s.counts.non_finite_distances},
      {"pool", pool_json(s.pool)},
      {"neighbors_file", files.neighbours.string()}, {"distances_file", files.distances.string()}};
  fmt::print("{}\n", json.dump(2));
}

void print_summary(const exact::JobSummary& s, const exact::OutputFiles& files) {
  const PoolStats& p = s.pool;
  fmt::print("done in {:.2f} s: {:.3g} distances/s, {:.3g} base rows/s\n", s.seconds,
             s.distances_per_second(), s.seconds > 0 ? static_cast<double>(s.base_rows) / s.seconds : 0.0);
  fmt::print("time: {:.2f} s preparing the queries, {:.2f} s starting the device, {:.2f} s "
             "waiting for the base file, {:.2f} s uploading, {:.2f} s searching, {:.2f} s "
             "merging, {:.2f} s other; reading {:.2f} s beside them\n",
             s.times.preparing_queries, s.times.starting_device, s.times.waiting_for_base,
             s.times.uploading, s.times.searching, s.times.merging, other_seconds(s),
             s.times.reading);
  fmt::print("bytes: {} read, {} uploaded\n", format_bytes(s.counts.bytes_read),
             format_bytes(s.counts.bytes_uploaded));
  if (s.fast)
    fmt::print("mode: fast ({}): the device's distances{}\n", to_string(s.precision),
               s.counts.non_finite_distances
                   ? fmt::format("; {} of them NaN or infinite", s.counts.non_finite_distances)
                   : std::string());
  else
    fmt::print("mode: exact: {} chunks on exact integer arithmetic, {} in fp32 with the error "
               "bound; {} candidates, {} fp64 distances, {} queries widened, {} computed "
               "row by row\n",
               s.counts.integer_chunks, s.counts.float_chunks, s.counts.fold.candidates,
               s.counts.fold.recomputed, s.counts.widened_queries, s.counts.exhaustive_queries);
  fmt::print("chunks: {} (largest {} rows) in {} query block{} (largest {} queries)\n", s.chunks,
             s.largest_chunk_rows, s.query_blocks, s.query_blocks == 1 ? "" : "s",
             s.largest_query_block);
  fmt::print("retries after out-of-memory: {} ({} of them query blocks)\n", s.retries,
             s.query_block_retries);
  fmt::print("memory report:\n");
  fmt::print("  peak reserved   {}\n", format_bytes(p.peak_reserved_bytes));
  fmt::print("  peak in use     {}\n", format_bytes(p.peak_in_use_bytes));
  fmt::print("  cached now      {}\n", format_bytes(p.cached_bytes));
  fmt::print("  allocations     {} ({:.1f}% from the cache), {} from the device\n", p.allocations,
             p.hit_rate() * 100, p.device_allocations);
  fmt::print("  out-of-memory   {} errors, {} blocks trimmed\n", p.out_of_memory_errors, p.trims);
  fmt::print("wrote {}\n      {}\n", files.neighbours.string(), files.distances.string());
}

Result<exact::OutputFiles> run_job(const KnnOptions& options) {
  auto job = job_options(options);
  if (!job) return std::unexpected(job.error());
  auto format = output_format(options.out_format);
  if (!format) return std::unexpected(format.error());
  auto distances = distance_type(options.distance_type, options.fast, *format);
  if (!distances) return std::unexpected(distances.error());
  if (auto outputs = prepare_outputs(options, *format); !outputs)
    return std::unexpected(outputs.error());
  // The files first: a gzip file starts inflating when it opens, beside the device's start.
  auto query_reader = io::VectorReader::open(options.query);
  if (!query_reader) return std::unexpected(query_reader.error());
  auto base = io::VectorReader::open(options.base);
  if (!base) return std::unexpected(base.error());
  auto device = open_device(options.device_spec);
  if (!device) return std::unexpected(device.error());
  auto pool = make_pool(*device, options.memory_limit);
  if (!pool) return std::unexpected(pool.error());
  auto queries = exact::read_all(*query_reader);
  if (!queries) return std::unexpected(queries.error());
  if (!options.json)
    fmt::print("gpupool knn: {} queries × {} base rows, dim {}, k = {}, {}, {}\ndevice: {}\n",
               queries->rows, base->rows(), base->dim(), options.k, options.metric,
               options.fast ? "fast " + options.precision : std::string("exact"),
               device->describe());
  std::fflush(stdout);
  ProgressReporter progress(!options.quiet);
  job->on_progress = [&progress](const exact::Progress& p) { progress(p); };
  auto result = exact::run_exact_knn(*pool, *device, *queries, *base, *job);
  progress.finish();
  if (!result) return std::unexpected(result.error());
  auto files = exact::write_neighbours(result->neighbours, options.out, *format, *distances);
  if (!files) return std::unexpected(files.error());
  if (options.json) print_json(result->summary, *files);
  else print_summary(result->summary, *files);
  if (options.verify > 0) {
    auto verified = exact::verify_neighbours(result->neighbours, *queries, options.base, job->metric,
                                             options.verify);
    if (!verified) return std::unexpected(verified.error());
    if (!options.json)
      fmt::print("verified: {} queries equal an fp64 recomputation over the whole base ({:.2f} s)\n",
                 verified->queries, verified->seconds);
  }
  return files;
}

int run_knn(const KnnOptions& options) {
  auto done = run_job(options);
  if (done) return 0;
  fmt::print(stderr, "gpupool knn: {}\n", done.error().to_string());
  return 1;
}

// The default job's inputs, when the dataset-fashion-mnist package is installed.
std::optional<KnnOptions> fashion_mnist_job() {
  fs::path dir = kFashionMnistDir;
  fs::path train = dir / "train-images-idx3-ubyte.gz", test = dir / "t10k-images-idx3-ubyte.gz";
  std::error_code error;
  if (!fs::is_regular_file(train, error) || !fs::is_regular_file(test, error)) return std::nullopt;
  KnnOptions options;
  options.base = train.string();
  options.query = test.string();
  options.out = "out/fashion-mnist.l2.k100";
  return options;
}

}  // namespace

Runner add_knn_command(CLI::App& app) {
  auto options = std::make_shared<KnnOptions>();
  CLI::App* command = app.add_subcommand(
      "knn", "Exact k nearest neighbours (ground truth) of a query file among a base file larger "
             "than device memory if need be");
  command->footer(
      "Files: .fvecs .bvecs .ivecs (TEXMEX/SIFT), IDX (*-idx3-ubyte, .idx, optionally .gz), .npy "
      "(float32, float16, uint8, int8). Writes PREFIX.neighbors.ivecs (0-based base rows, nearest "
      "first) and PREFIX.distances.fvecs (l2: squared distance, ip: -dot, cos: 1 - cosine), or "
      ".npy with --out-format npy.\nExample: gpupool knn --base sift_base.fvecs --query "
      "sift_query.fvecs --k 100 --out out/sift");
  command->add_option("--base", options->base, "the vectors to search (streamed from disk)")->required();
  command->add_option("--query", options->query, "the query vectors (held in host memory; on the device in blocks if need be)")->required();
  command->add_option("--k", options->k, "neighbours per query, 1..1024")
      ->check(whole_number(1, kMaxK))
      ->capture_default_str();
  command->add_option("--metric", options->metric, "l2 (squared), ip (inner product) or cos")
      ->capture_default_str();
  command->add_flag("--fast", options->fast,
                    "the device's distances as they are (in --precision) instead of the exact "
                    "mode's fp64-exact ids and distances");
  command->add_option("--precision", options->precision,
                      "with --fast: computed in fp32, fp16, bf16 or int8")
      ->capture_default_str();
  command->add_flag("--tf32", options->tf32, "with --fast: allow TF32 tensor cores for fp32 on a GPU");
  command->add_flag("--allow-non-finite", options->allow_non_finite,
                    "with --fast: rank NaN and infinite values (docs/kernels.md) instead of "
                    "refusing them");
  command->add_option("--verify", options->verify,
                      "recompute this many random queries over the whole base in fp64 on the "
                      "host afterwards; exit 1 if any id or distance differs")
      ->check(whole_number(0, std::uint64_t{1} << 31))
      ->capture_default_str();
  command->add_option("--out", options->out, "output prefix (directories are created)")
      ->capture_default_str();
  command->add_option("--out-format", options->out_format, "ivecs (+ .fvecs) or npy")
      ->capture_default_str();
  command->add_option("--distance-type", options->distance_type,
                      "fp32; with --out-format npy also fp64 (the exact values) or int64 "
                      "(integer data, l2 or ip)")
      ->capture_default_str();
  command->add_option("--device", options->device_spec,
                      "cuda:N, sim or sim:SIZE (default: GPUPOOL_DEVICE, else auto)");
  command->add_option("--memory-limit", options->memory_limit,
                      "the pool's hard limit, e.g. 2GiB or 80% (default: GPUPOOL_MEMORY_LIMIT)");
  command->add_option("--max-chunk-rows", options->max_chunk_rows,
                      "at most this many base rows per chunk")
      ->check(whole_number(1, std::uint64_t{1} << 40))
      ->capture_default_str();
  command->add_flag("--json", options->json, "print the summary as JSON on stdout");
  command->add_flag("--quiet", options->quiet, "no progress on stderr");
  return [options, command](bool run_as_default) -> int {
    if (command->parsed()) return run_knn(*options);
    if (!run_as_default) return -1;
    auto fashion = fashion_mnist_job();
    if (!fashion) return -1;
    fmt::print("default job: exact 100-NN of the Fashion-MNIST test images among the training "
               "images ({})\n", kFashionMnistDir);
    return run_knn(*fashion);
  };
}

}  // namespace gpupool::cli
