// gpupool:kernels — distance, k-nearest-neighbour and batch kernels on pooled buffers.
//
// Every function validates its arguments first (InvalidInput names the argument, its value and
// what was expected), then runs ordered on a stream of the buffers (see each function) on the
// buffers' device: cuBLAS + CUDA kernels on a CUDA device, multi-threaded CPU kernels on a
// simulated one. Results are ready when that stream is synchronized (ManagedBuffer::download /
// to_host do that). Inputs on another stream of the same device are waited for with an event.
// Input buffers must stay alive until the work has run (with the default, immediate streams of a
// simulated device it has run when the call returns). docs/kernels.md has the numerics.
//
// Layout: row-major matrices of `dim` elements per vector; the row count is the buffer's element
// count / dim (it must divide). Indices are int32 stored in Precision::Bytes buffers (4 bytes
// each, native byte order): read them with indices_to_host().
module;
#include <cstddef>
#include <cstdint>
#include <expected>
#include <span>
#include <string_view>
#include <vector>
export module gpupool:kernels;
import :error;
import :precision;
import :device;
import :buffer;
import :pool;

export namespace gpupool {

// L2: squared Euclidean distance, clamped at 0.
// InnerProduct: the NEGATED dot product −q·x, so that smaller is closer for every metric (knn
//   takes the k smallest); may be negative, never clamped.
// Cosine: 1 − q·x / (‖q‖‖x‖), clamped to [0, 2]; 1 when either vector is all zeros.
enum class Metric : std::uint8_t { L2, InnerProduct, Cosine };

// For fp32 inputs: Fp32Accurate gives fp32's accuracy (CUDA reaches it with fp32 FMA, 3×TF32 or
// fp16 halves on the tensor cores, whichever is faster for the shape; docs/kernels.md,
// "Accuracy"); Tf32 allows tensor-core TF32 (10-bit mantissa inputs, fp32 accumulation) on CUDA —
// a permission, not a demand: the simulated device computes it as Fp32Accurate.
// Ignored for fp16 / bf16 / int8 inputs (always fp32 accumulation).
enum class ComputeMode : std::uint8_t { Fp32Accurate, Tf32 };

constexpr std::string_view to_string(Metric m) noexcept {
  switch (m) {
    case Metric::L2: return "l2";
    case Metric::InnerProduct: return "inner_product";
    case Metric::Cosine: return "cosine";
  }
  return "?";
}
constexpr std::string_view to_string(ComputeMode m) noexcept {
  return m == ComputeMode::Tf32 ? "tf32" : "fp32_accurate";
}

// knn only, fp16 / bf16 / int8 inputs only: the exact fp32 re-rank of the approximate candidates.
// Given the fp32 originals of both inputs, knn selects the top `candidates` per query in the low
// precision, recomputes those candidates' distances from the fp32 originals (the direct form,
// fp32 accumulation in a fixed order) and returns the k best of them. The result is the exact
// fp32 kNN whenever the true k nearest are among the candidates (docs/kernels.md, "Re-rank").
struct RerankOptions {
  // The fp32 originals: same device as the inputs, the same rows × dim as queries resp. corpus.
  // Both or neither; re-ranking is on when they are given.
  const ManagedBuffer* queries = nullptr;
  const ManagedBuffer* corpus = nullptr;
  // Candidates per query, k..kMaxK (capped at N: then every row is re-ranked); 0 = the default,
  // default_rerank_candidates(k, N).
  std::size_t candidates = 0;
};

struct DistanceOptions {
  std::size_t dim = 0;  // elements per vector, >= 1
  Metric metric = Metric::L2;
  ComputeMode mode = ComputeMode::Fp32Accurate;
  // Int8 inputs only (required then, refused otherwise): one fp32 scale per row, value = scale * q
  // (symmetric per-vector quantisation, as convert() produces). Same device as the inputs.
  const ManagedBuffer* query_scales = nullptr;
  const ManagedBuffer* corpus_scales = nullptr;
  // knn with fp16 / bf16 / int8 inputs only (refused elsewhere): see RerankOptions.
  RerankOptions rerank = {};
  // knn only (refused elsewhere): per query, the largest distance wanted — Q values in host
  // memory, read during the call; none NaN (+inf: no bound). Rows farther than their query's
  // bound, and rows whose distance is NaN, are left out; where fewer than k rows are within the
  // bound, the list ends in slots of index -1 and distance NaN. A corpus streamed in chunks
  // passes each query's k-th distance so far: the filter then tests every row against the
  // tighter of its own threshold and the bound, and keeps almost nothing from later chunks.
  std::span<const float> upper_bounds = {};
  // knn only (refused elsewhere): the corpus rows' squared norms as row_norms writes them (fp32,
  // one per row, on the corpus's device; int8: row_norms with corpus_scales). L2 and cosine read
  // them instead of computing them from the corpus (InnerProduct needs none): a corpus searched
  // many times, as a server searches its index, has them computed once. They must be the norms of
  // the corpus as it is when the call runs: norms of other rows give wrong distances.
  const ManagedBuffer* corpus_norms = nullptr;
};

// out (fp32, at least Q×N elements) = distance of every query row to every corpus row, row-major
// Q×N. Queries and corpus share one precision: Fp32, Fp16, Bf16 or Int8. Runs on out's stream;
// on a CUDA device its temporaries (row norms; fp32-accurate's fp16 halves of both inputs where
// the pool has room for them, docs/kernels.md) come from out's pool, under that pool's limit.
Result<void> l2_distance(const ManagedBuffer& queries, const ManagedBuffer& corpus,
                         ManagedBuffer& out, const DistanceOptions& options);
// The same into a new fp32 Q×N buffer from `pool`, on the queries' stream.
Result<ManagedBuffer> l2_distance(GpuMemoryPool& pool, const ManagedBuffer& queries,
                                  const ManagedBuffer& corpus, const DistanceOptions& options);

inline constexpr std::size_t kMaxK = 1024;

// Re-rank candidates when RerankOptions::candidates is 0: max(2k, k + 32) — twice k for large k,
// a fixed margin of 32 for small k, where a few low-precision swaps at the boundary matter most —
// capped at kMaxK and at the corpus rows N.
constexpr std::size_t default_rerank_candidates(std::size_t k, std::size_t n) noexcept {
  std::size_t c = 2 * k > k + 32 ? 2 * k : k + 32;
  c = c < kMaxK ? c : kMaxK;
  return c < n ? c : n;
}

// How knn found its result on a CUDA device (the simulated device always tiles):
//   Tiled          the Q × tile distance matrix of each corpus tile is written, then scanned;
//   Filtered       a sample of the corpus is tiled, then the fused filter compares every other
//                  distance with its query's k-th so far inside the GEMM and keeps the few that
//                  beat it (large corpora, k <= 256; docs/kernels.md);
//   FilterFellBack a query kept more rows than its list holds (an order of rows that defeats the
//                  sample), so the call redid everything tiled: same result, slower.
enum class KnnPath { Tiled, Filtered, FilterFellBack };

constexpr std::string_view to_string(KnnPath p) noexcept {
  switch (p) {
    case KnnPath::Tiled: return "tiled";
    case KnnPath::Filtered: return "filtered";
    case KnnPath::FilterFellBack: return "filter fell back";
  }
  return "?";
}

struct KnnResult {
  ManagedBuffer distances;  // fp32, Q×k, each row ascending
  ManagedBuffer indices;    // int32 corpus row numbers as Precision::Bytes, Q×k×4 bytes
  std::size_t queries = 0;
  std::size_t k = 0;
  KnnPath path = KnnPath::Tiled;  // the slowest path any block of queries took
};

// The k nearest corpus rows of every query (smallest distance first; ties by smaller index; NaN
// distances after all numbers). k in 1..kMaxK and k <= N. The Q×N matrix is never materialised:
// the corpus is processed in tiles sized from the pool's headroom for the device (its hard limit
// and the device's free memory); every temporary comes from `pool`. Runs on the queries' stream.
// With options.rerank (fp16 / bf16 / int8 inputs): the k best of the top-C low-precision
// candidates by their exact fp32 distances (RerankOptions).
Result<KnnResult> knn(GpuMemoryPool& pool, const ManagedBuffer& queries,
                      const ManagedBuffer& corpus, std::size_t k, const DistanceOptions& options);

// out[i] (fp32, at least rows elements) = squared L2 norm of row i (Int8: dequantised with
// `scales`, required then). Runs on out's stream.
Result<void> row_norms(const ManagedBuffer& vectors, ManagedBuffer& out, std::size_t dim,
                       const ManagedBuffer* scales = nullptr);

struct ConvertOptions {
  std::size_t dim = 0;  // elements per row
  // Fp32 → Int8: receives one fp32 scale per row (max|x| / 127; 0 for an all-zero row, NaN for a
  // row holding NaN or infinity, whose values become 0). Int8 → Fp32: the scales to apply.
  ManagedBuffer* scales = nullptr;
};
// Fp32 → Fp16 / Bf16 / Int8 (round to nearest even; fp16 overflow becomes ±inf), or Fp16 / Bf16 /
// Int8 → Fp32. `out` holds at least as many elements as `in`. Runs on out's stream.
Result<void> convert(const ManagedBuffer& in, ManagedBuffer& out, const ConvertOptions& options);

// How a vector file stores its values: rows go to the device as stored and convert_stored turns
// them into what the kernels take there (a quarter of the bus traffic for uint8 rows).
enum class StoredElement : std::uint8_t { UInt8, Int8, Fp16, Fp32 };

constexpr std::size_t stored_size(StoredElement e) noexcept {
  return e == StoredElement::Fp32 ? 4 : e == StoredElement::Fp16 ? 2 : 1;
}
constexpr std::string_view to_string(StoredElement e) noexcept {
  switch (e) {
    case StoredElement::UInt8: return "uint8";
    case StoredElement::Int8: return "int8";
    case StoredElement::Fp16: return "fp16";
    case StoredElement::Fp32: return "fp32";
  }
  return "?";
}

struct StoredConvertOptions {
  StoredElement element = StoredElement::Fp32;  // how in's bytes are read
  std::int32_t offset = 0;  // added to every value (-128 moves uint8 into int8's range), |offset| <= 2^24
  // Then multiplied by 2^exponent, |exponent| <= 512 (brings values of any magnitude into the
  // range a precision computes in; exact in fp32 unless a result falls below 2^-126).
  std::int32_t exponent = 0;
};
// out[i] = (in[i] + offset) · 2^exponent for each of in's values (its size_bytes() /
// stored_size(element) of them, read as options.element whatever in's precision), the sum and the
// scaling in fp32. Fp32 / Fp16 / Bf16 out: rounded to nearest
// even (exact for integers up to 2^24 / 2^11 / 2^8 in magnitude); Int8 out: rounded to the
// nearest integer (ties away from zero) and saturated to [-128, 127], NaN to 0, no scales —
// exact for integers in that range (int8 kNN then takes scales of 1). `out` holds at least as
// many elements. Runs on out's stream.
Result<void> convert_stored(const ManagedBuffer& in, ManagedBuffer& out,
                            const StoredConvertOptions& options);

struct MergeTopkOptions {
  std::size_t queries = 0;      // Q
  std::size_t lists = 0;        // P partial lists per query
  std::size_t list_length = 0;  // entries per partial list
  std::size_t k = 0;            // 1..kMaxK, at most lists * list_length
};
// Input: fp32 distances and int32 (Bytes) indices laid out [query][list][entry]; index -1 marks an
// empty slot (sorted after everything). Output: the k best per query (knn's order), Q×k.
// Runs on out_distances' stream.
Result<void> merge_topk(const ManagedBuffer& distances, const ManagedBuffer& indices,
                        ManagedBuffer& out_distances, ManagedBuffer& out_indices,
                        const MergeTopkOptions& options);

struct FoldTopkOptions {
  std::size_t queries = 0;        // Q
  std::size_t candidates = 0;     // candidates per query (a row of the candidate buffers)
  std::size_t k = 0;              // the running lists' length, 1..kMaxK
  std::int64_t index_offset = 0;  // 0..2^31-1, added to every candidate index but -1
};
// Folds candidates into running top-k lists in place, so that partial results (a corpus streamed
// in chunks, shards) never leave the device: afterwards running list q holds the k best of itself
// and query q's candidates, in knn's order. Running lists: fp32 distances and int32 (Bytes)
// indices, Q×k, sorted as knn, merge_topk and fold_topk leave them (start from knn's result, or
// from lists of index -1, which sort last). Candidates: Q×candidates, any order, index -1 an empty
// slot; index_offset is added to the others (a chunk's knn counts its rows from 0), and their sums
// must stay below 2^31. Runs on running_distances' stream.
Result<void> fold_topk(const ManagedBuffer& candidate_distances,
                       const ManagedBuffer& candidate_indices, ManagedBuffer& running_distances,
                       ManagedBuffer& running_indices, const FoldTopkOptions& options);

// Reads an int32 index buffer (Precision::Bytes, 4 bytes per index) to the host.
Result<std::vector<std::int32_t>> indices_to_host(const ManagedBuffer& indices);

// Host-side scalar conversions, the same as the kernels use (round to nearest even).
Half to_half(float value) noexcept;
BFloat16 to_bfloat16(float value) noexcept;
float to_float(Half value) noexcept;
float to_float(BFloat16 value) noexcept;

}  // namespace gpupool
