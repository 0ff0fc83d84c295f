// matrix_traffic_bench: what the distance matrix's memory traffic costs on this GPU without its
// arithmetic, to tell how far the matrix kernel (kernel_bench's l2_matrix rows) is from what its
// reads and writes alone take (docs/benchmarks.md, "... the matrix's memory traffic alone").
//
// The shape is issue 4's, (Q, N, D) = (1024, 2^20, 128) with 2-byte elements: an fp32 output of
// Q × N and a corpus of N rows of 256 bytes. Blocks are laid out as the resident matrix kernel
// lays them out (resident_tiles.cuh): one a multiprocessor, a whole number of runs of corpus
// tiles for each of the 8 query tiles, the 8 blocks of a run reading the same 128-row tiles.
// Each block writes its 128 × 128 output tiles as the kernel does, a warp store covering 128
// bytes of four rows, streaming. Rows of the table:
//   memset                the output by cudaMemsetAsync: the write ceiling
//   tile writes           the tiles' stores alone
//   + corpus reads        each block also reads its 32 KB corpus tile (plain loads) before its
//                         stores: the matrix's traffic without its MMAs and epilogue arithmetic
//   + L2-resident reads   the same reads from an 8 MB corpus, which stays in the L2
//   phased, chunks of C   the grid loads C tiles a run into the L2, meets at a grid barrier,
//                         writes them, meets again (a cooperative launch)
// "/ floor" divides by kernel_bench's floor for the fp16 matrix: (output + inputs) / the copy
// bandwidth measured here (a device-to-device copy, bytes read + written).
#include "cuda_timing.cuh"

#include <CLI/CLI.hpp>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kQueries = 1024, kCorpus = std::size_t(1) << 20, kDim = 128;
constexpr std::size_t kOutputBytes = kQueries * kCorpus * 4;
constexpr std::size_t kRowBytes = kDim * 2;
constexpr int kTileRows = 128, kQueryTiles = kQueries / kTileRows;
constexpr std::size_t kCorpusTiles = kCorpus / kTileRows;
constexpr std::size_t kTileFloat4s = kTileRows * kRowBytes / 16;  // 2048: 32 KB
constexpr int kThreads = 256;

using gpupool::bench::check;
using gpupool::bench::Failure;

// How a block's tiles are laid out and stored (the table's variants). `width`: adjacent corpus
// tiles a step (their rows' pieces stored back to back: 512 bytes a row a tile); `interleaved`:
// run r takes tiles r, r + runs, ... (the runs' blocks, in step, write neighbouring pieces of
// each row) instead of a contiguous range; `row_stores`: a warp store covers 512 bytes of one
// row instead of 128 bytes of four rows.
struct Layout {
  int width = 1;
  bool interleaved = false, row_stores = false;
};

// The block's place: query tile, its steps [0, steps) over corpus tile groups of `width` tiles.
struct Place {
  int query_tile;
  std::size_t run, runs, first, steps;
  __device__ Place(int run_count, const Layout& layout) {
    query_tile = blockIdx.x % kQueryTiles;
    run = blockIdx.x / kQueryTiles;
    runs = run_count;
    const std::size_t groups = kCorpusTiles / layout.width;
    if (layout.interleaved) {
      first = run;
      steps = (groups - run + runs - 1) / runs;
    } else {
      first = groups * run / runs;
      steps = groups * (run + 1) / runs - first;
    }
  }
  // The first corpus tile of step i.
  __device__ std::size_t tile(std::size_t i, const Layout& layout) const {
    return (layout.interleaved ? first + i * runs : first + i) * layout.width;
  }
};

// Output tile (query tile, corpus tile t) as the matrix kernel stores it: warp w writes rows
// 16w .. 16w + 15 in four 32-column slices, 4 rows × 128 bytes a store. `value` keeps the stores
// depending on what was read.
__device__ __forceinline__ void store_tile(float* out, int query_tile, std::size_t t, float value) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::size_t query = query_tile * kTileRows + 16 * warp + 4 * i + lane / 8;
      float* at = out + query * kCorpus + t * kTileRows + 32 * s + 4 * (lane % 8);
      __stcs(reinterpret_cast<float4*>(at), make_float4(value, float(t), float(s), float(lane)));
    }
}

// The same tile, a warp store covering 512 bytes of one row (warp w: rows 16w .. 16w + 15).
__device__ __forceinline__ void store_tile_rows(float* out, int query_tile, std::size_t t,
                                                float value) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const std::size_t query = query_tile * kTileRows + 16 * warp + i;
    float* at = out + query * kCorpus + t * kTileRows + 4 * lane;
    __stcs(reinterpret_cast<float4*>(at), make_float4(value, float(t), float(i), float(lane)));
  }
}

