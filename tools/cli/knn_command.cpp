// `gpupool knn`: exact k nearest neighbours of a query file among a base file streamed through the
// device, and the default job on Fashion-MNIST when the dataset is installed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <span>
#include <vector>
#include <expected>
#include <filesystem>
#include <fmt/format.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include "commands.hpp"
#include "validators.hpp"
#include "process_group.hpp"
#include "progress.hpp"
#include "knn_parts.hpp"
#include "exact_knn.hpp"
#include "sharded_knn.hpp"
#include "parallel.hpp"

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
  std::string devices;  // --devices LIST|all: the job split over these (empty: one device)
  bool mpi = false;     // --mpi: one process of an MPI job even without a launcher's environment
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
                           .max_chunk_rows = options.max_chunk_rows, .on_progress = {},
                           .base_rows = {}, .block_rows = 0, .stop = nullptr};
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

// The job's seconds outside its stages on the job's own thread (reading runs beside them).
double other_seconds(const exact::JobSummary& s) {
  const exact::JobTimes& t = s.times;
  return std::max(0.0, s.seconds - t.staged());
}

// Several devices: `devices` holds each one's part, and the summary's times are summed over them.
struct DeviceParts {
  std::span<const DeviceReport> reports;
  bool with_ranks = false;       // the parts ran in several MPI processes
  double merging_seconds = 0;    // the devices' (and processes') lists merged into one
};

void print_json(const exact::JobSummary& s, const exact::OutputFiles& files,
                const DeviceParts& parts = {}) {
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
                 {"uploaded_ahead", s.counts.bytes_uploaded_ahead},
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
  if (!parts.reports.empty()) {
    nlohmann::json devices = nlohmann::json::array();
    for (const DeviceReport& report : parts.reports) devices.push_back(device_report_json(report));
    json["devices"] = std::move(devices);
    json["merging_lists_seconds"] = parts.merging_seconds;
  }
  fmt::print("{}\n", json.dump(2));
}

void print_summary(const exact::JobSummary& s, const exact::OutputFiles& files,
                   const DeviceParts& parts = {}) {
  const PoolStats& p = s.pool;
  fmt::print("done in {:.2f} s: {:.3g} distances/s, {:.3g} base rows/s\n", s.seconds,
             s.distances_per_second(), s.seconds > 0 ? static_cast<double>(s.base_rows) / s.seconds : 0.0);
  fmt::print("time: {:.2f} s preparing the queries, {:.2f} s starting the device, {:.2f} s "
             "waiting for the base file, {:.2f} s uploading, {:.2f} s searching, {:.2f} s "
             "merging, {:.2f} s other; reading {:.2f} s beside them\n",
             s.times.preparing_queries, s.times.starting_device, s.times.waiting_for_base,
             s.times.uploading, s.times.searching, s.times.merging, other_seconds(s),
             s.times.reading);
  fmt::print("bytes: {} read, {} uploaded ({} of them during the search of the chunk before)\n",
             format_bytes(s.counts.bytes_read), format_bytes(s.counts.bytes_uploaded),
             format_bytes(s.counts.bytes_uploaded_ahead));
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
  if (!parts.reports.empty()) {
    fmt::print("devices: {} (times above are summed over them; the lists merged in {:.3f} s)\n",
               parts.reports.size(), parts.merging_seconds);
    print_device_reports(parts.reports, parts.with_ranks);
  }
  fmt::print("memory report{}:\n",
             parts.reports.empty() ? "" : " (the devices' figures added together)");
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


// The device specs of a job over several devices, or of one MPI process: --devices' list; "all"
// for every CUDA GPU of the host (shared out among the MPI processes on it), or the default
// device where there is none; without --devices, --device (or GPUPOOL_DEVICE; an MPI process on
// a host with GPUs takes the GPU of its local rank). An empty spec is GPUPOOL_DEVICE's device.
Result<std::vector<std::string>> device_specs(const KnnOptions& options, std::size_t local_rank,
                                              std::size_t local_size, bool in_mpi_job) {
  if (!options.devices.empty() && !options.device_spec.empty())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("--device {} and --devices {}: give one of them (--devices "
                                  "cuda:0 is the one device cuda:0)",
                                  options.device_spec, options.devices));
  const int gpus = Device::cuda_device_count();
  if (options.devices.empty()) {
    if (in_mpi_job && options.device_spec.empty() && gpus > 0)
      return std::vector<std::string>{fmt::format("cuda:{}", local_rank % static_cast<std::size_t>(gpus))};
    return std::vector<std::string>{options.device_spec};
  }
  if (options.devices == "all") {
    if (gpus == 0) return std::vector<std::string>{std::string()};
    std::vector<std::string> specs;
    for (int g = 0; g < gpus; ++g)
      if (static_cast<std::size_t>(g) % std::max<std::size_t>(local_size, 1) == local_rank)
        specs.push_back(fmt::format("cuda:{}", g));
    if (specs.empty()) specs.push_back(fmt::format("cuda:{}", local_rank % static_cast<std::size_t>(gpus)));
    return specs;
  }
  std::vector<std::string> specs;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t comma = options.devices.find(',', begin);
    std::string item = options.devices.substr(begin, comma == std::string::npos ? std::string::npos
                                                                                 : comma - begin);
    if (item.empty())
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("--devices '{}': item {} is empty; expected a comma-separated "
                                    "list of cuda:N, sim or sim:SIZE (e.g. cuda:0,cuda:1), or all",
                                    options.devices, specs.size() + 1));
    specs.push_back(std::move(item));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return specs;
}

