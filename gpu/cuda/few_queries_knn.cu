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
// Memory. Each warp keeps several rounds of its rows in flight in a ring of shared-memory stages
// (cp.async; launch_of sizes it): a lane copies exactly the pieces it later reads, so it waits for
// its own copies only, and the registers hold one round.
//
// Top-k. Each block scans one slice of the corpus in rounds of 128 rows (8 warps × 16) and keeps,
// per query, a list in shared memory: k sorted entries, then a buffer of appended rows that beat
// the k-th entry (distance_rules.cuh's order). After a round in which a buffer filled up, the
// lists are sorted (block_sorts.cuh, by the threads merge_lists gives each list) and the block
// goes on; a row that found its buffer full is tested again after that sort, so none is lost
// whatever the rows' order. Sorting only full buffers sorts least often: while a list is short of
// k its bound stays open and every row is appended, but a sort costs the block's threads far
// more than an append. Before that test, a row farther than its query's k-th distance (a copy of
// it per query, `quick`) loses at once: most rows, after the first rounds.
// At the end each block writes its lists (Q × blocks × k) and merge_kernel takes the k best.
#include "few_queries_knn.cuh"
#include "block_sorts.cuh"
#include "distance_rules.cuh"
#include "per_device.cuh"
#include "piece_squares.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>

