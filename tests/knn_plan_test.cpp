// The kNN plan (gpu/knn_plan.hpp) on the host: where the fused filter starts and stops, how its
// sample and lists fit the memory a tile may take, when TF32 mode takes fp32-accurate's filter,
// and that the tiles stay within the pool's headroom.
#include <catch2/catch.hpp>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>

#include <algorithm>
#include <bit>
#include <cstddef>

#include "knn_plan.hpp"

using namespace gpupool::knn_plan;
using gpupool::cuda_kernels::kFilterPieces;
using gpupool::cuda_kernels::kMinimaGroupRows;

namespace {

constexpr std::size_t kMillionRows = std::size_t{1} << 20;

// fp16 (Q, 2^20, 128), k = 10, L2, with tiles as wide as the corpus.
KnnProblem fp16_problem() {
  return {.queries = 1024, .rows = kMillionRows, .dim = 128, .k = 10, .value_bytes = 2,
          .l2 = true, .tile_cols = kMillionRows};
}

// fp32 rows in the given mode.
KnnProblem fp32_problem(bool accurate, std::size_t dim = 64) {
  KnnProblem p = fp16_problem();
  p.value_bytes = 4, p.fp32 = true, p.accurate = accurate, p.dim = dim;
  return p;
}

constexpr KernelCapabilities kHopper{.filter_reads_rows = true, .resident_filter_on_corpus = true,
                                     .resident_filter_on_scaled_copies = true};
constexpr KernelCapabilities kNoResident{.filter_reads_rows = true};
// Rows too long for the resident kernel (fp16 D = 960; fp32-accurate's copies of as many values)
// on Hopper: the streamed kernel takes them.
constexpr KernelCapabilities kHopperLongRows{.filter_reads_rows = true,
                                             .streamed_filter_on_corpus = true};

}  // namespace

TEST_CASE("knn plan: the filter takes enough queries, small k and large corpora", "[knn_plan]") {
  KnnProblem p = fp16_problem();
  REQUIRE(plan_knn(p, kHopper).filter.on);

  p.queries = kFilterMinQueries - 1;
  CHECK_FALSE(plan_knn(p, kHopper).filter.on);
  p.queries = kFilterMinQueries;
  CHECK(plan_knn(p, kHopper).filter.on);

  p = fp16_problem();
  p.k = kFilterMaxK;
  CHECK(plan_knn(p, kHopper).filter.on);
  p.k = kFilterMaxK + 1;
  CHECK_FALSE(plan_knn(p, kHopper).filter.on);

  p = fp16_problem();
  p.rows = kFilterMinRows - 1;
  CHECK_FALSE(plan_knn(p, kHopper).filter.on);
  p.rows = kFilterMinRows;
  CHECK(plan_knn(p, kHopper).filter.on);
}

TEST_CASE("knn plan: exact-distance filters take rows of at most 1024 bytes that it reads, "
          "longer ones on the streamed kernel",
          "[knn_plan]") {
  KnnProblem p = fp16_problem();
  p.dim = kFilterMaxExactRowBytes / 2;
  CHECK(plan_knn(p, kNoResident).filter.on);
  p.dim += 8;
  CHECK_FALSE(plan_knn(p, kNoResident).filter.on);
  CHECK(plan_knn(p, kHopperLongRows).filter.on);
  p.dim = 960;
  const KnnPlan wide = plan_knn(p, kHopperLongRows);
  CHECK(wide.filter.on);
  CHECK_FALSE(wide.filter.minima);  // the minima run on the resident kernel: the tiled sample
  CHECK_FALSE(plan_knn(p, kNoResident).filter.on);
  p.dim = 128;
  CHECK_FALSE(plan_knn(p, KernelCapabilities{}).filter.on);  // rows not whole 16-byte chunks

  // fp32-accurate filters on its scaled copies at any D.
  KnnProblem accurate = fp32_problem(true, 960);
  KnnPlan plan = plan_knn(accurate, KernelCapabilities{});
  CHECK(plan.filter.on);
  CHECK(plan.filter.lower_bound);
  CHECK(plan.scaled_copies);
}

