// ShardedCorpus (modules/sharded_corpus.cppm): the shares, each shard's search on its own thread,
// and the merge of the shards' lists in knn's order.
module;
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include <expected>
#include <fmt/format.h>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>
module gpupool;

namespace gpupool {

namespace {

bool searchable(Precision p) noexcept {
  return p == Precision::Fp32 || p == Precision::Fp16 || p == Precision::Bf16 ||
         p == Precision::Int8;
}

// knn's order: a smaller distance first, NaN after every number, ties by the smaller row; an
// empty slot (row -1) after everything.
bool comes_first(float distance_a, std::int64_t row_a, float distance_b, std::int64_t row_b) {
  if ((row_a < 0) != (row_b < 0)) return row_b < 0;
  const bool nan_a = std::isnan(distance_a), nan_b = std::isnan(distance_b);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && distance_a != distance_b) return distance_a < distance_b;
  return row_a < row_b;
}

// One shard's answer: its list per query (`k` long, rows counted over the whole corpus).
struct ShardAnswer {
  std::size_t k = 0;
  std::vector<float> distances;
  std::vector<std::int64_t> rows;
  double seconds = 0;
};

std::string describe_shard(std::size_t shard, const Device& device, std::size_t first,
                           std::size_t rows) {
  return fmt::format("shard {} (rows {}..{} on {})", shard, first, first + rows - 1,
                     device.describe());
}

}  // namespace

Result<ShardedCorpus> ShardedCorpus::create(GpuMemoryPool& pool, std::span<const Device> devices,
                                            std::span<const std::byte> rows, std::size_t dim,
                                            Precision precision,
                                            std::span<const float> int8_scales) {
  if (devices.empty())
    return make_error(ErrorKind::InvalidInput, "a sharded corpus needs at least one device");
  if (!searchable(precision))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("a sharded corpus holds fp32, fp16, bf16 or int8 rows, not {}",
                                  to_string(precision)));
  const std::size_t row_bytes = dim * element_size(precision);
  if (dim == 0 || rows.empty() || rows.size() % row_bytes != 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} bytes of {} rows of dim {}: expected a positive whole "
                                  "number of rows", rows.size(), to_string(precision), dim));
  const std::size_t total = rows.size() / row_bytes;
  const bool int8 = precision == Precision::Int8;
  if (int8 ? int8_scales.size() != total : !int8_scales.empty())
    return make_error(ErrorKind::InvalidInput,
                      int8 ? fmt::format("{} int8 rows with {} scales: expected one scale a row",
                                         total, int8_scales.size())
                           : std::string("scales are for int8 rows only"));
  ShardedCorpus corpus(pool, total, dim, precision);
  const std::size_t count = std::min(devices.size(), total);
  for (std::size_t s = 0; s < count; ++s) {
    // Shares as equal as they come: the first total % count shards hold one row more.
    const std::size_t first = s * (total / count) + std::min(s, total % count);
    const std::size_t share = total / count + (s < total % count ? 1 : 0);
    Shard shard{devices[s], first, share, {}, {}, {}};
    const std::string where = describe_shard(s, shard.device, first, share);
    auto values = pool.get_managed_buffer(shard.device, share * dim, precision);
    if (!values) return std::unexpected(values.error().with_context(where));
    // Each upload finished before the next (and before an error returns): the caller's rows
    // are read only during this call.
    if (auto ok = values->upload(rows.subspan(first * row_bytes, share * row_bytes)); !ok)
      return std::unexpected(ok.error().with_context(where));
    if (auto ok = values->stream().synchronize(); !ok)
      return std::unexpected(ok.error().with_context(where));
    shard.values = std::move(*values);
    if (int8) {
      auto scales = pool.get_managed_buffer(shard.device, share, Precision::Fp32);
      if (!scales) return std::unexpected(scales.error().with_context(where));
      if (auto ok = scales->upload(int8_scales.subspan(first, share)); !ok)
        return std::unexpected(ok.error().with_context(where));
      if (auto ok = scales->stream().synchronize(); !ok)
        return std::unexpected(ok.error().with_context(where));
      shard.scales = std::move(*scales);
    }
    // The rows' squared norms, once: every search reads them (knn's corpus_norms) instead of
    // computing them again.
    auto norms = pool.get_managed_buffer(shard.device, share, Precision::Fp32);
    if (!norms) return std::unexpected(norms.error().with_context(where));
    if (auto ok = row_norms(shard.values, *norms, dim, int8 ? &shard.scales : nullptr); !ok)
      return std::unexpected(ok.error().with_context(where));
    if (auto ok = norms->stream().synchronize(); !ok)
      return std::unexpected(ok.error().with_context(where));
    shard.norms = std::move(*norms);
    corpus.shards_.push_back(std::move(shard));
  }
  return corpus;
}