namespace gpupool::cuda_kernels {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRoundRows = kWarps * 16;

Status status_of(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status{} : cuda_failure(static_cast<int>(e), what);
}

// Shared-memory rows (the queries, and the corpus rows in each stage): stride ≡ 64 (mod 128)
// bytes, so that the 8 lanes of a quarter warp (two rows, four pieces each) read 128 bytes in
// distinct banks.
__host__ __device__ constexpr int row_stride(int chunks) {
  return (chunks * 64) % 128 == 0 ? chunks * 64 + 64 : chunks * 64;
}

__host__ __device__ constexpr unsigned power_of_two_at_least(unsigned n) {
  unsigned p = 1;
  while (p < n) p *= 2;
  return p;
}

// Slots of a query's list: k sorted entries and at least 64 (or k) appended ones.
__host__ __device__ constexpr int list_slots(int k) {
  return static_cast<int>(power_of_two_at_least(static_cast<unsigned>(2 * k > k + 64 ? 2 * k : k + 64)));
}

// A warp's stage: 16 corpus rows, their int8 scales and, where the caller gave them, their norms.
__host__ __device__ constexpr int stage_bytes(int chunks, bool norms) {
  return 16 * row_stride(chunks) + 64 + (norms ? 64 : 0);
}
constexpr int kMostStages = 8;

// Where the block's shared memory lies (byte offsets, each 16-byte aligned): the queries and their
// figures, the per-query lists, then each warp's ring of `stages` stages of corpus rows.
struct Layout {
  int queries, q_norms, q_scales, quick, list_d, list_i, counts, stages, bytes;
  __host__ __device__ Layout(int groups, int chunks, int nq, int k, int ring, bool norms) {
    auto up = [](int b) { return (b + 15) / 16 * 16; };
    const int padded = groups * 8, slots = list_slots(k);
    queries = 0;
    q_norms = up(queries + padded * row_stride(chunks));
    q_scales = up(q_norms + padded * 4);
    quick = up(q_scales + padded * 4);
    list_d = up(quick + nq * 4);
    list_i = up(list_d + nq * slots * 4);
    counts = up(list_i + nq * slots * 4);
    stages = up(counts + nq * 4);
    bytes = stages + kWarps * ring * stage_bytes(chunks, norms);
  }
};

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

// Asynchronous copies into shared memory (zeros where `live` is false: nothing is read then).
__device__ __forceinline__ void copy_16(void* to, const void* from, bool live) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(from),
               "r"(live ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy_4(void* to, const void* from, bool live) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(at), "l"(from),
               "r"(live ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Until at most `pending` groups of this thread's copies are still in flight (an immediate).
__device__ __forceinline__ void wait_copies(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
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
  const float* x_norms;  // the corpus rows' squared norms (L2, cosine) where the caller gave them
  int queries;
  int n;
  int dim;
  int row_bytes;
  Metric metric;
  bool exact_l2;
  int k;
  int slice_rows;
  int ring;  // stages a warp
  float* part_d;
  std::int32_t* part_i;
};

// The appended entries of a query's list sorted in by the threads of `group`, the list's tail
// emptied again, and its quick bound: the k-th distance, or +inf while that entry is empty or NaN
// (no row is rejected by it).
template <class Group>
__device__ void merge_list(Group group, float* d, int* id, int* count, float* quick, int k,
                           int capacity) {
  const int added = min(*count, capacity);
  if (added == 0) return;
  const int n = static_cast<int>(power_of_two_at_least(static_cast<unsigned>(k + added)));
  bitonic_sort(group, d, id, nullptr, n);
  for (int t = k + group.first(); t < n; t += group.step()) {
    d[t] = __int_as_float(0x7fc00000);
    id[t] = -1;
  }
  group.sync();
  if (group.first() == 0) {
    *count = 0;
    *quick = id[k - 1] >= 0 && !isnan(d[k - 1]) ? d[k - 1] : INFINITY;
  }
  group.sync();
}

// Every query's list merged (merge_list), by all the block's threads, so that few warps do not
// sort while the rest wait at the next barrier (docs/benchmarks.md, "few queries"): the whole
// block for one query, kWarps / Q warps a list for 2-4 queries (each group on its own named
// barrier, then the block's barrier: a list's next reader may be a warp of another group), and
// one warp a list for more.
__device__ void merge_lists(float* list_d, int* list_i, int* counts, float* quick, int queries,
                            int slots, int k, int capacity) {
  if (queries == 1) {
    merge_list(BlockSorts{}, list_d, list_i, counts, quick, k, capacity);
    return;
  }
  const int warp = threadIdx.x / 32;
  if (queries <= 4) {
    const int warps = kWarps / queries, q = warp / warps;
    if (q < queries)
      merge_list(GroupSorts{static_cast<int>(threadIdx.x) - q * warps * 32, warps * 32, 1 + q},
                 list_d + q * slots, list_i + q * slots, &counts[q], &quick[q], k, capacity);
    __syncthreads();
    return;
  }
  for (int q = warp; q < queries; q += kWarps)
    merge_list(WarpSorts{static_cast<int>(threadIdx.x % 32)}, list_d + q * slots,
               list_i + q * slots, &counts[q], &quick[q], k, capacity);
}

// kGivenNorms: the stages carry the caller's corpus norms (a.x_norms) and the rows' own are not
// summed; a template parameter, so that the kernels without them keep their registers.
template <Element kElement, int kGroups, int kChunks, bool kGivenNorms>
__global__ void __launch_bounds__(kThreads, 1) few_queries_kernel(KernelArgs a) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int kPadded = kGroups * 8;
  constexpr int kStride = row_stride(kChunks);
  constexpr int stage_size = stage_bytes(kChunks, kGivenNorms);
  const Layout layout(kGroups, kChunks, a.queries, a.k, a.ring, kGivenNorms);
  const int slots = list_slots(a.k);
  unsigned char* queries = shared + layout.queries;
  float* q_norms = reinterpret_cast<float*>(shared + layout.q_norms);
  float* q_scales = reinterpret_cast<float*>(shared + layout.q_scales);
  float* quick = reinterpret_cast<float*>(shared + layout.quick);
  float* list_d = reinterpret_cast<float*>(shared + layout.list_d);
  int* list_i = reinterpret_cast<int*>(shared + layout.list_i);
  int* counts = reinterpret_cast<int*>(shared + layout.counts);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int capacity = slots - a.k;
  unsigned char* ring = shared + layout.stages + warp * a.ring * stage_size;

  // Row numbers are int32 (knn's indices); the slice's bounds are summed in 64 bits.
  const long long first = static_cast<long long>(blockIdx.x) * a.slice_rows;
  const int end = static_cast<int>(min(static_cast<long long>(a.n), first + a.slice_rows));
  const auto* corpus = static_cast<const unsigned char*>(a.x);

  // Round `round`'s rows of this warp into a stage: lane (g, c) copies the pieces it reads.
  auto fetch = [&](int stage, long long round) {
    unsigned char* to = ring + stage * stage_size;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long at = round + warp * 16 + g + 8 * h;
      const bool live = at < end;
      const int row = live ? static_cast<int>(at) : 0;
      const unsigned char* from = corpus + static_cast<std::size_t>(row) * a.row_bytes;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int offset = 64 * j + 16 * c;
        copy_16(to + (g + 8 * h) * kStride + offset, from + offset, live && offset < a.row_bytes);
      }
      if (kElement == Element::Int8 && c == 0)
        copy_4(to + 16 * kStride + (g + 8 * h) * 4, a.x_scales + row, live);
      if (kGivenNorms && c == 1)
        copy_4(to + 16 * kStride + 64 + (g + 8 * h) * 4, a.x_norms + row, live);
    }
    commit_copies();
  };
  // The first stages' copies go out before the block sets itself up.
  for (int s = 0; s < a.ring; ++s) fetch(s, first + static_cast<long long>(s) * kRoundRows);