// A device and its own pool per spec.
Result<std::vector<exact::DeviceSlot>> open_slots(const std::vector<std::string>& specs,
                                                  const KnnOptions& options) {
  std::vector<exact::DeviceSlot> slots;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    auto device = open_device(specs[i]);
    if (!device)
      return std::unexpected(options.devices.empty()
                                 ? device.error()
                                 : device.error().with_context(fmt::format(
                                       "--devices item {} '{}' (expected cuda:N, sim or sim:SIZE)",
                                       i + 1, specs[i])));
    auto pool = make_pool(*device, options.memory_limit);
    if (!pool) return std::unexpected(pool.error());
    slots.push_back(exact::DeviceSlot{std::move(*pool), std::move(*device)});
  }
  return slots;
}

// What the job writes, checked before any work.
struct OutputPlan {
  exact::OutputFormat format = exact::OutputFormat::Texmex;
  exact::DistanceType distances = exact::DistanceType::Fp32;
};

Result<OutputPlan> plan_outputs(const KnnOptions& options, bool create_files) {
  auto format = output_format(options.out_format);
  if (!format) return std::unexpected(format.error());
  auto distances = distance_type(options.distance_type, options.fast, *format);
  if (!distances) return std::unexpected(distances.error());
  if (create_files)
    if (auto outputs = prepare_outputs(options, *format); !outputs)
      return std::unexpected(outputs.error());
  return OutputPlan{*format, *distances};
}

Result<exact::VectorSet> read_queries(const KnnOptions& options) {
  auto reader = io::VectorReader::open(options.query);
  if (!reader) return std::unexpected(reader.error());
  return exact::read_all(*reader);
}

// Progress of several devices' jobs, one labelled log line per device every tenth of its share
// (a redrawn bar cannot show several devices).
class DevicesProgress {
 public:
  DevicesProgress(bool enabled, std::size_t devices, const std::string& rank_label) {
    for (std::size_t i = 0; i < devices; ++i)
      reporters_.emplace_back(enabled, fmt::format("{}device {}", rank_label, i));
  }
  void operator()(std::size_t device, const exact::Progress& p) {
    std::lock_guard lock(mutex_);
    reporters_[device](p);
  }

