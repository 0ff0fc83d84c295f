// Internal: Hopper's warpgroup MMA (wgmma, sm_90a) for the resident-query kernels
// (gpu/cuda/resident_tiles.cuh) and the streamed tiles (gpu/cuda/streamed_tiles.cuh, whose
// m64n256 form takes 256 rows). A warpgroup (4 consecutive warps, 128 threads) multiplies 64
// queries by 128 corpus rows, both read by the tensor cores straight from shared memory through
// matrix descriptors, into 64 fp32 (int8: int32) accumulators a thread; the instruction is
// asynchronous, so the warps go on while it runs. Only device code: include it from .cu files.
//
// Operands are K-major (a row's values contiguous, as the rows are in memory) in the 128-byte
// swizzle: each row holds 128 bytes of a chunk of its values, rows 128 bytes apart, and 16-byte
// piece p of row r lies at piece p ^ (r % 8) (swizzled_offset). One k-step reads 32 bytes of every
// row: 16 fp16 / bf16 values, 8 tf32 or 32 int8, so a chunk is four k-steps for every type.
//
// wgmma exists only on sm_90a. The PTX fallback build (compute_90) compiles these functions to a
// trap; resident_tiles_available() keeps the host from launching them anywhere but compute
// capability 9.0, where the sm_90a code runs.
#pragma once

#include <cstdint>

