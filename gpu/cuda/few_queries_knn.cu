// kNN for up to 64 queries in one pass over the corpus (few_queries_knn.cuh).
//
// Layout. A warp takes 16 corpus rows at a time; lane l (g = l / 4, c = l % 4) holds bytes
// [64j + 16c, 64j + 16c + 16) of rows g and g + 8 for every 64-byte chunk j of the row: each load
// instruction reads 64 contiguous bytes of 8 rows, and the pieces are an mma.sync A fragment as
// they are. The dot product sums over the row, so any order of its elements serves as long as the
// queries (the B fragment) use the same one: a piece's words 0-1 are one m16n8k16 (fp16 / bf16)
// or m16n8k32 (int8) step's k-slots {2c, 2c+1, 2c+8, 2c+9} ({4c..4c+3, 16+4c..16+4c+3}), words
// 2-3 the next step's, and query row g of the group is read from shared memory in the same
// pieces. Fp32 rows take the same pieces with fp32 FMA (exact fp32 products, like the tiled path's
// SGEMM): each lane sums its pieces for 8 queries, and a reduce-scatter over the quad (two rounds
// of shuffles) leaves each lane the mma's C layout: rows g, g + 8 and queries 2c, 2c + 1.
//
// Top-k. Each block scans one slice of the corpus in rounds of 128 rows (8 warps × 16) and keeps,
// per query, a list in shared memory: k sorted entries, then a buffer of appended rows that beat
// the k-th entry (distance_rules.cuh's order). After a round, if a buffer filled past half or a
// list short of k got rows, each warp sorts its queries' lists (bitonic, within the warp) and the
// block goes on; a row that found its buffer full is tested again after that sort, so none is
// lost whatever the rows' order. The next round's rows are loaded before this round's are used.
// At the end each block writes its lists (Q × blocks × k) and topk_update merges them.
#include "few_queries_knn.cuh"
#include "distance_rules.cuh"
#include "per_device.cuh"
#include "piece_squares.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>

