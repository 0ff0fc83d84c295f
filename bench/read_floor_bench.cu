// read_floor_bench: what reading a corpus once costs on this GPU when nothing else is done with
// it, timed as kernel_bench times a call, so that the few-queries kNN rows (kernel_bench's
// (Q, 2^20, 128) shapes) can be held against the best any one-pass kernel could do there
// (docs/benchmarks.md, "few queries").
//
// For corpora of `--rows` rows of `--dim` elements of 4, 2 and 1 bytes (fp32, fp16 / bf16, int8),
// rows of the table:
//   empty kernel          a launch of a kernel that does nothing: the call's fixed cost
//   read                  one wave of blocks reads every byte once (16-byte loads, four in
//                         flight a thread, grid-stride) and folds them into one word a block
//   read + finish         the same, then a one-block kernel that reads the blocks' words (as the
//                         few-queries kNN's merge kernel follows its scan)
//   read, slices          as `read`, but each block reads one contiguous slice of the corpus
//                         (1/blocks of it) from its start to its end, as the few-queries kNN's
//                         blocks do, so that every block starts in another part of the corpus
// Columns: ms, the median of --reps calls by the host clock around the launch(es) and a stream
// synchronize (kernel_bench's *ms*), and dev ms between two CUDA events around them (its *dev
// ms*); floor/t, the floor (corpus bytes / the copy bandwidth measured here as kernel_bench
// measures it: a 1 GiB device-to-device copy, bytes read + written) over each.
#include "cuda_timing.cuh"

#include <CLI/CLI.hpp>
#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr int kThreads = 256;

using gpupool::bench::check;
using gpupool::bench::Failure;

__global__ void empty_kernel() {}

// Words i, i + step, ... below `end`, four loads in flight, folded into one word.
__device__ __forceinline__ unsigned fold_words(const uint4* words, std::size_t i, std::size_t end,
                                               std::size_t step) {
  unsigned fold = 0;
  for (; i + 3 * step < end; i += 4 * step) {
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = __ldcs(words + i + u * step);
#pragma unroll
    for (int u = 0; u < 4; ++u) fold += r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  for (; i < end; i += step) {
    const uint4 r = __ldcs(words + i);
    fold += r.x ^ r.y ^ r.z ^ r.w;
  }
  return fold;
}

// The block's threads' folds summed into folds[blockIdx.x].
__device__ __forceinline__ void store_block_fold(unsigned fold, unsigned* folds) {
  for (int offset = 16; offset > 0; offset /= 2) fold += __shfl_xor_sync(0xffffffffu, fold, offset);
  __shared__ unsigned warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = fold;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned sum = 0;
    for (unsigned w : warps) sum += w;
    folds[blockIdx.x] = sum;
  }
}

// Every 16-byte word of `words` read once, grid-stride; each block's fold into folds[blockIdx.x].
__global__ void __launch_bounds__(kThreads) read_kernel(const uint4* words, std::size_t count,
                                                        unsigned* folds) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  store_block_fold(fold_words(words, static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x,
                              count, stride),
                   folds);
}

// The same, block b reading the b-th of `gridDim.x` contiguous slices.
__global__ void __launch_bounds__(kThreads) read_slices_kernel(const uint4* words, std::size_t count,
                                                               unsigned* folds) {
  const std::size_t first = count * blockIdx.x / gridDim.x, end = count * (blockIdx.x + 1) / gridDim.x;
  store_block_fold(fold_words(words, first + threadIdx.x, end, kThreads), folds);
}

// The blocks' words folded into one (one block).
__global__ void __launch_bounds__(kThreads) finish_kernel(const unsigned* folds, int blocks,
                                                          unsigned* out) {
  unsigned fold = 0;
  for (int b = threadIdx.x; b < blocks; b += kThreads) fold += folds[b];
  for (int offset = 16; offset > 0; offset /= 2) fold += __shfl_xor_sync(0xffffffffu, fold, offset);
  if (threadIdx.x % 32 == 0) atomicAdd(out, fold);
}

