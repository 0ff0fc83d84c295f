// kernel_bench: gpupool:kernels against the hardware's floor (issue 4's evidence).
//
// For each shape (Q queries, N corpus rows, D dims) and input precision it times the full L2
// matrix (l2_distance) and the fused kNN (knn, k = 10 and 100), and prints ms, TFLOP/s, queries/s
// and the fraction of the roofline floor reached (floor / measured; 1.0 is the limit).
// Floor = max(2·Q·N·D / peak rate of the precision, bytes / copy bandwidth), where bytes count
// each input read once and each output written once, and the copy bandwidth is measured at start
// (a device-to-device copy, bytes read + written). Peak rates are Hopper datasheet / measured
// figures (see kPeaks): edit them, or pass --peak-scale, for another GPU.
//
// Timing: one warm-up call, then --reps calls, each followed by a device synchronize, timed by the
// host clock; the median is reported (host timing adds a few microseconds of launch and sync
// latency per call, which counts against us). On a CUDA device a second median, "dev ms", times
// another --reps calls between two CUDA events recorded on the call's stream around it: the GPU's
// time from the first event to the second, the call's kernels and any gaps while the host
// launches them, but not the synchronize's wake-up; the peers in bench/peers measure theirs so.
// On a CUDA device the default shapes are the issue's;
// without one (a build without CUDA, or no GPU) it runs --tiny shapes on the simulated device
// so that the program is exercised everywhere, and says that those numbers are CPU numbers.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>
#if GPUPOOL_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
import gpupool;

using namespace gpupool;

namespace {

struct Shape {
  std::size_t q, n, d;
};

// The issues' shapes (small batches: 1, 8 and 64 queries), and small ones for the simulated device.
const std::vector<Shape> kIssueShapes = {
    {1024, std::size_t{1} << 20, 128}, {1024, std::size_t{1} << 20, 960}, {10000, 100000, 128},
    {1, std::size_t{1} << 20, 128},    {8, std::size_t{1} << 20, 128},     {64, std::size_t{1} << 20, 128}};
const std::vector<Shape> kTinyShapes = {{32, 4096, 128}, {1, 8192, 128}, {4, 1024, 960}};

// What one row of the table measures.
struct Variant {
  Precision precision;
  ComputeMode mode;
  std::string name;
};
const std::vector<Variant> kVariants = {{Precision::Fp32, ComputeMode::Fp32Accurate, "fp32"},
                                        {Precision::Fp32, ComputeMode::Tf32, "tf32"},
                                        {Precision::Fp16, ComputeMode::Fp32Accurate, "fp16"},
                                        {Precision::Bf16, ComputeMode::Fp32Accurate, "bf16"},
                                        {Precision::Int8, ComputeMode::Fp32Accurate, "int8"}};

// Dense peak rates (FLOP/s) of an H100/H200 SXM. tf32 and int8: datasheet dense tensor-core
// rates; fp16/bf16: 790 T, an 8192³ bf16 cuBLAS product measured on an H100 and an H200, below
// the 989 T datasheet figure. fp32-accurate: a third of that, since its kernels multiply three
// fp16 products a multiply-add (the matrix on fp16 halves, the kNN filter on scaled fp16 copies;
// docs/kernels.md), so the CUDA cores' 67 T does not bound them.
double peak_flops(const Variant& v) {
  switch (v.precision) {
    case Precision::Fp32: return v.mode == ComputeMode::Tf32 ? 494e12 : 790e12 / 3;
    case Precision::Int8: return 1979e12;
    default: return 790e12;
  }
}

struct Options {
  int reps = 5;
  bool tiny = false;
  double peak_scale = 1.0;
  std::string json_path;
  std::vector<std::string> only;  // variant names; empty = all
  std::vector<std::string> shapes;  // "QxNxD"; empty = the defaults
  std::string ops = "all";  // all, matrix or knn
  bool corpus_norms = false;  // knn rows with the corpus norms computed once, before the timing
};

Result<Shape> parse_shape(const std::string& text) {
  Shape s{};
  char x1 = 0, x2 = 0;
  int used = 0;
  if (std::sscanf(text.c_str(), "%zu%c%zu%c%zu%n", &s.q, &x1, &s.n, &x2, &s.d, &used) != 5 ||
      x1 != 'x' || x2 != 'x' || used != static_cast<int>(text.size()) || !s.q || !s.n || !s.d)
    return std::unexpected(GpuError(ErrorKind::InvalidInput,
                                    fmt::format("--shape '{}': expected QxNxD, e.g. 1024x1048576x128",
                                                text)));
  return s;
}

struct Row {
  std::string op, variant;
  Shape shape;
  std::size_t k = 0;
  double ms = 0, floor_ms = 0, tflops = 0, qps = 0, fraction = 0;
  double device_ms = 0;  // CUDA events around the call; 0 where not measured
  std::string path;  // knn: KnnPath of the last timed call
  std::string error;
  bool corpus_norms = false;  // knn: read the norms given (--corpus-norms)
};

// Fresh random values in [-1, -0.05] ∪ [0.05, 1] (never zeros), one splitmix64 stream per thread.
std::vector<float> random_floats(std::size_t count, std::uint64_t seed) {
  std::vector<float> v(count);
  unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  std::size_t chunk = (count + threads - 1) / threads;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + t + 1;
      for (std::size_t i = t * chunk; i < std::min(count, (t + 1) * chunk); ++i) {
        s += 0x9E3779B97F4A7C15ull;
        std::uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = static_cast<float>(z >> 40) * 0x1p-24f;  // [0, 1)
        float magnitude = 0.05f + 0.95f * u;
        v[i] = (z & 1) ? -magnitude : magnitude;
      }
    });
  for (auto& th : pool) th.join();
  return v;
}