namespace gpupool::cudak {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRoundRows = kWarps * 16;

Status status_of(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status{} : cuda_failure(static_cast<int>(e), what);
}

// Shared-memory query rows: stride ≡ 64 (mod 128) bytes, so that the 8 lanes of a quarter warp
// (two query rows, four pieces each) read 128 bytes in distinct banks.
__host__ __device__ constexpr int query_stride(int chunks) {
  return (chunks * 64) % 128 == 0 ? chunks * 64 + 64 : chunks * 64;
}

__host__ __device__ constexpr unsigned power_of_two_at_least(unsigned n) {
  unsigned p = 1;
  while (p < n) p *= 2;
  return p;
}

// Slots of a query's list: k sorted entries and at least 64 (or k) appended ones.
std::size_t list_slots(std::size_t k) {
  return power_of_two_at_least(static_cast<unsigned>(std::max<std::size_t>(2 * k, k + 64)));
}

std::size_t shared_bytes(int groups, int chunks, std::size_t queries, std::size_t k) {
  const std::size_t padded = static_cast<std::size_t>(groups) * 8;
  return padded * static_cast<std::size_t>(query_stride(chunks)) + 2 * padded * sizeof(float) +
         queries * list_slots(k) * 8 + queries * sizeof(int);
}

__device__ __forceinline__ void mma_step(Element e, float (&acc)[4], unsigned a0, unsigned a1,
                                         unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  if (e == Element::Fp16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_step_s8(int (&acc)[4], unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float dot4(uint4 a, uint4 b, float acc) {
  acc = fmaf(__uint_as_float(a.x), __uint_as_float(b.x), acc);
  acc = fmaf(__uint_as_float(a.y), __uint_as_float(b.y), acc);
  acc = fmaf(__uint_as_float(a.z), __uint_as_float(b.z), acc);
  return fmaf(__uint_as_float(a.w), __uint_as_float(b.w), acc);
}

// One warp's 16 rows: the pieces of rows g and g + 8, and their int8 scales.
template <int kChunks>
struct Rows {
  uint4 piece[2][kChunks];
  float scale[2];
};

struct KernelArgs {
  const void* q;
  const void* x;
  const float* q_scales;
  const float* x_scales;
  int queries;
  int n;
  int dim;
  int row_bytes;
  Metric metric;
  bool exact_l2;
  int k;
  int slots;
  int slice_rows;
  float* part_d;
  std::int32_t* part_i;
};

// A warp's bitonic sort of a list's first n slots (n a power of two), knn's order.
__device__ void warp_sort(float* d, int* id, int n, int lane) {
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int t = lane; t < n / 2; t += 32) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        if (better(d[hi], id[hi], d[lo], id[lo]) == ascending) {
          const float td = d[lo];
          d[lo] = d[hi];
          d[hi] = td;
          const int ti = id[lo];
          id[lo] = id[hi];
          id[hi] = ti;
        }
      }
      __syncwarp();
    }
}

// The appended entries of a query's list sorted in, the list's tail emptied again.
__device__ void merge_list(float* d, int* id, int* count, int k, int capacity, int lane) {
  const int added = min(*count, capacity);
  if (added == 0) return;
  const int n = static_cast<int>(power_of_two_at_least(static_cast<unsigned>(k + added)));
  warp_sort(d, id, n, lane);
  for (int t = k + lane; t < n; t += 32) {
    d[t] = __int_as_float(0x7fc00000);
    id[t] = -1;
  }
  __syncwarp();
  if (lane == 0) *count = 0;
  __syncwarp();
}

template <Element kElement, int kGroups, int kChunks>
__global__ void __launch_bounds__(kThreads, 1) few_queries_kernel(KernelArgs a) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int kPadded = kGroups * 8;
  constexpr int kStride = query_stride(kChunks);
  unsigned char* queries = shared;
  float* q_norms = reinterpret_cast<float*>(shared + kPadded * kStride);
  float* q_scales = q_norms + kPadded;
  float* list_d = q_scales + kPadded;
  int* list_i = reinterpret_cast<int*>(list_d + a.queries * a.slots);
  int* counts = list_i + a.queries * a.slots;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int capacity = a.slots - a.k;