  // The queries as shared-memory rows of whole chunks, zeros past their rows and past Q.
  for (int p = threadIdx.x; p < kPadded * kChunks * 4; p += kThreads) {
    const int row = p / (kChunks * 4), offset = p % (kChunks * 4) * 16;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < a.queries && offset < a.row_bytes)
      v = *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(a.q) +
                                          static_cast<std::size_t>(row) * a.row_bytes + offset);
    *reinterpret_cast<uint4*>(queries + row * kStride + offset) = v;
  }
  for (int t = threadIdx.x; t < a.queries * slots; t += kThreads) {
    list_d[t] = __int_as_float(0x7fc00000);
    list_i[t] = -1;
  }
  for (int t = threadIdx.x; t < a.queries; t += kThreads) counts[t] = 0, quick[t] = INFINITY;
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

  int stage = 0;
  for (long long round = first; round < end; round += kRoundRows) {
    wait_copies(a.ring - 1);  // this round's stage (the oldest group) has landed
    // Lanes c = 0 and 1 of each quad copy its rows' int8 scales and given norms, which all four
    // lanes read.
    if constexpr (kElement == Element::Int8 || kGivenNorms) __syncwarp();
    Rows<kChunks> rows;
    {
      const unsigned char* from = ring + stage * stage_size;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < kChunks; ++j)
          rows.piece[h][j] =
              *reinterpret_cast<const uint4*>(from + (g + 8 * h) * kStride + 64 * j + 16 * c);
        rows.scale[h] = kElement == Element::Int8
                            ? *reinterpret_cast<const float*>(from + 16 * kStride + (g + 8 * h) * 4)
                            : 1.0f;
      }
    }

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

    // The two rows' squared norms (L2, cosine): given, or from the same pieces, summed over the
    // quad.
    float x_norm[2] = {0.0f, 0.0f};
    if constexpr (kGivenNorms) {
      const unsigned char* from = ring + stage * stage_size + 16 * kStride + 64;
      x_norm[0] = *reinterpret_cast<const float*>(from + g * 4);
      x_norm[1] = *reinterpret_cast<const float*>(from + (g + 8) * 4);
    } else if (a.metric != Metric::InnerProduct) {
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

    // Distances; a row farther than its query's quick bound (the list's k-th distance) loses at
    // once, the rest take the full test against the k-th entry below.
    const long long base = round + warp * 16 + g;
    float dist[kGroups][4];
    unsigned unplaced = 0;  // a bit per (group, value): a candidate still to place in its list
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      if (t * 8 >= a.queries) continue;
      const float bound[2] = {quick[min(t * 8 + 2 * c, a.queries - 1)],
                              quick[min(t * 8 + 2 * c + 1, a.queries - 1)]};
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
        if (!(dist[t][v] > bound[v % 2])) unplaced |= 1u << (t * 4 + v);
      }
    }
    // The stage's rows are used up (the quad's reads of the scales and norms before lanes 0 and
    // 1 copy the next ones): its next round's copies go out.
    if constexpr (kElement == Element::Int8 || kGivenNorms) __syncwarp();
    fetch(stage, round + static_cast<long long>(a.ring) * kRoundRows);
    stage = stage + 1 == a.ring ? 0 : stage + 1;
    for (;;) {
      bool full = false, sort = false;
#pragma unroll
      for (int t = 0; t < kGroups; ++t)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const unsigned bit = 1u << (t * 4 + v);
          if (!(unplaced & bit)) continue;
          const int q = t * 8 + 2 * c + v % 2, row = static_cast<int>(base + 8 * (v / 2));
          const float worst_d = list_d[q * slots + a.k - 1];
          const int worst_i = list_i[q * slots + a.k - 1];
          const float d = dist[t][v];
          if ((worst_i >= 0 && d > worst_d) || !better(d, row, worst_d, worst_i)) {
            unplaced &= ~bit;
            continue;
          }
          const int at = atomicAdd(&counts[q], 1);
          if (at >= capacity) {
            full = true;
            continue;
          }
          list_d[q * slots + a.k + at] = d;
          list_i[q * slots + a.k + at] = row;
          unplaced &= ~bit;
          sort |= at + 1 == capacity;
        }
      if (!__syncthreads_or(full || sort)) break;
      merge_lists(list_d, list_i, counts, quick, a.queries, slots, a.k, capacity);
      if (!__syncthreads_or(unplaced != 0)) break;
    }
  }
  wait_copies(0);  // the zero-filled copies past the slice

  merge_lists(list_d, list_i, counts, quick, a.queries, slots, a.k, capacity);
  for (int q = warp; q < a.queries; q += kWarps) {
    const float* d = list_d + q * slots;
    const int* id = list_i + q * slots;
    const std::size_t out = (static_cast<std::size_t>(q) * gridDim.x + blockIdx.x) * a.k;
    for (int t = lane; t < a.k; t += 32) {
      a.part_d[out + t] = d[t];
      a.part_i[out + t] = id[t];
    }
  }
}