Result<ShardedKnnResult> ShardedCorpus::knn(std::span<const std::byte> queries, std::size_t k,
                                            const ShardedSearchOptions& options) const {
  const std::size_t row_bytes = dim_ * element_size(precision_);
  if (queries.empty() || queries.size() % row_bytes != 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} bytes of {} queries of dim {}: expected a positive whole "
                                  "number of rows", queries.size(), to_string(precision_), dim_));
  const std::size_t q = queries.size() / row_bytes;
  if (k == 0 || k > kMaxK || k > rows_)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("k = {}: expected 1 .. {} (and at most the corpus's {} rows)",
                                  k, kMaxK, rows_));
  const bool int8 = precision_ == Precision::Int8;
  if (int8 ? options.query_scales.size() != q : !options.query_scales.empty())
    return make_error(ErrorKind::InvalidInput,
                      int8 ? fmt::format("{} int8 queries with {} scales: expected one scale a "
                                         "query", q, options.query_scales.size())
                           : std::string("query scales are for int8 corpora only"));

  std::vector<ShardAnswer> answers(shards_.size());
  std::vector<std::optional<GpuError>> errors(shards_.size());
  auto search = [&](std::size_t s) {
    const Shard& shard = shards_[s];
    const auto started = std::chrono::steady_clock::now();
    auto fail = [&](const GpuError& error) {
      errors[s] = error.with_context(describe_shard(s, shard.device, shard.first_row, shard.rows));
    };
    auto on_device = pool_.get_managed_buffer(shard.device, q * dim_, precision_);
    if (!on_device) return fail(on_device.error());
    if (auto ok = on_device->upload(queries); !ok) return fail(ok.error());
    ManagedBuffer scales;
    if (int8) {
      auto made = pool_.get_managed_buffer(shard.device, q, Precision::Fp32);
      if (!made) return fail(made.error());
      if (auto ok = made->upload(options.query_scales); !ok) return fail(ok.error());
      scales = std::move(*made);
    }
    DistanceOptions distance{.dim = dim_, .metric = options.metric, .mode = options.mode,
                             .corpus_norms = &shard.norms};
    if (int8) {
      distance.query_scales = &scales;
      distance.corpus_scales = &shard.scales;
    }
    ShardAnswer& answer = answers[s];
    answer.k = std::min(k, shard.rows);
    auto found = gpupool::knn(pool_, *on_device, shard.values, answer.k, distance);
    if (!found) return fail(found.error());
    answer.distances.resize(q * answer.k);
    if (auto ok = found->distances.download(answer.distances); !ok) return fail(ok.error());
    auto rows = indices_to_host(found->indices);
    if (!rows) return fail(rows.error());
    answer.rows.resize(rows->size());
    for (std::size_t i = 0; i < rows->size(); ++i)
      answer.rows[i] = (*rows)[i] < 0 ? -1 : static_cast<std::int64_t>((*rows)[i] + shard.first_row);
    answer.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  {
    std::vector<std::jthread> workers;
    workers.reserve(shards_.size());
    try {
      for (std::size_t s = 1; s < shards_.size(); ++s) workers.emplace_back(search, s);
    } catch (const std::system_error&) {  // no thread: the shards left search on this one
      for (std::size_t s = workers.size() + 1; s < shards_.size(); ++s) search(s);
    }
    search(0);
  }
  for (auto& error : errors)
    if (error) return std::unexpected(std::move(*error));

  // Each shard's list is in knn's order: a k-way merge per query.
  ShardedKnnResult result{q, k, std::vector<float>(q * k), std::vector<std::int64_t>(q * k), {}};
  for (const ShardAnswer& answer : answers) result.shard_seconds.push_back(answer.seconds);
  std::vector<std::size_t> next(answers.size());
  for (std::size_t query = 0; query < q; ++query) {
    std::fill(next.begin(), next.end(), 0);
    for (std::size_t slot = 0; slot < k; ++slot) {
      std::size_t best = answers.size();
      for (std::size_t s = 0; s < answers.size(); ++s) {
        if (next[s] == answers[s].k) continue;
        const std::size_t at = query * answers[s].k + next[s];
        if (best == answers.size()) {
          best = s;
          continue;
        }
        const std::size_t best_at = query * answers[best].k + next[best];
        if (comes_first(answers[s].distances[at], answers[s].rows[at],
                        answers[best].distances[best_at], answers[best].rows[best_at]))
          best = s;
      }
      const std::size_t at = query * answers[best].k + next[best]++;
      result.distances[query * k + slot] = answers[best].distances[at];
      result.indices[query * k + slot] = answers[best].rows[at];
    }
  }
  return result;
}

}  // namespace gpupool