 private:
  std::mutex mutex_;
  std::vector<ProgressReporter> reporters_;
};

void print_header(const KnnOptions& options, std::size_t queries, const exact::VectorSet& q,
                  std::size_t base_rows, std::size_t processes,
                  const std::vector<exact::DeviceSlot>& slots) {
  fmt::print("gpupool knn: {} queries × {} base rows, dim {}, k = {}, {}, {}\n", queries, base_rows,
             q.dim, options.k, options.metric,
             options.fast ? "fast " + options.precision : std::string("exact"));
  if (processes > 1)
    fmt::print("processes: {} (MPI); rank 0's devices:", processes);
  else
    fmt::print("devices:");
  for (const exact::DeviceSlot& slot : slots) fmt::print(" [{}]", slot.device.describe());
  fmt::print("\n");
  std::fflush(stdout);
}

// The merged lists written, the summary printed, --verify run.
Result<exact::OutputFiles> finish_job(const KnnOptions& options, const exact::JobOptions& job,
                                      const OutputPlan& plan, const exact::Neighbours& merged,
                                      const exact::VectorSet& queries,
                                      std::span<const DeviceReport> reports, double seconds,
                                      const DeviceParts& parts) {
  auto files = exact::write_neighbours(merged, options.out, plan.format, plan.distances);
  if (!files) return std::unexpected(files.error());
  exact::JobSummary total = total_summary(reports, merged, seconds);
  total.dim = queries.dim;
  total.metric = job.metric;
  total.precision = job.precision;
  total.fast = job.fast;
  if (options.json) print_json(total, *files, parts);
  else print_summary(total, *files, parts);
  if (options.verify > 0) {
    auto verified = exact::verify_neighbours(merged, queries, options.base, job.metric, options.verify);
    if (!verified) return std::unexpected(verified.error());
    if (!options.json)
      fmt::print("verified: {} queries equal an fp64 recomputation over the whole base ({:.2f} s)\n",
                 verified->queries, verified->seconds);
  }
  return files;
}

std::vector<DeviceReport> reports_of(const exact::ShardedResult& result, std::size_t rank) {
  std::vector<DeviceReport> reports;
  for (const exact::DevicePart& part : result.parts) reports.push_back(DeviceReport{rank, part});
  return reports;
}

// `gpupool knn --devices LIST`: the job split over several devices of this process.
Result<exact::OutputFiles> run_devices_job(const KnnOptions& options) {
  auto job = job_options(options);
  if (!job) return std::unexpected(job.error());
  auto plan = plan_outputs(options, true);
  if (!plan) return std::unexpected(plan.error());
  auto specs = device_specs(options, 0, 1, false);
  if (!specs) return std::unexpected(specs.error());
  auto base = io::VectorReader::open(options.base);
  if (!base) return std::unexpected(base.error());
  auto slots = open_slots(*specs, options);
  if (!slots) return std::unexpected(slots.error());
  auto queries = read_queries(options);
  if (!queries) return std::unexpected(queries.error());
  if (!options.json) print_header(options, queries->rows, *queries, base->rows(), 1, *slots);
  DevicesProgress progress(!options.quiet, slots->size(), "");
  auto result = exact::run_sharded_knn(*slots, *queries, options.base, *job, std::nullopt,
                                       [&progress](std::size_t d, const exact::Progress& p) { progress(d, p); });
  if (!result) return std::unexpected(result.error());
  const std::vector<DeviceReport> reports = reports_of(*result, 0);
  return finish_job(options, *job, *plan, result->neighbours, *queries, reports, result->seconds,
                    DeviceParts{reports, false, result->merging_seconds});
}