// The blocks' sorted lists of one query (block per query) into its k nearest. The k-th best of
// the lists' first entries, tau, is at least as good as the k-th overall (those k entries are
// distinct rows), so only entries at or before tau can be among the k, and they lie in the k
// lists whose first entry is: at most k · k of them, which one sort orders. (With fewer lists
// than k, every entry of every list.)
constexpr int kMergeThreads = 512;

__host__ __device__ int merge_heads(int blocks) {
  return static_cast<int>(power_of_two_at_least(static_cast<unsigned>(blocks)));
}
__host__ __device__ int merge_slots(int k) {
  return static_cast<int>(power_of_two_at_least(static_cast<unsigned>(k * k)));
}
std::size_t merge_shared(std::size_t blocks, std::size_t k) {
  return static_cast<std::size_t>(merge_heads(static_cast<int>(blocks))) * 12 +
         static_cast<std::size_t>(merge_slots(static_cast<int>(k))) * 8 + 16;
}

__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const float* part_d,
                                                              const std::int32_t* part_i,
                                                              int blocks, int k, float* out_d,
                                                              std::int32_t* out_i) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int heads = merge_heads(blocks);
  float* head_d = reinterpret_cast<float*>(shared);
  int* head_i = reinterpret_cast<int*>(head_d + heads);
  int* head_list = head_i + heads;
  float* buf_d = reinterpret_cast<float*>(head_list + heads);
  int* buf_i = reinterpret_cast<int*>(buf_d + merge_slots(k));
  int* count = buf_i + merge_slots(k);
  const std::size_t q = blockIdx.x;
  const float* lists_d = part_d + q * blocks * k;
  const std::int32_t* lists_i = part_i + q * blocks * k;
  for (int b = threadIdx.x; b < heads; b += blockDim.x) {
    head_d[b] = b < blocks ? lists_d[static_cast<std::size_t>(b) * k] : __int_as_float(0x7fc00000);
    head_i[b] = b < blocks ? lists_i[static_cast<std::size_t>(b) * k] : -1;
    head_list[b] = b;
  }
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  block_sort(head_d, head_i, head_list, heads);
  const int lists = min(k, blocks);
  const float tau_d = blocks >= k ? head_d[k - 1] : __int_as_float(0x7fc00000);
  const int tau_i = blocks >= k ? head_i[k - 1] : -1;
  // The candidates' loads go out kGathered at a time before any is tested, so that a thread's
  // (20 at k = 100) do not each wait out a round trip in turn.
  constexpr int kGathered = 8;
  const int candidates = lists * k;
  for (int first = 0; first < candidates; first += kGathered * kMergeThreads) {
    float d[kGathered];
    int id[kGathered];
#pragma unroll
    for (int j = 0; j < kGathered; ++j) {
      const int u = first + j * kMergeThreads + static_cast<int>(threadIdx.x);
      const std::size_t at =
          u < candidates ? static_cast<std::size_t>(head_list[u / k]) * k + u % k : 0;
      d[j] = u < candidates ? lists_d[at] : 0.0f;
      id[j] = u < candidates ? lists_i[at] : -1;
    }
#pragma unroll
    for (int j = 0; j < kGathered; ++j) {
      const int u = first + j * kMergeThreads + static_cast<int>(threadIdx.x);
      if (u >= candidates || better(tau_d, tau_i, d[j], id[j])) continue;
      const int slot = atomicAdd(count, 1);
      buf_d[slot] = d[j];
      buf_i[slot] = id[j];
    }
  }
  __syncthreads();
  const int kept = *count;
  const int n = static_cast<int>(power_of_two_at_least(static_cast<unsigned>(kept)));
  for (int t = kept + threadIdx.x; t < n; t += blockDim.x) {
    buf_d[t] = __int_as_float(0x7fc00000);
    buf_i[t] = -1;
  }
  __syncthreads();
  block_sort(buf_d, buf_i, nullptr, n);
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    out_d[q * k + t] = t < kept ? buf_d[t] : __int_as_float(0x7fc00000);
    out_i[q * k + t] = t < kept ? buf_i[t] : -1;
  }
}