// A matrix in one precision, with its int8 scales.
struct Input {
  ManagedBuffer data;
  std::optional<ManagedBuffer> scales;
};

Result<Input> to_precision(GpuMemoryPool& pool, const Device& device, const ManagedBuffer& fp32,
                           std::size_t dim, Precision p) {
  Input in;
  auto out = pool.get_managed_buffer(device, fp32.element_count(), p);
  if (!out) return std::unexpected(out.error());
  ConvertOptions options{.dim = dim};
  if (p == Precision::Int8) {
    auto s = pool.get_managed_buffer(device, fp32.element_count() / dim, Precision::Fp32);
    if (!s) return std::unexpected(s.error());
    in.scales = std::move(*s);
    options.scales = &*in.scales;
  }
  if (p == Precision::Fp32) {
    auto ok = device.copy(out->raw_data(), fp32.raw_data(), fp32.size_bytes(),
                          CopyKind::DeviceToDevice, out->stream());
    if (!ok) return std::unexpected(ok.error());
  } else if (auto ok = convert(fp32, *out, options); !ok) {
    return std::unexpected(ok.error());
  }
  in.data = std::move(*out);
  return in;
}

Result<ManagedBuffer> upload_random(GpuMemoryPool& pool, const Device& device, std::size_t count,
                                    std::uint64_t seed) {
  auto host = random_floats(count, seed);
  auto b = pool.get_managed_buffer(device, count, Precision::Fp32);
  if (!b) return std::unexpected(b.error());
  if (auto ok = b->upload(std::span<const float>(host)); !ok) return std::unexpected(ok.error());
  return std::move(*b);
}