// A process's lists between processes: queries, k, integer_distances, fast (u64 each), then ids
// (int32), fp32 distances and the ranking values (fp64), queries × k of each.
std::vector<std::byte> lists_to_bytes(const exact::Neighbours& lists, bool fast) {
  const std::vector<double>& values = fast ? lists.ranked_distances : lists.distances_fp64;
  const std::uint64_t header[4] = {lists.queries, lists.k, lists.integer_distances ? 1u : 0u,
                                   fast ? 1u : 0u};
  std::vector<std::byte> bytes(sizeof header + lists.indices.size() * sizeof(std::int32_t) +
                               lists.distances.size() * sizeof(float) + values.size() * sizeof(double));
  std::byte* at = bytes.data();
  auto put = [&at](const void* data, std::size_t size) {
    if (size != 0) std::memcpy(at, data, size);
    at += size;
  };
  put(header, sizeof header);
  put(lists.indices.data(), lists.indices.size() * sizeof(std::int32_t));
  put(lists.distances.data(), lists.distances.size() * sizeof(float));
  put(values.data(), values.size() * sizeof(double));
  return bytes;
}

Result<exact::Neighbours> lists_from_bytes(std::span<const std::byte> bytes, std::size_t rank) {
  std::uint64_t header[4] = {};
  auto bad = [&] {
    return make_error(ErrorKind::Internal,
                      fmt::format("rank {}'s lists arrived as {} bytes, not what lists_to_bytes "
                                  "writes", rank, bytes.size()));
  };
  if (bytes.size() < sizeof header) return bad();
  std::memcpy(header, bytes.data(), sizeof header);
  const std::uint64_t entries = header[0] * header[1];
  if (header[1] == 0 || entries / header[1] != header[0] ||
      bytes.size() != sizeof header + entries * (sizeof(std::int32_t) + sizeof(float) + sizeof(double)))
    return bad();
  exact::Neighbours lists{.queries = header[0], .k = header[1], .distances = {},
                          .distances_fp64 = {}, .indices = {}, .integer_distances = header[2] != 0,
                          .beyond_fp32 = {}, .beyond_fp32_distance = 0, .ranked_distances = {}};
  const std::byte* at = bytes.data() + sizeof header;
  lists.indices.resize(entries);
  lists.distances.resize(entries);
  std::vector<double>& values = header[3] != 0 ? lists.ranked_distances : lists.distances_fp64;
  values.resize(entries);
  std::memcpy(lists.indices.data(), at, entries * sizeof(std::int32_t));
  at += entries * sizeof(std::int32_t);
  std::memcpy(lists.distances.data(), at, entries * sizeof(float));
  at += entries * sizeof(float);
  std::memcpy(values.data(), at, entries * sizeof(double));
  return lists;
}

// A process with no rows (more processes than the base has shares): lists that merge as nothing.
exact::Neighbours empty_lists(std::size_t queries, std::size_t k, bool fast) {
  const std::size_t entries = queries * k;
  const double inf = std::numeric_limits<double>::infinity();
  exact::Neighbours lists{.queries = queries, .k = k, .distances = {}, .distances_fp64 = {},
                          .indices = {}, .integer_distances = !fast, .beyond_fp32 = {},
                          .beyond_fp32_distance = 0, .ranked_distances = {}};
  lists.indices.assign(entries, -1);
  lists.distances.assign(entries, std::numeric_limits<float>::infinity());
  (fast ? lists.ranked_distances : lists.distances_fp64).assign(entries, inf);
  return lists;
}

// What one process sends rank 0: its devices' reports (JSON) and its merged lists.
struct ProcessPart {
  std::vector<DeviceReport> reports;
  exact::Neighbours lists;
};

std::vector<std::byte> part_to_bytes(const ProcessPart& part, bool fast) {
  nlohmann::json reports = nlohmann::json::array();
  for (const DeviceReport& r : part.reports) reports.push_back(device_report_json(r));
  const std::string text = reports.dump();
  const std::uint64_t length = text.size();
  std::vector<std::byte> bytes(sizeof length + text.size());
  std::memcpy(bytes.data(), &length, sizeof length);
  std::memcpy(bytes.data() + sizeof length, text.data(), text.size());
  std::vector<std::byte> lists = lists_to_bytes(part.lists, fast);
  bytes.insert(bytes.end(), lists.begin(), lists.end());
  return bytes;
}