using Kernel = void (*)(KernelArgs);

template <Element kElement, int kGroups, bool kGivenNorms>
Kernel pick_chunks(int chunks) {
  if (chunks <= 2) return few_queries_kernel<kElement, kGroups, 2, kGivenNorms>;
  if (chunks <= 4) return few_queries_kernel<kElement, kGroups, 4, kGivenNorms>;
  return few_queries_kernel<kElement, kGroups, 8, kGivenNorms>;
}

template <Element kElement, bool kGivenNorms>
Kernel pick_groups(int groups, int chunks) {
  if (groups <= 1) return pick_chunks<kElement, 1, kGivenNorms>(chunks);
  return pick_chunks<kElement, 8, kGivenNorms>(chunks);
}

template <Element kElement>
Kernel pick_kernel(int groups, int chunks, bool given_norms) {
  if constexpr (kElement == Element::Fp16 || kElement == Element::Bf16)
    if (given_norms) return pick_groups<kElement, true>(groups, chunks);
  return pick_groups<kElement, false>(groups, chunks);
}

struct Launch {
  Kernel kernel;
  int ring;                // stages a warp
  int per_multiprocessor;  // blocks
  int multiprocessors;
  std::size_t shared;
  cudaError_t error;
};

// Per kernel and device: its shared-memory attribute raised to the most a block may have, and
// the figures its launches are sized from.
struct Prepared {
  cudaError_t error = cudaSuccess;
  int multiprocessors = 0, optin = 0, per_multiprocessor = 0, reserved = 0;
  int by_registers = 0;  // blocks a multiprocessor holds by their registers and threads
};