TEST_CASE("knn plan: the sample of (1024, 2^20, 128) fp16, k = 10", "[knn_plan]") {
  const KnnPlan plan = plan_knn(fp16_problem(), kHopper);
  REQUIRE(plan.filter.on);
  // S ≈ √(64·k·N) = 25905 rows in 16 pieces, rounded up to whole 8-row groups for the minima.
  CHECK(plan.filter.sample.period == kMillionRows / kFilterPieces);
  CHECK(plan.filter.sample.length == 1624);
  CHECK(plan.filter.capacity == 2048);  // 4·k·N/S = 1619, to a power of two
  CHECK(plan.filter.minima);
  CHECK_FALSE(plan.filter.lower_bound);
  CHECK_FALSE(plan.scaled_copies);
  // The tiled path sees only the sample: max(16 · 1624, 4096) columns.
  CHECK(plan.tile_cols == kFilterPieces * 1624);

  // Without the resident kernel the sample goes through the tiled path: no whole groups needed.
  const KnnPlan tiled_sample = plan_knn(fp16_problem(), kNoResident);
  REQUIRE(tiled_sample.filter.on);
  CHECK_FALSE(tiled_sample.filter.minima);
  CHECK(tiled_sample.filter.sample.length == 1620);
}

TEST_CASE("knn plan: less memory for the lists takes a larger sample, and none where it won't fit",
          "[knn_plan]") {
  KnnProblem p = fp16_problem();
  p.tile_cols = 1024;  // lists of at most 512 slots
  KnnPlan plan = plan_knn(p, kHopper);
  REQUIRE(plan.filter.on);
  CHECK(plan.filter.capacity == 512);
  CHECK(plan.filter.sample.length == 4 * p.k * p.rows / 512 / kFilterPieces);  // 5120
  CHECK(plan.tile_cols <= p.tile_cols);

  p.tile_cols = 256;  // 128 slots: a sample of 327,680 rows, over a quarter of the corpus
  CHECK_FALSE(plan_knn(p, kHopper).filter.on);

  p.tile_cols = 2 * p.k - 1;  // lists shorter than 2k
  plan = plan_knn(p, kHopper);
  CHECK_FALSE(plan.filter.on);
  CHECK(plan.tile_cols == p.tile_cols);

  // GPUPOOL_KNN_TILE_BYTES caps the lists as it caps the tile.
  p = fp16_problem();
  p.tile_bytes_cap = p.queries * 4 * 1024;
  plan = plan_knn(p, kHopper);
  REQUIRE(plan.filter.on);
  CHECK(plan.filter.capacity == 512);
}

TEST_CASE("knn plan: from the headroom to the path", "[knn_plan]") {
  // 1024 fp16 queries against 2^20 rows: 64 MiB of headroom gives tiles of 8192 columns, room for
  // lists of 4096 slots where the sample asks for 2048; 2 MiB gives 256 columns, lists of 128
  // slots that would need a sample of over a quarter of the corpus: tiled.
  KnnProblem p = fp16_problem();
  p.tile_cols = choose_tile(std::size_t{64} << 20, p.queries, p.rows, true).cols;
  KnnPlan plan = plan_knn(p, kHopper);
  CHECK(plan.filter.on);
  CHECK(plan.filter.capacity == 2048);

  const TileShape small = choose_tile(std::size_t{2} << 20, p.queries, p.rows, true);
  CHECK(small.rows == p.queries);
  p.tile_cols = small.cols;
  plan = plan_knn(p, kHopper);
  CHECK_FALSE(plan.filter.on);
  CHECK(plan.tile_cols == small.cols);
}

TEST_CASE("knn plan: TF32 mode takes fp32-accurate's filter where the resident kernel reads it",
          "[knn_plan]") {
  const KnnProblem tf32 = fp32_problem(false);
  KnnPlan plan = plan_knn(tf32, kHopper);
  CHECK(plan.accurate);
  CHECK(plan.filter.on);
  CHECK(plan.filter.lower_bound);
  CHECK(plan.scaled_copies);
  CHECK(plan.norms);
  CHECK(plan.split);  // the sample's tiles in 3×TF32, as fp32-accurate's (Q > 128, D <= 256)

  // No resident kernel for the copies: TF32's own filter.
  plan = plan_knn(tf32, kNoResident);
  CHECK_FALSE(plan.accurate);
  CHECK(plan.filter.on);
  CHECK_FALSE(plan.filter.lower_bound);
  CHECK_FALSE(plan.scaled_copies);
  CHECK_FALSE(plan.split);

  // No room for the copies: TF32's own filter too.
  plan = plan_knn(tf32, kHopper, false);
  CHECK_FALSE(plan.accurate);
  CHECK(plan.filter.on);
  CHECK_FALSE(plan.filter.lower_bound);

  // Inner product needs norms only for the bound.
  KnnProblem ip = tf32;
  ip.inner_product = true, ip.l2 = false;
  CHECK(plan_knn(ip, kHopper).norms);
  CHECK_FALSE(plan_knn(ip, kNoResident).norms);

  // Rows over 1024 bytes (D = 960): TF32's own filter does not take them (the streamed kernel
  // takes no fp32 rows), and TF32 mode stays tiled there.
  const KnnProblem long_tf32 = fp32_problem(false, 960);
  plan = plan_knn(long_tf32, kNoResident);
  CHECK_FALSE(plan.accurate);
  CHECK_FALSE(plan.filter.on);
  CHECK_FALSE(plan.scaled_copies);
  CHECK(plan_knn(fp32_problem(true, 960), kNoResident).filter.on);

  // fp16 rows ignore the mode.
  KnnProblem fp16 = fp16_problem();
  fp16.accurate = false;
  plan = plan_knn(fp16, kHopper);
  CHECK_FALSE(plan.accurate);
  CHECK_FALSE(plan.filter.lower_bound);
  CHECK_FALSE(plan.scaled_copies);
}