  // The queries as shared-memory rows of whole chunks, zeros past their rows and past Q.
  for (int p = threadIdx.x; p < kPadded * kChunks * 4; p += kThreads) {
    const int row = p / (kChunks * 4), offset = p % (kChunks * 4) * 16;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < a.queries && offset < a.row_bytes)
      v = *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(a.q) +
                                          static_cast<std::size_t>(row) * a.row_bytes + offset);
    *reinterpret_cast<uint4*>(queries + row * kStride + offset) = v;
  }
  for (int t = threadIdx.x; t < a.queries * a.slots; t += kThreads) {
    list_d[t] = __int_as_float(0x7fc00000);
    list_i[t] = -1;
  }
  for (int t = threadIdx.x; t < a.queries; t += kThreads) counts[t] = 0;
  __syncthreads();
  for (int q = warp; q < kPadded; q += kWarps) {  // squared norms, as row_norms sums pieces
    float sum = 0.0f;
    for (int p = lane; p < kChunks * 4; p += 32)
      sum += piece_squares<kElement>(*reinterpret_cast<const uint4*>(queries + q * kStride + p * 16));
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float scale = kElement == Element::Int8 && q < a.queries ? a.q_scales[q] : 1.0f;
    if (lane == 0) q_norms[q] = sum * scale * scale, q_scales[q] = scale;
  }
  __syncthreads();

  // Row numbers are int32 (knn's indices); the slice's bounds are summed in 64 bits.
  const long long first = static_cast<long long>(blockIdx.x) * a.slice_rows;
  const int end = static_cast<int>(min(static_cast<long long>(a.n), first + a.slice_rows));
  const auto* corpus = static_cast<const unsigned char*>(a.x);

  auto load = [&](Rows<kChunks>& r, long long round) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long at = round + warp * 16 + g + 8 * h;
      const bool live = at < end;
      const int row = static_cast<int>(live ? at : 0);
      const unsigned char* src = corpus + static_cast<std::size_t>(row) * a.row_bytes;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int offset = 64 * j + 16 * c;
        r.piece[h][j] = live && offset < a.row_bytes
                            ? __ldg(reinterpret_cast<const uint4*>(src + offset))
                            : make_uint4(0, 0, 0, 0);
      }
      r.scale[h] = kElement == Element::Int8 && live ? __ldg(a.x_scales + row) : 1.0f;
    }
  };

  Rows<kChunks> rows, next;
  load(rows, first);
  for (long long round = first; round < end; round += kRoundRows) {
    if (round + kRoundRows < end) load(next, round + kRoundRows);

    // Dot products: acc[t][v] pairs row g + 8·(v / 2) with query 8t + 2c + v % 2.
    float acc[kGroups][4];
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[t][v] = 0.0f;
      if (t * 8 >= a.queries) continue;
      if constexpr (kElement == Element::Fp32) {
        float part[2][8];
#pragma unroll
        for (int i = 0; i < 8; ++i) part[0][i] = part[1][i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kChunks; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (t * 8 + i >= a.queries) continue;
            const uint4 b = *reinterpret_cast<const uint4*>(queries + (t * 8 + i) * kStride +
                                                            64 * j + 16 * c);
            part[0][i] = dot4(rows.piece[0][j], b, part[0][i]);
            part[1][i] = dot4(rows.piece[1][j], b, part[1][i]);
          }
        // Reduce-scatter over the quad: lanes c ^ 2 keep queries 4·(c / 2) + 0..3, then lanes
        // c ^ 1 queries 2c, 2c + 1.
        const bool hi = (c & 2) != 0, odd = (c & 1) != 0;
        float half[2][4], quarter[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float send = hi ? part[h][i] : part[h][i + 4];
            const float got = __shfl_xor_sync(0xffffffffu, send, 2);
            half[h][i] = (hi ? part[h][i + 4] : part[h][i]) + got;
          }
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float send = odd ? half[h][i] : half[h][i + 2];
            const float got = __shfl_xor_sync(0xffffffffu, send, 1);
            quarter[h][i] = (odd ? half[h][i + 2] : half[h][i]) + got;
          }
        }
        acc[t][0] = quarter[0][0], acc[t][1] = quarter[0][1];
        acc[t][2] = quarter[1][0], acc[t][3] = quarter[1][1];
      } else if constexpr (kElement == Element::Int8) {
        int sum[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const uint4 b =
              *reinterpret_cast<const uint4*>(queries + (t * 8 + g) * kStride + 64 * j + 16 * c);
          const uint4 r0 = rows.piece[0][j], r1 = rows.piece[1][j];
          mma_step_s8(sum, r0.x, r1.x, r0.y, r1.y, b.x, b.y);
          mma_step_s8(sum, r0.z, r1.z, r0.w, r1.w, b.z, b.w);
        }
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[t][v] = static_cast<float>(sum[v]);
      } else {
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const uint4 b =
              *reinterpret_cast<const uint4*>(queries + (t * 8 + g) * kStride + 64 * j + 16 * c);
          const uint4 r0 = rows.piece[0][j], r1 = rows.piece[1][j];
          mma_step(kElement, acc[t], r0.x, r1.x, r0.y, r1.y, b.x, b.y);
          mma_step(kElement, acc[t], r0.z, r1.z, r0.w, r1.w, b.z, b.w);
        }
      }
    }

    // The two rows' squared norms from the same pieces (L2, cosine), summed over the quad.
    float x_norm[2] = {0.0f, 0.0f};
    if (a.metric != Metric::InnerProduct) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) sum += piece_squares<kElement>(rows.piece[h][j]);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        x_norm[h] = sum * rows.scale[h] * rows.scale[h];
      }
    }

    // Distances, and the rows of each that beat its query's k-th entry.
    const long long base = round + warp * 16 + g;
    float dist[kGroups][4];
    unsigned todo = 0;