// The block's 32 KB corpus tile t (of a corpus of `tiles` tiles, wrapped), summed.
__device__ __forceinline__ float read_tile(const float4* corpus, std::size_t t, std::size_t tiles) {
  const float4* tile = corpus + t % tiles * kTileFloat4s;
  float4 r[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) r[u] = __ldcg(tile + u * kThreads + threadIdx.x);
  float sum = 0.0f;
#pragma unroll
  for (int u = 0; u < 8; ++u) sum += r[u].x + r[u].y + r[u].z + r[u].w;
  return sum;
}

// corpus_tiles 0: no reads.
__global__ void __launch_bounds__(kThreads, 1)
    tiles_kernel(float* out, const float4* corpus, std::size_t corpus_tiles, int runs,
                 Layout layout, float* sink) {
  const Place place(runs, layout);
  float sum = 0.0f;
  for (std::size_t i = 0; i < place.steps; ++i) {
    const std::size_t t0 = place.tile(i, layout);
    for (int w = 0; w < layout.width; ++w)
      if (corpus_tiles != 0) sum += read_tile(corpus, t0 + w, corpus_tiles);
    for (int w = 0; w < layout.width; ++w) {
      if (layout.row_stores) store_tile_rows(out, place.query_tile, t0 + w, sum);
      else store_tile(out, place.query_tile, t0 + w, sum);
    }
  }
  if (sum == 1234.5f) *sink = sum;  // never: keeps the reads
}

// The same reads one step ahead: the loads of step i + 1's tiles are in flight while step i's
// stores go out (as the matrix kernel's copy-engine stages keep reads ahead of its epilogue).
__global__ void __launch_bounds__(kThreads, 1)
    ahead_kernel(float* out, const float4* corpus, int runs, Layout layout, float* sink) {
  const Place place(runs, layout);
  float4 next[8];
  auto issue = [&](std::size_t t) {
    const float4* tile = corpus + t * kTileFloat4s;
#pragma unroll
    for (int u = 0; u < 8; ++u) next[u] = __ldcg(tile + u * kThreads + threadIdx.x);
  };
  float sum = 0.0f;
  if (place.steps != 0) issue(place.tile(0, layout));
  for (std::size_t i = 0; i < place.steps; ++i) {
    const std::size_t t0 = place.tile(i, layout);
    float arrived = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; ++u) arrived += next[u].x + next[u].y + next[u].z + next[u].w;
    if (i + 1 < place.steps) issue(place.tile(i + 1, layout));
    for (int w = 0; w < layout.width; ++w) {
      if (layout.row_stores) store_tile_rows(out, place.query_tile, t0 + w, sum);
      else store_tile(out, place.query_tile, t0 + w, sum);
    }
    sum += arrived;
  }
  if (sum == 1234.5f) *sink = sum;
}

__global__ void __launch_bounds__(kThreads, 1)
    phased_kernel(float* out, const float4* corpus, int runs, int chunk, float* sink) {
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  const Place place(runs, Layout{});
  const std::size_t last = place.first + place.steps;
  float sum = 0.0f;
  for (std::size_t k = place.first; k < last; k += chunk) {
    const std::size_t end = k + chunk < last ? k + chunk : last;
    // The 8 blocks of the run load the chunk once between them.
    const float4* from = corpus + k * kTileFloat4s;
    const std::size_t count = (end - k) * kTileFloat4s;
    for (std::size_t i = place.query_tile * kThreads + threadIdx.x; i < count;
         i += kQueryTiles * kThreads)
      sum += __ldcg(from + i).x;
    grid.sync();
    for (std::size_t t = k; t < end; ++t) {
      sum += read_tile(corpus, t, kCorpusTiles);
      store_tile(out, place.query_tile, t, sum);
    }
    grid.sync();
  }
  if (sum == 1234.5f) *sink = sum;
}

struct Row {
  std::string name;
  double ms;
};

// After a warm-up call, the median of `reps` event-timed calls on the default stream.
template <class Launch>
double median_ms(int reps, Launch&& launch) {
  launch();
  return gpupool::bench::event_median_ms(nullptr, reps, launch);
}