// Median wall time in ms of `call` (which returns Result<void>), after one warm-up.
template <class Call>
Result<double> median_ms(const Device& device, int reps, Call&& call) {
  std::vector<double> times;
  for (int r = 0; r <= reps; ++r) {
    auto start = std::chrono::steady_clock::now();
    if (auto ok = call(); !ok) return std::unexpected(ok.error());
    if (auto ok = device.synchronize(); !ok) return std::unexpected(ok.error());
    auto stop = std::chrono::steady_clock::now();
    if (r > 0) times.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median device time in ms of `call` between two CUDA events recorded on `stream` (a native
// stream handle, null for the default stream), after one warm-up; 0 without CUDA or on the
// simulated device.
template <class Call>
Result<double> median_device_ms(const Device& device, void* stream, int reps, Call&& call) {
#if GPUPOOL_WITH_CUDA
  if (device.kind() != DeviceKind::Cuda) return 0.0;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto failed = [&](cudaError_t e, const char* what) -> Result<double> {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    return std::unexpected(GpuError(ErrorKind::Cuda,
                                    fmt::format("{}: {}", what, cudaGetErrorString(e))));
  };
  if (cudaError_t e = cudaEventCreate(&start); e != cudaSuccess) return failed(e, "cudaEventCreate");
  if (cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) return failed(e, "cudaEventCreate");
  auto native = static_cast<cudaStream_t>(stream);
  std::vector<double> times;
  for (int r = 0; r <= reps; ++r) {
    if (cudaError_t e = cudaEventRecord(start, native); e != cudaSuccess)
      return failed(e, "cudaEventRecord");
    if (auto ok = call(); !ok) {
      cudaEventDestroy(start), cudaEventDestroy(stop);
      return std::unexpected(ok.error());
    }
    if (cudaError_t e = cudaEventRecord(stop, native); e != cudaSuccess)
      return failed(e, "cudaEventRecord");
    if (cudaError_t e = cudaEventSynchronize(stop); e != cudaSuccess)
      return failed(e, "cudaEventSynchronize");
    float ms = 0;
    if (cudaError_t e = cudaEventElapsedTime(&ms, start, stop); e != cudaSuccess)
      return failed(e, "cudaEventElapsedTime");
    if (r > 0) times.push_back(ms);
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
#else
  (void)device, (void)stream, (void)reps, (void)call;
  return 0.0;
#endif
}

// Device-to-device copy bandwidth (bytes read + written per second), median of 5.
Result<double> copy_bandwidth(GpuMemoryPool& pool, const Device& device, std::size_t bytes) {
  auto a = pool.get_managed_buffer(device, bytes, Precision::Bytes);
  if (!a) return std::unexpected(a.error());
  auto b = pool.get_managed_buffer(device, bytes, Precision::Bytes);
  if (!b) return std::unexpected(b.error());
  if (auto ok = a->fill_zero(); !ok) return std::unexpected(ok.error());
  auto ms = median_ms(device, 5, [&] {
    return device.copy(b->raw_data(), a->raw_data(), bytes, CopyKind::DeviceToDevice, b->stream());
  });
  if (!ms) return std::unexpected(ms.error());
  return 2.0 * static_cast<double>(bytes) / (*ms * 1e-3);
}

void fill_figures(Row& row, const Variant& v, double bandwidth, double peak_scale,
                  std::size_t out_bytes) {
  const Shape& s = row.shape;
  double flops = 2.0 * s.q * s.n * s.d;
  double in_bytes = static_cast<double>(s.q + s.n) * s.d * element_size(v.precision);
  double compute_s = flops / (peak_flops(v) * peak_scale);
  double memory_s = (in_bytes + static_cast<double>(out_bytes)) / bandwidth;
  row.floor_ms = std::max(compute_s, memory_s) * 1e3;
  row.tflops = flops / (row.ms * 1e-3) / 1e12;
  row.qps = static_cast<double>(s.q) / (row.ms * 1e-3);
  row.fraction = row.floor_ms / row.ms;
}

struct Context {
  Device device;
  GpuMemoryPool pool;
  Options options;
  double bandwidth = 0;
};

// The L2 matrix and kNN (k = 10, 100) rows of one shape and variant.
std::vector<Row> measure(Context& c, const Shape& s, const Variant& v, const Input& q,
                         const Input& x) {
  std::vector<Row> rows;
  const bool matrix = c.options.ops != "knn", nearest = c.options.ops != "matrix";
  DistanceOptions o{.dim = s.d, .metric = Metric::L2, .mode = v.mode,
                    .query_scales = q.scales ? &*q.scales : nullptr,
                    .corpus_scales = x.scales ? &*x.scales : nullptr};
  if (matrix) {
    Row row;
    row.op = "l2_matrix", row.variant = v.name, row.shape = s;
    auto out = c.pool.get_managed_buffer(c.device, s.q * s.n, Precision::Fp32);
    Result<double> ms = out ? median_ms(c.device, c.options.reps,
                                        [&] { return l2_distance(q.data, x.data, *out, o); })
                            : Result<double>(std::unexpected(out.error()));
    if (ms) row.ms = *ms, fill_figures(row, v, c.bandwidth, c.options.peak_scale, s.q * s.n * 4);
    else row.error = ms.error().to_string();
    if (ms) {
      auto dev = median_device_ms(c.device, q.data.stream_handle(), c.options.reps,
                                  [&] { return l2_distance(q.data, x.data, *out, o); });
      if (dev) row.device_ms = *dev;
      else row.error = dev.error().to_string();
    }
    rows.push_back(row);
  }
  // A server keeps its index's norms: computed once here, outside the timed calls.
  std::optional<ManagedBuffer> norms;
  if (nearest && c.options.corpus_norms) {
    auto made = c.pool.get_managed_buffer(c.device, s.n, Precision::Fp32);
    Result<void> ok = made ? row_norms(x.data, *made, s.d, o.corpus_scales)
                           : Result<void>(std::unexpected(made.error()));
    if (!ok) {
      Row failed;
      failed.op = "knn", failed.variant = v.name, failed.shape = s;
      failed.error = ok.error().to_string();
      rows.push_back(failed);
      return rows;
    }
    norms = std::move(*made);
  }
  DistanceOptions knn_options = o;
  knn_options.corpus_norms = norms ? &*norms : nullptr;
  for (std::size_t k : {std::size_t{10}, std::size_t{100}}) {
    if (!nearest) break;
    Row row;
    row.op = "knn", row.variant = v.name, row.shape = s, row.k = k;
    row.corpus_norms = norms.has_value();
    auto call = [&]() -> Result<void> {
      auto r = knn(c.pool, q.data, x.data, k, knn_options);
      if (!r) return std::unexpected(r.error());
      row.path = to_string(r->path);
      return {};
    };
    auto ms = median_ms(c.device, c.options.reps, call);
    if (ms) row.ms = *ms, fill_figures(row, v, c.bandwidth, c.options.peak_scale, s.q * k * 8);
    else row.error = ms.error().to_string();
    if (ms) {
      auto dev = median_device_ms(c.device, q.data.stream_handle(), c.options.reps, call);
      if (dev) row.device_ms = *dev;
      else row.error = dev.error().to_string();
    }
    rows.push_back(row);
  }
  return rows;
}

void print_row(const Row& r) {
  std::string shape = fmt::format("{}x{}x{}", r.shape.q, r.shape.n, r.shape.d);
  std::string op = r.k ? fmt::format("knn k={}", r.k) : r.op;
  if (!r.error.empty()) {
    fmt::print("{:<11} {:<5} {:<20} ERROR {}\n", op, r.variant, shape, r.error);
  } else {
    const std::string device_ms = r.device_ms > 0 ? fmt::format("{:.3f}", r.device_ms) : "-";
    const std::string device_fraction =
        r.device_ms > 0 ? fmt::format("{:.3f}", r.floor_ms / r.device_ms) : "-";
    fmt::print("{:<11} {:<5} {:<20} {:>10.3f} {:>9} {:>9.3f} {:>8.1f} {:>13.0f} {:>7.3f} {:>9} {}\n",
               op, r.variant, shape, r.ms, device_ms, r.floor_ms, r.tflops, r.qps, r.fraction,
               device_fraction, r.path);
  }
  std::fflush(stdout);
}

nlohmann::json to_json(const Row& r) {
  nlohmann::json j = {{"op", r.op},           {"variant", r.variant}, {"q", r.shape.q},
                      {"n", r.shape.n},       {"d", r.shape.d},       {"k", r.k},
                      {"ms", r.ms},           {"floor_ms", r.floor_ms}, {"tflops", r.tflops},
                      {"queries_per_s", r.qps}, {"floor_fraction", r.fraction}};
  if (r.device_ms > 0) {
    j["device_ms"] = r.device_ms;
    j["device_floor_fraction"] = r.floor_ms / r.device_ms;
  }
  if (!r.path.empty()) j["path"] = r.path;
  if (r.corpus_norms) j["corpus_norms"] = true;
  if (!r.error.empty()) j["error"] = r.error;
  return j;
}

bool wanted(const Options& o, const Variant& v) {
  return o.only.empty() || std::find(o.only.begin(), o.only.end(), v.name) != o.only.end();
}

// All rows of one shape: random fp32 inputs, then each precision converted on the device.
Result<std::vector<Row>> run_shape(Context& c, const Shape& s, std::uint64_t seed) {
  std::vector<Row> rows;
  auto q32 = upload_random(c.pool, c.device, s.q * s.d, seed);
  if (!q32) return std::unexpected(q32.error());
  auto x32 = upload_random(c.pool, c.device, s.n * s.d, seed + 1);
  if (!x32) return std::unexpected(x32.error());
  for (const Variant& v : kVariants) {
    if (!wanted(c.options, v)) continue;
    auto q = to_precision(c.pool, c.device, *q32, s.d, v.precision);
    if (!q) return std::unexpected(q.error());
    auto x = to_precision(c.pool, c.device, *x32, s.d, v.precision);
    if (!x) return std::unexpected(x.error());
    for (Row& r : measure(c, s, v, *q, *x)) {
      print_row(r);
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

// Issue 4's targets for (1024, 2^20, 128), k = 10.
void print_targets(const std::vector<Row>& rows) {
  fmt::print("\ntargets, (1024, 2^20, 128):{}\n",
             std::any_of(rows.begin(), rows.end(), [](const Row& r) {
               return r.shape.q == 1024 && r.shape.n == (1u << 20) && r.shape.d == 128;
             }) ? "" : " shape not measured in this run");
  for (const Row& r : rows) {
    if (!r.error.empty() || r.shape.q != 1024 || r.shape.n != (1u << 20) || r.shape.d != 128)
      continue;
    double target = 0;
    std::string what;
    if (r.op == "knn" && r.k == 10 && (r.variant == "bf16" || r.variant == "fp16"))
      target = 1e6, what = "queries/s";
    else if (r.op == "knn" && r.k == 10 && r.variant == "fp32")
      target = 2.5e5, what = "queries/s";
    else if (r.op == "l2_matrix")
      target = 0.8, what = "floor fraction (1/1.25)";
    else
      continue;
    double got = what == "queries/s" ? r.qps : r.fraction;
    fmt::print("  {:<10} {:<5} {} {:.3g} vs target {:.3g}: {} ({:.2f}x of target)\n",
               r.k ? fmt::format("knn k={}", r.k) : r.op, r.variant, what, got, target,
               got >= target ? "met" : "MISSED", got / target);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"kernel_bench: gpupool:kernels (L2 matrix, fused kNN) against the roofline floor"};
  app.add_option("--json", options.json_path, "also write the rows as JSON to this file");
  app.add_option("--reps", options.reps, "timed calls per row (median reported)")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--tiny", options.tiny, "small shapes (the default without a CUDA device)");
  app.add_option("--variants", options.only, "only these: fp32 tf32 fp16 bf16 int8");
  app.add_option("--shape", options.shapes, "only these shapes, QxNxD (repeatable)");
  app.add_option("--ops", options.ops, "only these rows: all, matrix (l2_distance) or knn")
      ->check(CLI::IsMember({"all", "matrix", "knn"}));
  app.add_option("--peak-scale", options.peak_scale, "multiply the peak FLOP rates (other GPUs)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--corpus-norms", options.corpus_norms,
               "knn rows read the corpus rows' norms, computed once before the timed calls "
               "(DistanceOptions::corpus_norms, as a server keeps them with its index)");
  CLI11_PARSE(app, argc, argv);

  std::vector<Shape> shapes;
  for (const std::string& text : options.shapes) {
    auto s = parse_shape(text);
    if (!s) {
      fmt::print(stderr, "kernel_bench: {}\n", s.error().to_string());
      return 2;
    }
    shapes.push_back(*s);
  }
  bool has_gpu = Device::cuda_device_count() > 0;
  auto device = has_gpu ? Device::cuda(0) : Device::simulated({});
  if (!device) {
    fmt::print(stderr, "kernel_bench: {}\n", device.error().to_string());
    return 1;
  }
  if (!has_gpu) {
    options.tiny = true;
    fmt::print("kernel_bench: no CUDA device (or a build without CUDA): tiny shapes on the "
               "simulated device; these are CPU numbers against GPU peaks, not GPU evidence\n");
  }
  if (shapes.empty()) shapes = options.tiny ? kTinyShapes : kIssueShapes;
  Context c{*device, GpuMemoryPool{}, options};
  auto bw = copy_bandwidth(c.pool, c.device, options.tiny ? (64u << 20) : (std::size_t{1} << 30));
  if (!bw) {
    fmt::print(stderr, "kernel_bench: copy bandwidth: {}\n", bw.error().to_string());
    return 1;
  }
  c.bandwidth = *bw;
  fmt::print("device: {}\ncopy bandwidth (read + write): {:.2f} TB/s; reps {}; ms: median of host "
             "wall time with a synchronize per call; dev ms: median of CUDA-event device time "
             "(as bench/peers); TFLOP/s, queries/s, floor/t from ms, floor/dev from dev ms{}\n\n",
             c.device.describe(), c.bandwidth / 1e12, options.reps,
             options.corpus_norms ? "; knn with the corpus norms given (--corpus-norms)" : "");
  fmt::print("{:<11} {:<5} {:<20} {:>10} {:>9} {:>9} {:>8} {:>13} {:>7} {:>9} {}\n", "op", "prec",
             "Q x N x D", "ms", "dev ms", "floor ms", "TFLOP/s", "queries/s", "floor/t", "floor/dev",
             "knn path");

  std::vector<Row> rows;
  bool failed = false;
  std::uint64_t seed = static_cast<std::uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
  for (const Shape& s : shapes) {
    auto shape_rows = run_shape(c, s, seed += 2);
    if (!shape_rows) {
      fmt::print("shape {}x{}x{}: ERROR {}\n", s.q, s.n, s.d, shape_rows.error().to_string());
      failed = true;
      continue;
    }
    for (Row& r : *shape_rows) failed |= !r.error.empty(), rows.push_back(std::move(r));
  }
  print_targets(rows);

  if (!options.json_path.empty()) {
    nlohmann::json doc = {{"device", c.device.describe()},
                          {"copy_bandwidth_bytes_per_s", c.bandwidth},
                          {"reps", options.reps},
                          {"simulated", !has_gpu},
                          {"rows", nlohmann::json::array()}};
    for (const Row& r : rows) doc["rows"].push_back(to_json(r));
    std::ofstream(options.json_path) << doc.dump(2) << "\n";
  }
  return failed ? 1 : 0;
}