#pragma unroll
    for (int t = 0; t < kGroups; ++t)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int q = t * 8 + 2 * c + v % 2;
        const long long row = base + 8 * (v / 2);
        dist[t][v] = 0.0f;
        if (q >= a.queries || row >= end) continue;
        float dot = acc[t][v];
        if (kElement == Element::Int8) dot *= q_scales[q] * rows.scale[v / 2];
        const bool exact = kElement == Element::Fp32 && a.exact_l2;
        dist[t][v] = finish_distance(
            dot, a.metric, q_norms[q], x_norm[v / 2],
            exact ? static_cast<const float*>(a.q) + static_cast<std::size_t>(q) * a.dim : nullptr,
            exact ? reinterpret_cast<const float*>(corpus + static_cast<std::size_t>(row) * a.row_bytes)
                  : nullptr,
            a.dim);
        todo |= 1u << (t * 4 + v);
      }
    for (;;) {
      bool full = false, sort = false;
#pragma unroll
      for (int t = 0; t < kGroups; ++t)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const unsigned bit = 1u << (t * 4 + v);
          if (!(todo & bit)) continue;
          const int q = t * 8 + 2 * c + v % 2, row = static_cast<int>(base + 8 * (v / 2));
          const float worst_d = list_d[q * a.slots + a.k - 1];
          const int worst_i = list_i[q * a.slots + a.k - 1];
          const float d = dist[t][v];
          if ((worst_i >= 0 && d > worst_d) || !better(d, row, worst_d, worst_i)) {
            todo &= ~bit;
            continue;
          }
          const int at = atomicAdd(&counts[q], 1);
          if (at >= capacity) {
            full = true;
            continue;
          }
          list_d[q * a.slots + a.k + at] = d;
          list_i[q * a.slots + a.k + at] = row;
          todo &= ~bit;
          sort |= worst_i < 0 || 2 * (at + 1) >= capacity;
        }
      if (!__syncthreads_or(full || sort)) break;
      for (int q = warp; q < a.queries; q += kWarps)
        merge_list(list_d + q * a.slots, list_i + q * a.slots, &counts[q], a.k, capacity, lane);
      if (!__syncthreads_or(todo != 0)) break;
    }
    rows = next;
  }

  for (int q = warp; q < a.queries; q += kWarps) {
    float* d = list_d + q * a.slots;
    int* id = list_i + q * a.slots;
    merge_list(d, id, &counts[q], a.k, capacity, lane);
    const std::size_t out = (static_cast<std::size_t>(q) * gridDim.x + blockIdx.x) * a.k;
    for (int t = lane; t < a.k; t += 32) {
      a.part_d[out + t] = d[t];
      a.part_i[out + t] = id[t];
    }
  }
}

using Kernel = void (*)(KernelArgs);

template <Element kElement, int kGroups>
Kernel pick_chunks(int chunks) {
  if (chunks <= 2) return few_queries_kernel<kElement, kGroups, 2>;
  if (chunks <= 4) return few_queries_kernel<kElement, kGroups, 4>;
  return few_queries_kernel<kElement, kGroups, 8>;
}

template <Element kElement>
Kernel pick_groups(int groups, int chunks) {
  if (groups <= 1) return pick_chunks<kElement, 1>(chunks);
  if (groups <= 4) return pick_chunks<kElement, 4>(chunks);
  return pick_chunks<kElement, 8>(chunks);
}

struct Launch {
  Kernel kernel;
  int groups, chunks;
  std::size_t shared;
};