TEST_CASE("knn plan: fp32-accurate without room for its copies goes tiled", "[knn_plan]") {
  const KnnProblem accurate = fp32_problem(true);
  KnnPlan plan = plan_knn(accurate, kHopper);
  REQUIRE(plan.filter.on);
  CHECK(plan.scaled_copies);
  CHECK(plan.refine);

  plan = plan_knn(accurate, kHopper, false);
  CHECK_FALSE(plan.filter.on);
  CHECK_FALSE(plan.scaled_copies);
  CHECK(plan.refine);
  CHECK(plan.split);
  CHECK(plan.tile_cols == split_tile_cols(accurate.tile_cols, accurate.queries, accurate.dim));
}

TEST_CASE("knn plan: 3×TF32 tiles past 128 queries and up to D = 256", "[knn_plan]") {
  KnnProblem p = fp32_problem(true, kSplitMaxDim);
  p.rows = 50000;  // unfiltered
  p.tile_cols = p.rows;
  p.queries = kPlainFmaMaxQueries;
  CHECK_FALSE(plan_knn(p, kHopper).split);
  p.queries = kPlainFmaMaxQueries + 1;
  KnnPlan plan = plan_knn(p, kHopper);
  CHECK(plan.split);
  // The split copy (3·dim floats a row) within max(the tile, 256 MiB).
  CHECK(plan.tile_cols * 3 * p.dim * 4 <=
        std::max<std::size_t>(p.queries * p.tile_cols * 4, std::size_t{256} << 20));
  p.dim = kSplitMaxDim + 4;
  CHECK_FALSE(plan_knn(p, kHopper).split);
  p = fp32_problem(false);
  p.rows = 50000, p.tile_cols = 50000;
  CHECK_FALSE(plan_knn(p, kHopper).split);  // TF32 mode, unfiltered: plain TF32 tiles
}

TEST_CASE("knn plan: the tile cap keeps at least 256 columns", "[knn_plan]") {
  CHECK(capped_tile_cols(100000, 1024, kMillionRows, 0) == 100000);
  CHECK(capped_tile_cols(100000, 1024, kMillionRows, 1024 * 4 * 1000) == 1000);
  CHECK(capped_tile_cols(100000, 1024, kMillionRows, 1) == 256);
  CHECK(capped_tile_cols(100, 1024, kMillionRows, 1) == 100);
}

TEST_CASE("knn plan: tiles from the headroom", "[knn_plan]") {
  // Half of 64 MiB: 8 Mi floats, all 1024 queries against 8192 columns.
  TileShape t = choose_tile(std::size_t{64} << 20, 1024, kMillionRows, true);
  CHECK(t.rows == 1024);
  CHECK(t.cols == 8192);
  // A simulated device stops at 64 MiB whatever the headroom.
  t = choose_tile(std::size_t{1} << 40, 1024, kMillionRows, false);
  CHECK(t.rows * t.cols * 4 <= (std::size_t{64} << 20));
  // No headroom: one query against min(N, 256) columns.
  t = choose_tile(0, 1024, kMillionRows, true);
  CHECK(t.rows == 1);
  CHECK(t.cols == 256);
}