Prepared prepare(const void* kernel) {
  static std::mutex mutex;
  static std::map<const void*, PerDevice<Prepared>> table;  // nodes stay where they are
  PerDevice<Prepared>* per;
  {
    std::lock_guard lock(mutex);
    per = &table.try_emplace(kernel).first->second;
  }
  return per->get([kernel] {
    Prepared p;
    int device = 0;
    auto step = [&p](cudaError_t e) {
      if (p.error == cudaSuccess) p.error = e;
    };
    step(cudaGetDevice(&device));
    step(cudaDeviceGetAttribute(&p.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    step(cudaDeviceGetAttribute(&p.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    step(cudaDeviceGetAttribute(&p.per_multiprocessor,
                                cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    step(cudaDeviceGetAttribute(&p.reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
    step(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.optin));
    // All of the unified memory as shared memory: the copies bypass L1 (cp.async.cg), and the
    // blocks a multiprocessor holds are sized by their stages.
    step(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared));
    step(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&p.by_registers, kernel, kThreads, 0));
    return p;
  });
}

// The kernel for these arguments, how many of its blocks share a multiprocessor and how many
// stages each warp keeps: the most blocks their registers allow that still leave every warp two
// stages beside the lists (then as many stages as fit, up to kMostStages). More blocks hide the
// rounds' barriers and epilogues behind one another: at (1, 2^20, 128) on an H200 a call with
// two blocks of two stages took 0.136 ms in fp16, with one block of five 0.166 (docs/benchmarks.md,
// the rules table). Ring 0: two stages do not fit even one block (the caller takes another path).
// Whether the kernel reads the caller's corpus norms: where the metric needs norms, they were
// given, and the rows are fp16 / bf16. Int8 and fp32 rows sum their squares beside the products
// for nothing the stages' norms would save (H200: 1 to 32 queries as fast or up to 4% slower
// with them, docs/benchmarks.md).
bool reads_given_norms(const FewQueriesArgs& a) {
  return a.x.norms != nullptr && a.metric != Metric::InnerProduct &&
         (a.x.element == Element::Fp16 || a.x.element == Element::Bf16);
}

Launch launch_of(const FewQueriesArgs& a) {
  const std::size_t row_bytes = a.dim * element_bytes(a.x.element);
  const int chunks = static_cast<int>((row_bytes + 63) / 64);
  const int groups = a.q.rows <= 8 ? 1 : 8;
  const int held = chunks <= 2 ? 2 : chunks <= 4 ? 4 : 8;
  const bool norms = reads_given_norms(a);
  Kernel kernel = nullptr;
  switch (a.x.element) {
    case Element::Fp32: kernel = pick_kernel<Element::Fp32>(groups, chunks, norms); break;
    case Element::Fp16: kernel = pick_kernel<Element::Fp16>(groups, chunks, norms); break;
    case Element::Bf16: kernel = pick_kernel<Element::Bf16>(groups, chunks, norms); break;
    case Element::Int8: kernel = pick_kernel<Element::Int8>(groups, chunks, norms); break;
  }
  const Prepared p = prepare(reinterpret_cast<const void*>(kernel));
  Launch l{kernel, 0, 0, p.multiprocessors, 0, p.error};
  if (p.error != cudaSuccess) return l;
  const int nq = static_cast<int>(a.q.rows), k = static_cast<int>(a.k);
  const int fixed = Layout(groups, held, nq, k, 0, norms).bytes;
  for (int blocks = std::max(p.by_registers, 1); blocks >= 1; --blocks) {
    const int room = std::min(p.optin, p.per_multiprocessor / blocks - p.reserved);
    const int ring =
        room > fixed ? std::min((room - fixed) / (kWarps * stage_bytes(held, norms)), kMostStages)
                     : 0;
    if (ring < 2) continue;
    l.ring = ring;
    l.per_multiprocessor = blocks;
    l.shared = static_cast<std::size_t>(Layout(groups, held, nq, k, ring, norms).bytes);
    break;
  }
  return l;
}

}  // namespace

std::size_t few_queries_blocks(const FewQueriesArgs& a) {
  const Launch l = launch_of(a);
  const Prepared m = prepare(reinterpret_cast<const void*>(merge_kernel));
  if (l.error != cudaSuccess || l.ring == 0 || m.error != cudaSuccess) return 0;
  const std::size_t wave = static_cast<std::size_t>(l.per_multiprocessor) * l.multiprocessors;
  const std::size_t rounds = (a.x.rows + kRoundRows - 1) / kRoundRows;
  const std::size_t per_block = (rounds + wave - 1) / wave;
  const std::size_t blocks = (rounds + per_block - 1) / per_block;
  return merge_shared(blocks, a.k) <= static_cast<std::size_t>(m.optin) ? blocks : 0;
}

Status few_queries_knn(const FewQueriesArgs& a, std::size_t blocks, float* part_d,
                       std::int32_t* part_i, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const Launch l = launch_of(a);
  if (Status st = status_of(l.error, "cudaFuncSetAttribute (few-queries kNN kernel)"); !st.ok())
    return st;
  if (blocks == 0 || l.ring == 0)
    return cuda_failure(cudaErrorInvalidConfiguration, "few-queries kNN kernel");
  const std::size_t rounds = (a.x.rows + kRoundRows - 1) / kRoundRows;
  const std::size_t slice = (rounds + blocks - 1) / blocks * kRoundRows;
  KernelArgs k{a.q.data, a.x.data, a.q.scales, a.x.scales,
               reads_given_norms(a) ? a.x.norms : nullptr,
               static_cast<int>(a.q.rows), static_cast<int>(a.x.rows), static_cast<int>(a.dim),
               static_cast<int>(a.dim * element_bytes(a.x.element)), a.metric, a.exact_l2,
               static_cast<int>(a.k), static_cast<int>(slice), l.ring, part_d, part_i};
  l.kernel<<<static_cast<unsigned>(blocks), kThreads, l.shared, s>>>(k);
  if (Status st = status_of(cudaGetLastError(), "few-queries kNN kernel"); !st.ok()) return st;
  merge_kernel<<<static_cast<unsigned>(a.q.rows), kMergeThreads, merge_shared(blocks, a.k), s>>>(
      part_d, part_i, static_cast<int>(blocks), static_cast<int>(a.k), a.out_d, a.out_i);
  return status_of(cudaGetLastError(), "few-queries kNN merge kernel");
}

}  // namespace gpupool::cuda_kernels