Launch launch_of(const FewQueriesArgs& a) {
  const std::size_t row_bytes = a.dim * element_bytes(a.x.element);
  const int chunks = static_cast<int>((row_bytes + 63) / 64);
  const int wanted = static_cast<int>((a.q.rows + 7) / 8);
  const int groups = wanted <= 1 ? 1 : wanted <= 4 ? 4 : 8;
  const int held = chunks <= 2 ? 2 : chunks <= 4 ? 4 : 8;
  Kernel kernel = nullptr;
  switch (a.x.element) {
    case Element::Fp32: kernel = pick_groups<Element::Fp32>(groups, chunks); break;
    case Element::Fp16: kernel = pick_groups<Element::Fp16>(groups, chunks); break;
    case Element::Bf16: kernel = pick_groups<Element::Bf16>(groups, chunks); break;
    case Element::Int8: kernel = pick_groups<Element::Int8>(groups, chunks); break;
  }
  return {kernel, groups, held, shared_bytes(groups, held, a.q.rows, a.k)};
}

// Per kernel and device: its shared-memory attribute raised to the most a block may have.
struct Prepared {
  cudaError_t error = cudaSuccess;
  int multiprocessors = 0;
};

Prepared prepare(Kernel kernel) {
  // One PerDevice per instantiation would need a table of them; a map keyed by the kernel's
  // address under a lock costs one lookup a call.
  static std::mutex mutex;
  static std::map<Kernel, PerDevice<Prepared>> table;  // nodes stay where they are
  PerDevice<Prepared>* per;
  {
    std::lock_guard lock(mutex);
    per = &table.try_emplace(kernel).first->second;
  }
  return per->get([kernel] {
    Prepared p;
    int device = 0, optin = 0;
    p.error = cudaGetDevice(&device);
    if (p.error == cudaSuccess)
      p.error = cudaDeviceGetAttribute(&p.multiprocessors, cudaDevAttrMultiProcessorCount, device);
    if (p.error == cudaSuccess)
      p.error = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (p.error == cudaSuccess)
      p.error = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    return p;
  });
}

}  // namespace

std::size_t few_queries_blocks(const FewQueriesArgs& a) {
  const Launch l = launch_of(a);
  const Prepared p = prepare(l.kernel);
  int per_multiprocessor = 0;
  if (p.error != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor,
                                                    reinterpret_cast<const void*>(l.kernel),
                                                    kThreads, l.shared) != cudaSuccess ||
      per_multiprocessor == 0)
    return 0;  // the launch reports the error
  const std::size_t wave = static_cast<std::size_t>(per_multiprocessor) * p.multiprocessors;
  const std::size_t rounds = (a.x.rows + kRoundRows - 1) / kRoundRows;
  const std::size_t per_block = (rounds + wave - 1) / wave;
  return (rounds + per_block - 1) / per_block;
}

Status few_queries_knn(const FewQueriesArgs& a, std::size_t blocks, float* part_d,
                       std::int32_t* part_i, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (blocks == 0) return cuda_failure(cudaErrorInvalidConfiguration, "few-queries kNN kernel");
  const Launch l = launch_of(a);
  if (Status st = status_of(prepare(l.kernel).error, "cudaFuncSetAttribute (few-queries kNN kernel)");
      !st.ok())
    return st;
  const std::size_t rounds = (a.x.rows + kRoundRows - 1) / kRoundRows;
  const std::size_t slice = (rounds + blocks - 1) / blocks * kRoundRows;
  KernelArgs k{a.q.data, a.x.data, a.q.scales, a.x.scales,
               static_cast<int>(a.q.rows), static_cast<int>(a.x.rows), static_cast<int>(a.dim),
               static_cast<int>(a.dim * element_bytes(a.x.element)), a.metric, a.exact_l2,
               static_cast<int>(a.k), static_cast<int>(list_slots(a.k)), static_cast<int>(slice),
               part_d, part_i};
  l.kernel<<<static_cast<unsigned>(blocks), kThreads, l.shared, s>>>(k);
  if (Status st = status_of(cudaGetLastError(), "few-queries kNN kernel"); !st.ok()) return st;
  if (Status st = topk_init(a.out_d, a.out_i, a.q.rows * a.k, stream); !st.ok()) return st;
  const std::size_t lists = blocks * a.k;
  return topk_update(part_d, part_i, a.q.rows, lists, lists, 0, a.k, a.out_d, a.out_i, stream);
}

}  // namespace gpupool::cudak