TEST_CASE("knn plan: many queries take turns at tiles wide enough for the filter", "[knn_plan]") {
  // A GPU's 1 GiB budget: 256 Mi floats. A million queries would get 268 columns each; they take
  // 32,768 at a time against 8192 columns, and the filter runs with lists of 1024 slots.
  constexpr std::size_t kQueries = 1'000'000, kRows = 262'144;
  TileShape t = choose_tile(std::size_t{4} << 30, kQueries, kRows, true);
  CHECK(t.cols == kWideTileCols);
  CHECK(t.rows == (std::size_t{1} << 28) / kWideTileCols);
  KnnProblem p = fp16_problem();
  p.queries = t.rows, p.rows = kRows, p.tile_cols = t.cols;
  const KnnPlan plan = plan_knn(p, kHopper);
  CHECK(plan.filter.on);
  CHECK(plan.filter.capacity == 1024);
  // 100,000 queries would get 2,684 columns, too few for k = 100's lists: they take turns too.
  t = choose_tile(std::size_t{4} << 30, 100'000, kRows, true);
  CHECK(t.cols == kWideTileCols);
  p.queries = t.rows, p.k = 100, p.tile_cols = 2'684;
  CHECK_FALSE(plan_knn(p, kHopper).filter.on);
  p.tile_cols = t.cols;
  CHECK(plan_knn(p, kHopper).filter.on);
  // Fewer queries than the budget holds at 8192 columns: all at once, in wider tiles.
  t = choose_tile(std::size_t{4} << 30, 10'000, kRows, true);
  CHECK(t.rows == 10'000);
  CHECK(t.cols == (std::size_t{1} << 28) / 10'000);
  // 8192 columns would leave under kWideTileMinRows queries of a small budget: the queries stay
  // together in narrower tiles (below).
  t = choose_tile(std::size_t{2} << 20, 1024, kMillionRows, true);
  CHECK(t.rows == 1024);
  CHECK(t.cols == 256);
}

TEST_CASE("knn plan: the planned tile and lists never take more than the headroom allows",
          "[knn_plan][property]") {
  rc::prop("tiles and lists within the headroom", [] {
    const auto headroom = *rc::gen::inRange<std::size_t>(0, std::size_t{1} << 36);
    const auto q = *rc::gen::inRange<std::size_t>(1, 4097);
    const auto n = *rc::gen::inRange<std::size_t>(1, std::size_t{1} << 23);
    const auto k = *rc::gen::inRange<std::size_t>(1, 300);
    const auto element = *rc::gen::inRange(0, 5);  // fp16, int8, fp32 TF32, fp32 accurate, bf16
    const bool cuda = *rc::gen::arbitrary<bool>();
    const KernelCapabilities caps{.filter_reads_rows = *rc::gen::arbitrary<bool>(),
                                  .resident_filter_on_corpus = *rc::gen::arbitrary<bool>(),
                                  .resident_filter_on_scaled_copies = *rc::gen::arbitrary<bool>(),
                                  .streamed_filter_on_corpus = *rc::gen::arbitrary<bool>()};
    const TileShape tile = choose_tile(headroom, q, n, cuda);
    const std::size_t budget =
        std::min(headroom / 2, cuda ? std::size_t{1} << 30 : std::size_t{64} << 20);
    const std::size_t floor_cols = std::min<std::size_t>(n, 256);
    RC_ASSERT(tile.rows >= 1);
    RC_ASSERT(tile.rows <= q);
    RC_ASSERT(tile.cols >= 1);
    RC_ASSERT(tile.cols <= n);
    RC_ASSERT(tile.rows * tile.cols * 4 <= budget ||
              (tile.rows == 1 && tile.cols == floor_cols));

    KnnProblem p{.queries = tile.rows, .rows = n, .dim = *rc::gen::inRange<std::size_t>(1, 1025),
                 .k = k, .value_bytes = element == 1 ? 1u : element >= 2 && element <= 3 ? 4u : 2u,
                 .fp32 = element == 2 || element == 3, .int8 = element == 1,
                 .accurate = element != 2, .inner_product = *rc::gen::arbitrary<bool>(),
                 .tile_cols = tile.cols};
    p.l2 = !p.inner_product;
    for (bool fit : {true, false}) {
      const KnnPlan plan = plan_knn(p, caps, fit);
      RC_ASSERT(plan.tile_cols >= 1);
      RC_ASSERT(plan.tile_cols <= tile.cols);
      // The filter's lists (8 bytes a slot) within the tile's memory.
      if (plan.filter.on) {
        const auto& f = plan.filter;
        RC_ASSERT(2 * f.capacity <= tile.cols);
        RC_ASSERT(std::has_single_bit(f.capacity));
        RC_ASSERT(f.capacity >= 2 * k);
        RC_ASSERT(f.sample.length > 0);
        RC_ASSERT(4 * f.sample.length <= f.sample.period);
        RC_ASSERT(kFilterPieces * f.sample.period <= n);
        RC_ASSERT(k <= kFilterMaxK);
        if (f.minima) {
          RC_ASSERT(f.sample.length % 8 == 0);
          RC_ASSERT(kFilterPieces * f.sample.length / kMinimaGroupRows >= k);
        }
      }
      RC_ASSERT(plan.scaled_copies == (plan.filter.on && plan.filter.lower_bound));
      if (!fit) RC_ASSERT(!plan.scaled_copies);
      RC_ASSERT(!plan.accurate || p.accurate || plan.scaled_copies);
    }
  });
}