int run(int reps, const std::string& json_path) {
  int device = 0, multiprocessors = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  const int runs = multiprocessors / kQueryTiles;  // 16 on an H100 SXM: 128 blocks
  const int blocks = runs * kQueryTiles;
  if (runs == 0) throw Failure{"fewer multiprocessors than query tiles (8)"};

  float *out = nullptr, *sink = nullptr;
  float4* corpus = nullptr;
  check(cudaMalloc(&out, kOutputBytes), "cudaMalloc (output, 4.3 GB)");
  check(cudaMalloc(&corpus, kCorpus * kRowBytes), "cudaMalloc (corpus)");
  check(cudaMalloc(&sink, sizeof(float)), "cudaMalloc");
  check(cudaMemset(corpus, 0x3c, kCorpus * kRowBytes), "cudaMemset");  // fp16 1.0s, never read as such

  const std::size_t copy_bytes = std::size_t(1) << 30;
  const double copy_ms = median_ms(5, [&] {
    check(cudaMemcpyAsync(out, out + copy_bytes / 4, copy_bytes, cudaMemcpyDeviceToDevice),
          "cudaMemcpyAsync");
  });
  const double copy_bandwidth = 2.0 * copy_bytes / (copy_ms * 1e-3);
  const double floor_ms =
      (kOutputBytes + kCorpus * kRowBytes + kQueries * kRowBytes) / copy_bandwidth * 1e3;

  std::vector<Row> rows;
  auto tiles = [&](std::size_t corpus_tiles, Layout layout = {}) {
    return [&, corpus_tiles, layout] {
      tiles_kernel<<<blocks, kThreads>>>(out, corpus, corpus_tiles, runs, layout, sink);
      check(cudaGetLastError(), "tiles_kernel");
    };
  };
  rows.push_back({"memset", median_ms(reps, [&] {
                    check(cudaMemsetAsync(out, 0, kOutputBytes), "cudaMemsetAsync");
                  })});
  rows.push_back({"tile writes", median_ms(reps, tiles(0))});
  rows.push_back({"tile writes + corpus reads (268 MB)", median_ms(reps, tiles(kCorpusTiles))});
  rows.push_back({"tile writes + L2-resident reads (8 MB)", median_ms(reps, tiles(256))});
  // The store layouts (Layout), writes alone and with the corpus reads.
  const struct {
    const char* name;
    Layout layout;
  } layouts[] = {{"512-byte row stores", {1, false, true}},
                 {"runs interleaved", {1, true, false}},
                 {"runs interleaved, row stores", {1, true, true}},
                 {"2 tiles a step (1 KB a row)", {2, false, false}},
                 {"4 tiles a step (2 KB a row)", {4, false, false}},
                 {"2 tiles a step, interleaved", {2, true, false}}};
  for (const auto& l : layouts) {
    rows.push_back({std::string(l.name), median_ms(reps, tiles(0, l.layout))});
    rows.push_back({std::string(l.name) + " + reads", median_ms(reps, tiles(kCorpusTiles, l.layout))});
  }
  // Reads a step ahead of the stores (width 1 only: one tile's loads in flight).
  for (const auto& l : {Layout{1, false, false}, Layout{1, false, true}, Layout{1, true, false},
                        Layout{1, true, true}}) {
    const std::string name = std::string("reads ahead") + (l.interleaved ? ", interleaved" : "") +
                             (l.row_stores ? ", row stores" : "");
    rows.push_back({name, median_ms(reps, [&, l] {
                      ahead_kernel<<<blocks, kThreads>>>(out, corpus, runs, l, sink);
                      check(cudaGetLastError(), "ahead_kernel");
                    })});
  }
  for (int chunk : {8, 32}) {
    rows.push_back({"phased, chunks of " + std::to_string(chunk) + " tiles a run",
                    median_ms(reps, [&] {
                      int r = runs, c = chunk;
                      void* args[] = {&out, &corpus, &r, &c, &sink};
                      check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(phased_kernel),
                                                        dim3(blocks), dim3(kThreads), args, 0, 0),
                            "cudaLaunchCooperativeKernel (phased_kernel)");
                    })});
  }

  std::printf("device: %s, %d multiprocessors; %d blocks (%d runs x %d query tiles)\n", prop.name,
              multiprocessors, blocks, runs, kQueryTiles);
  std::printf("copy bandwidth (read + write): %.2f TB/s; fp16 matrix floor (kernel_bench): %.3f ms\n",
              copy_bandwidth / 1e12, floor_ms);
  std::printf("output (%zu x %zu fp32) written by each row; median of %d\n\n", kQueries, kCorpus,
              reps);
  std::printf("%-46s %9s %12s %8s\n", "traffic", "ms", "write TB/s", "/ floor");
  nlohmann::json json = {{"device", prop.name},
                         {"copy_bandwidth_bytes_per_s", copy_bandwidth},
                         {"floor_ms", floor_ms},
                         {"rows", nlohmann::json::array()}};
  for (const Row& r : rows) {
    std::printf("%-46s %9.3f %12.2f %8.2f\n", r.name.c_str(), r.ms,
                kOutputBytes / (r.ms * 1e-3) / 1e12, r.ms / floor_ms);
    json["rows"].push_back({{"traffic", r.name}, {"ms", r.ms}, {"ratio_to_floor", r.ms / floor_ms}});
  }
  if (!json_path.empty()) std::ofstream(json_path) << json.dump(2) << "\n";
  cudaFree(out);
  cudaFree(corpus);
  cudaFree(sink);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"matrix_traffic_bench: the distance matrix's memory traffic without its arithmetic"};
  int reps = 7;
  std::string json_path;
  app.add_option("--reps", reps, "timed runs of each row (the median is printed)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--json", json_path, "also write the rows to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(reps, json_path);
  } catch (const Failure& f) {
    std::fprintf(stderr, "matrix_traffic_bench: %s\n", f.what.c_str());
    return 1;
  }
}