struct Timing {
  double ms = 0, device_ms = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `launch` timed by the host clock around it and a synchronize, and by events around it.
template <class Launch>
Timing time_calls(cudaStream_t s, int reps, Launch launch) {
  launch();
  check(cudaStreamSynchronize(s), "warm-up");
  std::vector<double> host;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    launch();
    check(cudaStreamSynchronize(s), "call");
    host.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return {median(host), gpupool::bench::event_median_ms(s, reps, launch)};
}

// Bytes read + written per second by a device-to-device copy of `bytes`, median of 5.
double copy_bandwidth(cudaStream_t s, std::size_t bytes) {
  void *from = nullptr, *to = nullptr;
  check(cudaMalloc(&from, bytes), "cudaMalloc");
  check(cudaMalloc(&to, bytes), "cudaMalloc");
  check(cudaMemsetAsync(from, 0x5a, bytes, s), "cudaMemsetAsync");
  const Timing t = time_calls(s, 5, [&] {
    check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
  });
  cudaFree(from);
  cudaFree(to);
  return 2.0 * static_cast<double>(bytes) / (t.device_ms * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"read_floor_bench: the cost of reading a corpus once, timed as kernel_bench times a call"};
  std::size_t rows = std::size_t{1} << 20, dim = 128;
  int reps = 21;
  std::string json_path;
  app.add_option("--rows", rows, "corpus rows")->check(CLI::Range(std::size_t{1}, std::size_t{1} << 31));
  app.add_option("--dim", dim, "elements a row, a multiple of 16 (every row whole 16-byte words)")
      ->check(CLI::Range(16, 4096) & CLI::Validator(
                                          [](std::string& v) {
                                            return std::stoul(v) % 16 == 0 ? std::string{}
                                                                           : "not a multiple of 16";
                                          },
                                          "MULTIPLE OF 16"));
  app.add_option("--reps", reps, "timed calls a row (the median is printed)")->check(CLI::Range(1, 10000));
  app.add_option("--json", json_path, "also write the rows to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    cudaStream_t s;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    int device = 0, multiprocessors = 0, per_multiprocessor = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    check(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device), "attribute");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, read_kernel, kThreads, 0),
          "occupancy");
    const int blocks = multiprocessors * per_multiprocessor;
    const double bandwidth = copy_bandwidth(s, std::size_t{1} << 30);
    std::printf("device: %s; copy bandwidth (read + write): %.2f TB/s; %d blocks of %d threads; "
                "median of %d calls\n", prop.name, bandwidth / 1e12, blocks, kThreads, reps);
    std::printf("%-16s %-7s %12s %9s %9s %9s %9s\n", "row", "bytes", "corpus MB", "ms", "dev ms",
                "floor/t", "floor/dev");

    void* corpus = nullptr;
    unsigned *folds = nullptr, *out = nullptr;
    const std::size_t most = rows * dim * 4;
    check(cudaMalloc(&corpus, most), "cudaMalloc corpus");
    check(cudaMalloc(&folds, blocks * sizeof(unsigned)), "cudaMalloc");
    check(cudaMalloc(&out, sizeof(unsigned)), "cudaMalloc");
    check(cudaMemsetAsync(corpus, 0x3c, most, s), "cudaMemsetAsync");
    check(cudaStreamSynchronize(s), "fill");

    nlohmann::json rows_json = nlohmann::json::array();
    auto print = [&](const char* name, std::size_t element, std::size_t bytes, Timing t) {
      const double floor_ms = static_cast<double>(bytes) / bandwidth * 1e3;
      const double a = bytes ? floor_ms / t.ms : 0, b = bytes ? floor_ms / t.device_ms : 0;
      std::printf("%-16s %-7zu %12.1f %9.4f %9.4f %9.2f %9.2f\n", name, element, bytes / 1e6, t.ms,
                  t.device_ms, a, b);
      rows_json.push_back({{"row", name}, {"element_bytes", element}, {"corpus_bytes", bytes},
                           {"ms", t.ms}, {"device_ms", t.device_ms}, {"floor_ms", floor_ms},
                           {"floor_over_t", a}, {"floor_over_device_t", b}});
    };

    print("empty kernel", 0, 0, time_calls(s, reps, [&] { empty_kernel<<<1, 32, 0, s>>>(); }));
    for (std::size_t element : {4, 2, 1}) {
      const std::size_t bytes = rows * dim * element, words = bytes / 16;
      auto read = [&] {
        read_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const uint4*>(corpus), words, folds);
      };
      print("read", element, bytes, time_calls(s, reps, read));
      print("read + finish", element, bytes, time_calls(s, reps, [&] {
              read();
              finish_kernel<<<1, kThreads, 0, s>>>(folds, blocks, out);
            }));
      print("read, slices", element, bytes, time_calls(s, reps, [&] {
              read_slices_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const uint4*>(corpus), words,
                                                            folds);
            }));
    }
    check(cudaGetLastError(), "kernels");
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << nlohmann::json{{"device", prop.name}, {"copy_bandwidth_bytes_per_s", bandwidth},
                          {"blocks", blocks}, {"reps", reps}, {"rows", rows_json}}
               .dump(2);
      if (!f) throw Failure{"cannot write " + json_path};
    }
    cudaFree(corpus);
    cudaFree(folds);
    cudaFree(out);
    return 0;
  } catch (const Failure& f) {
    std::fprintf(stderr, "read_floor_bench: %s\n", f.what.c_str());
    return 1;
  }
}