namespace gpupool::cuda_kernels::wgmma {

inline constexpr int kChunkBytes = 128;  // one swizzle row: the 128-byte mode's atom width
inline constexpr int kStepBytes = 32;    // bytes of each row one k-step reads
inline constexpr int kStepsPerChunk = kChunkBytes / kStepBytes;
inline constexpr int kAccumulators = 64;  // m64n128: 64 × 128 products over 128 threads

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GPUPOOL_WGMMA_AVAILABLE 1
#else
#define GPUPOOL_WGMMA_AVAILABLE 0
#endif

// Byte offset of 16-byte piece `piece` of row `row` in a 128-byte-swizzled chunk (the tile's base
// 1024-byte aligned: the hardware takes the row from address bits 7-9).
__device__ __forceinline__ int swizzled_offset(int row, int piece) {
  return row * kChunkBytes + ((piece ^ (row % 8)) << 4);
}

// The matrix descriptor of a K-major, 128-byte-swizzled operand starting at `shared` (a shared
// memory address): 8-row groups 1024 bytes apart (the stride field); the leading-byte field is
// unused in this mode (1 by convention); mode 1 in bits 62-63 = 128-byte swizzle. Only the low
// word depends on the address (Descriptor), so a k-step's descriptor is one 32-bit add away from
// the tile's: its address field cannot carry out while the operand lies in shared memory (below
// 256 KB). Built afresh, or added to as 64 bits, each k-step's pair of descriptors took 12-18
// instructions (SASS of the kNN filter: a third of its instructions a tile).
struct Descriptor {
  std::uint32_t low;
  __device__ explicit Descriptor(std::uint32_t shared)
      : low(((shared & 0x3ffffu) >> 4) | ((16u >> 4) << 16)) {}
  __device__ Descriptor(std::uint32_t low_word, int) : low(low_word) {}
  // The descriptor of the operand `bytes` (a multiple of 16) further on.
  __device__ Descriptor advance(std::uint32_t bytes) const { return {low + (bytes >> 4), 0}; }
  __device__ std::uint64_t value() const {
    constexpr std::uint32_t kHigh = (1024u >> 4) | (1u << 30);  // stride; 128-byte swizzle
    return (std::uint64_t{kHigh} << 32) | low;
  }
};

__device__ __forceinline__ void fence() {
#if GPUPOOL_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if GPUPOOL_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most `Pending` committed groups of this warpgroup's MMAs are still running.
template <int Pending>
__device__ __forceinline__ void wait() {
#if GPUPOOL_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}
// Shared memory written through the generic proxy (cp.async, plain stores) is read by wgmma
// through the async proxy: each writing thread fences before the barrier that publishes it.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// The accumulators are written behind the compiler's back until the wait<>() that covers their
// MMAs: this ties each to the point after that wait, so that no read of one is moved above it.
__device__ __forceinline__ void settle(float (&d)[kAccumulators]) {
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void settle(int (&d)[kAccumulators]) {
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

#define GPUPOOL_D4(c, i) "+" c(d[i]), "+" c(d[i + 1]), "+" c(d[i + 2]), "+" c(d[i + 3])
#define GPUPOOL_D16(c, i) \
  GPUPOOL_D4(c, i), GPUPOOL_D4(c, i + 4), GPUPOOL_D4(c, i + 8), GPUPOOL_D4(c, i + 12)
#define GPUPOOL_D64(c) \
  GPUPOOL_D16(c, 0), GPUPOOL_D16(c, 16), GPUPOOL_D16(c, 32), GPUPOOL_D16(c, 48)
#define GPUPOOL_REGS64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// d (+)= A · Bᵀ for one k-step; accumulate = false starts the sums afresh (the scale-d predicate).
#if GPUPOOL_WGMMA_AVAILABLE
#define GPUPOOL_WGMMA(shape_types, tail, c)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
               "wgmma.mma_async.sync.aligned." shape_types " " GPUPOOL_REGS64                  \
               ", %64, %65, p" tail ";\n}\n"                                                   \
               : GPUPOOL_D64(c)                                                                \
               : "l"(a), "l"(b), "r"(int(accumulate)))
#else
#define GPUPOOL_WGMMA(shape_types, tail, c) asm volatile("trap;\n")
#endif

// The 256-row form (m64n256, streamed_tiles.cuh): 128 accumulators a thread, as two halves of
// the 128-row layout (lo: rows 0-127, hi: rows 128-255), so that an epilogue written for one
// 64 × 128 product takes each half as it is.
#define GPUPOOL_W4(c, d, i) "+" c(d[i]), "+" c(d[i + 1]), "+" c(d[i + 2]), "+" c(d[i + 3])
#define GPUPOOL_W16(c, d, i) \
  GPUPOOL_W4(c, d, i), GPUPOOL_W4(c, d, i + 4), GPUPOOL_W4(c, d, i + 8), GPUPOOL_W4(c, d, i + 12)
#define GPUPOOL_W64(c, d) \
  GPUPOOL_W16(c, d, 0), GPUPOOL_W16(c, d, 16), GPUPOOL_W16(c, d, 32), GPUPOOL_W16(c, d, 48)
#define GPUPOOL_REGS128 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#if GPUPOOL_WGMMA_AVAILABLE
#define GPUPOOL_WGMMA_WIDE(shape_types, tail, c)                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned." shape_types " " GPUPOOL_REGS128                 \
               ", %128, %129, p" tail ";\n}\n"                                                 \
               : GPUPOOL_W64(c, lo), GPUPOOL_W64(c, hi)                                        \
               : "l"(a), "l"(b), "r"(int(accumulate)))
#else
#define GPUPOOL_WGMMA_WIDE(shape_types, tail, c) asm volatile("trap;\n")
#endif

// The element types, each with its instruction. kScaled: the rows carry a scale each that the
// sums are multiplied by (int8; fp32 rows as scaled fp16 copies), as in tile_product.cuh.
struct Fp16 {
  using Accumulator = float;
  static constexpr int kElementBytes = 2;
  static constexpr bool kScaled = false;
  __device__ static void run(float (&d)[kAccumulators], std::uint64_t a, std::uint64_t b,
                             bool accumulate) {
    GPUPOOL_WGMMA("m64n128k16.f32.f16.f16", ", 1, 1, 0, 0", "f");
  }
  __device__ static void run_wide(float (&lo)[kAccumulators], float (&hi)[kAccumulators],
                                  std::uint64_t a, std::uint64_t b, bool accumulate) {
    GPUPOOL_WGMMA_WIDE("m64n256k16.f32.f16.f16", ", 1, 1, 0, 0", "f");
  }
};
struct ScaledFp16 : Fp16 {
  static constexpr bool kScaled = true;
};
// fp32 rows as scaled fp16 halves (split_to_fp16 in kernels.cuh): a row's chunks [0, h) hold its
// hi values, [h, 2h) its lo (the rest, rounded to fp16 again); the stream pairs the chunks so that
// a tile's sums are q_lo·x_hi + q_hi·x_lo + q_hi·x_hi (resident_tiles.cuh's multiply_halves):
// 22 of fp32's 24 bits a value and lo·lo left out (2^-22 of a product), as 3×TF32 keeps them, at
// fp16's MMA rate.
struct Fp16Halves : ScaledFp16 {};
struct Bf16 {
  using Accumulator = float;
  static constexpr int kElementBytes = 2;
  static constexpr bool kScaled = false;
  __device__ static void run(float (&d)[kAccumulators], std::uint64_t a, std::uint64_t b,
                             bool accumulate) {
    GPUPOOL_WGMMA("m64n128k16.f32.bf16.bf16", ", 1, 1, 0, 0", "f");
  }
  __device__ static void run_wide(float (&lo)[kAccumulators], float (&hi)[kAccumulators],
                                  std::uint64_t a, std::uint64_t b, bool accumulate) {
    GPUPOOL_WGMMA_WIDE("m64n256k16.f32.bf16.bf16", ", 1, 1, 0, 0", "f");
  }
};
// fp32 rows as they are: the TF32 MMA reads the top 19 bits of each.
struct Tf32 {
  using Accumulator = float;
  static constexpr int kElementBytes = 4;
  static constexpr bool kScaled = false;
  __device__ static void run(float (&d)[kAccumulators], std::uint64_t a, std::uint64_t b,
                             bool accumulate) {
    GPUPOOL_WGMMA("m64n128k8.f32.tf32.tf32", ", 1, 1", "f");
  }
};
// Exact int32 sums (|q · x| <= 127² · dim < 2^31 for the dims these kernels take).
struct Int8 {
  using Accumulator = int;
  static constexpr int kElementBytes = 1;
  static constexpr bool kScaled = true;
  __device__ static void run(int (&d)[kAccumulators], std::uint64_t a, std::uint64_t b,
                             bool accumulate) {
    GPUPOOL_WGMMA("m64n128k32.s32.s8.s8", "", "r");
  }
  __device__ static void run_wide(int (&lo)[kAccumulators], int (&hi)[kAccumulators],
                                  std::uint64_t a, std::uint64_t b, bool accumulate) {
    GPUPOOL_WGMMA_WIDE("m64n256k32.s32.s8.s8", "", "r");
  }
};
#undef GPUPOOL_WGMMA
#undef GPUPOOL_WGMMA_WIDE
#undef GPUPOOL_REGS128
#undef GPUPOOL_W64
#undef GPUPOOL_W16
#undef GPUPOOL_W4
#undef GPUPOOL_REGS64
#undef GPUPOOL_D64
#undef GPUPOOL_D16
#undef GPUPOOL_D4

// Where accumulator i of this thread lies in the warpgroup's 64 × 128 product: query row
// 16 · warp + lane / 4 (+ 8 for the odd pairs) and corpus row 8 · (i / 4) + 2 · (lane % 4) + i % 2.
// So a thread holds two queries and, of each 8-row group, two adjacent corpus rows.
__device__ __forceinline__ int accumulator_query(int i) {
  int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  return 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
}
__device__ __forceinline__ int accumulator_row(int i) {
  return 8 * (i / 4) + 2 * (threadIdx.x % 4) + i % 2;
}

}  // namespace gpupool::cuda_kernels::wgmma