Result<ProcessPart> part_from_bytes(std::span<const std::byte> bytes, std::size_t rank) {
  std::uint64_t length = 0;
  if (bytes.size() < sizeof length)
    return make_error(ErrorKind::Internal, fmt::format("rank {} sent {} bytes", rank, bytes.size()));
  std::memcpy(&length, bytes.data(), sizeof length);
  if (length > bytes.size() - sizeof length)
    return make_error(ErrorKind::Internal, fmt::format("rank {}'s report is cut short", rank));
  const std::string text(reinterpret_cast<const char*>(bytes.data() + sizeof length), length);
  ProcessPart part;
  const nlohmann::json reports = nlohmann::json::parse(text, nullptr, false);
  if (reports.is_discarded() || !reports.is_array())
    return make_error(ErrorKind::Internal, fmt::format("rank {}'s report is not JSON", rank));
  for (const nlohmann::json& r : reports) {
    auto report = device_report_from_json(r);
    if (!report) return std::unexpected(report.error());
    part.reports.push_back(std::move(*report));
  }
  auto lists = lists_from_bytes(bytes.subspan(sizeof length + length), rank);
  if (!lists) return std::unexpected(lists.error());
  part.lists = std::move(*lists);
  return part;
}

// This process's share of an MPI job: its rows of the base over its devices.
Result<ProcessPart> run_process_share(const KnnOptions& options, const exact::JobOptions& job,
                                      const exact::VectorSet& queries, ProcessGroup& group) {
  auto base = io::VectorReader::open(options.base);
  if (!base) return std::unexpected(base.error());
  if (!base->seekable() && group.size() > 1)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{} is gzip-compressed: it can only be read from its start, so "
                                  "it is not split over {} MPI processes (each would inflate "
                                  "everything before its share); decompress it first (gunzip -k), "
                                  "or run one process with --devices",
                                  options.base, group.size()));
  const exact::RowShare share = exact::split_rows(
      {0, base->rows()}, group.size(), exact::share_alignment(base->rows(), job), job.k)[group.rank()];
  auto specs = device_specs(options, group.local_rank(), group.local_size(), true);
  if (!specs) return std::unexpected(specs.error());
  auto slots = open_slots(*specs, options);
  if (!slots) return std::unexpected(slots.error());
  if (group.rank() == 0 && !options.json)
    print_header(options, queries.rows, queries, base->rows(), group.size(), *slots);
  if (share.rows == 0) {
    ProcessPart part{{}, empty_lists(queries.rows, job.k, job.fast)};
    for (const exact::DeviceSlot& slot : *slots)
      part.reports.push_back(DeviceReport{group.rank(), {slot.device.describe(), {share.first_row, 0}, {}}});
    return part;
  }
  DevicesProgress progress(!options.quiet, slots->size(), fmt::format("rank {} ", group.rank()));
  auto result = exact::run_sharded_knn(*slots, queries, options.base, job, share,
                                       [&progress](std::size_t d, const exact::Progress& p) { progress(d, p); });
  if (!result) return std::unexpected(result.error());
  return ProcessPart{reports_of(*result, group.rank()), std::move(result->neighbours)};
}

// A process of an MPI job that may run on under a quarter of its share of the host's cores reads
// and folds on those alone (mpirun binds each process of a job of two or fewer to one core): it
// says so, with the flag that frees them.
void warn_if_bound(const ProcessGroup& group) {
  const std::size_t usable = exact::usable_cores();
  const std::size_t host = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t share = host / std::max<std::size_t>(group.local_size(), 1);
  if (usable * 4 >= share) return;
  fmt::print(stderr,
             "gpupool knn: rank {} may run on {} of this host's {} cores (the launcher bound it); "
             "its reading and host work share them: start it with `mpirun --bind-to none`\n",
             group.rank(), usable, host);
}

// `mpirun -np N gpupool knn ...`: every process computes its share; rank 0 merges and writes.
// An error on any process ends every process (MPI_Abort) after printing it: the others would
// otherwise wait for it in the gather.
int run_knn_over_mpi(const KnnOptions& options) {
  auto joined = ProcessGroup::join();
  if (!joined) {
    fmt::print(stderr, "gpupool knn: {}\n", joined.error().to_string());
    return 1;
  }
  ProcessGroup& group = **joined;
  const auto start = std::chrono::steady_clock::now();
  if (group.size() > 1) warn_if_bound(group);
  auto fail = [&](const GpuError& error) -> int {
    fmt::print(stderr, "gpupool knn: rank {} of {}: {}\n", group.rank(), group.size(),
               error.to_string());
    std::fflush(stderr);
    if (group.size() > 1) group.abort_all(1);
    return 1;
  };
  auto job = job_options(options);
  if (!job) return fail(job.error());
  auto plan = plan_outputs(options, group.rank() == 0);
  if (!plan) return fail(plan.error());
  auto queries = read_queries(options);
  if (!queries) return fail(queries.error());
  auto part = run_process_share(options, *job, *queries, group);
  if (!part) return fail(part.error());
  auto gathered = group.gather_to_root(part_to_bytes(*part, job->fast));
  if (!gathered) return fail(gathered.error());
  int status = 0;
  if (group.rank() == 0) {
    const auto merging = std::chrono::steady_clock::now();
    std::vector<ProcessPart> parts;
    std::vector<DeviceReport> reports;
    Result<void> done = {};
    for (std::size_t rank = 0; rank < gathered->size() && done; ++rank) {
      auto received = part_from_bytes((*gathered)[rank], rank);
      if (!received) done = std::unexpected(received.error());
      else parts.push_back(std::move(*received));
    }
    if (done) {
      std::vector<exact::ShareLists> lists;
      for (ProcessPart& p : parts) {
        lists.push_back(exact::ShareLists{&p.lists, 0});  // ids are rows of the file already
        reports.insert(reports.end(), p.reports.begin(), p.reports.end());
      }
      auto merged = exact::merge_neighbours(lists, job->fast);
      if (!merged) {
        done = std::unexpected(merged.error());
      } else {
        const double merging_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - merging).count();
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        auto files = finish_job(options, *job, *plan, *merged, *queries, reports, seconds,
                                DeviceParts{reports, true, merging_seconds});
        if (!files) done = std::unexpected(files.error());
      }
    }
    if (!done) {
      fmt::print(stderr, "gpupool knn: rank 0 of {}: {}\n", group.size(), done.error().to_string());
      status = 1;
    }
  }
  status = group.broadcast_from_root(status);
  if (status != 0 && group.rank() != 0)
    fmt::print(stderr, "gpupool knn: rank {} of {}: rank 0 could not finish the job (its error "
               "is above)\n", group.rank(), group.size());
  return status;
}

int run_knn(const KnnOptions& options) {
  if (options.mpi || launched_by_mpi()) return run_knn_over_mpi(options);
  auto done = options.devices.empty() ? run_job(options) : run_devices_job(options);
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
  command->add_option("--devices", options->devices,
                      "split the base over these devices, e.g. cuda:0,cuda:1 or sim:2GiB,sim:2GiB "
                      "(a device may be named twice), or all (every GPU; the default device "
                      "without one); same output as one device");
  command->add_flag("--mpi", options->mpi,
                    "run as one process of an MPI job (automatic under mpirun); rank 0 writes "
                    "the files");
  command->add_option("--memory-limit", options->memory_limit,
                      "the pool's hard limit, e.g. 2GiB or 80%, of every device (default: GPUPOOL_MEMORY_LIMIT)");
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
