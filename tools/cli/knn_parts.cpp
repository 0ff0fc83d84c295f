// Each device's part of a `gpupool knn` job, as JSON and as text, and the totals (see knn_parts.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include "knn_parts.hpp"

namespace gpupool::cli {

namespace {

nlohmann::json times_json(const exact::JobTimes& t) {
  return {{"reading", t.reading}, {"preparing_queries", t.preparing_queries},
          {"starting_device", t.starting_device}, {"waiting_for_base", t.waiting_for_base},
          {"uploading", t.uploading}, {"searching", t.searching}, {"merging", t.merging}};
}

nlohmann::json counts_json(const exact::JobCounts& c) {
  return {{"bytes_read", c.bytes_read}, {"bytes_uploaded", c.bytes_uploaded},
          {"bytes_uploaded_ahead", c.bytes_uploaded_ahead},
          {"integer_chunks", c.integer_chunks}, {"float_chunks", c.float_chunks},
          {"candidates", c.fold.candidates}, {"recomputed_fp64", c.fold.recomputed},
          {"widened_queries", c.widened_queries}, {"exhaustive_queries", c.exhaustive_queries},
          {"non_finite_distances", c.non_finite_distances}};
}

void add_times(exact::JobTimes& into, const exact::JobTimes& t) {
  into.reading += t.reading;
  into.preparing_queries += t.preparing_queries;
  into.starting_device += t.starting_device;
  into.waiting_for_base += t.waiting_for_base;
  into.uploading += t.uploading;
  into.searching += t.searching;
  into.merging += t.merging;
}

void add_counts(exact::JobCounts& into, const exact::JobCounts& c) {
  into.bytes_read += c.bytes_read;
  into.bytes_uploaded += c.bytes_uploaded;
  into.bytes_uploaded_ahead += c.bytes_uploaded_ahead;
  into.integer_chunks += c.integer_chunks;
  into.float_chunks += c.float_chunks;
  into.fold.candidates += c.fold.candidates;
  into.fold.recomputed += c.fold.recomputed;
  into.widened_queries += c.widened_queries;
  into.exhaustive_queries += c.exhaustive_queries;
}

void add_pool(PoolStats& into, const PoolStats& p) {
  into.peak_reserved_bytes += p.peak_reserved_bytes;
  into.peak_in_use_bytes += p.peak_in_use_bytes;
  into.peak_cached_bytes += p.peak_cached_bytes;
  into.reserved_bytes += p.reserved_bytes;
  into.cached_bytes += p.cached_bytes;
  into.allocations += p.allocations;
  into.cache_hits += p.cache_hits;
  into.cache_misses += p.cache_misses;
  into.device_allocations += p.device_allocations;
  into.out_of_memory_errors += p.out_of_memory_errors;
  into.trims += p.trims;
}

}  // namespace

nlohmann::json pool_json(const PoolStats& s) {
  return {{"peak_reserved_bytes", s.peak_reserved_bytes}, {"peak_in_use_bytes", s.peak_in_use_bytes},
          {"peak_cached_bytes", s.peak_cached_bytes},     {"reserved_bytes", s.reserved_bytes},
          {"cached_bytes", s.cached_bytes},               {"allocations", s.allocations},
          {"cache_hits", s.cache_hits},                   {"cache_misses", s.cache_misses},
          {"hit_rate", s.hit_rate()},                     {"device_allocations", s.device_allocations},
          {"out_of_memory_errors", s.out_of_memory_errors}, {"trims", s.trims}};
}

nlohmann::json device_report_json(const DeviceReport& r) {
  const exact::JobSummary& s = r.part.summary;
  return {{"rank", r.rank}, {"device", r.part.device}, {"first_row", r.part.share.first_row},
          {"rows", r.part.share.rows}, {"seconds", s.seconds}, {"chunks", s.chunks},
          {"retries", s.retries}, {"largest_chunk_rows", s.largest_chunk_rows},
          {"query_blocks", s.query_blocks}, {"largest_query_block", s.largest_query_block},
          {"query_block_retries", s.query_block_retries}, {"times", times_json(s.times)},
          {"counts", counts_json(s.counts)}, {"pool", pool_json(s.pool)}};
}

Result<DeviceReport> device_report_from_json(const nlohmann::json& json) {
  // nlohmann reports a missing key or a wrong type by throwing: caught here, nothing escapes.
  try {
    DeviceReport r;
    r.rank = json.at("rank").get<std::size_t>();
    r.part.device = json.at("device").get<std::string>();
    r.part.share = {json.at("first_row").get<std::size_t>(), json.at("rows").get<std::size_t>()};
    exact::JobSummary& s = r.part.summary;
    s.seconds = json.at("seconds").get<double>();
    s.chunks = json.at("chunks").get<std::size_t>();
    s.retries = json.at("retries").get<std::size_t>();
    s.largest_chunk_rows = json.at("largest_chunk_rows").get<std::size_t>();
    s.query_blocks = json.at("query_blocks").get<std::size_t>();
    s.largest_query_block = json.at("largest_query_block").get<std::size_t>();
    s.query_block_retries = json.at("query_block_retries").get<std::size_t>();
    const auto& t = json.at("times");
    s.times = {t.at("reading").get<double>(), t.at("preparing_queries").get<double>(),
               t.at("starting_device").get<double>(), t.at("waiting_for_base").get<double>(),
               t.at("uploading").get<double>(), t.at("searching").get<double>(),
               t.at("merging").get<double>()};
    const auto& c = json.at("counts");
    s.counts.bytes_read = c.at("bytes_read").get<std::uint64_t>();
    s.counts.bytes_uploaded = c.at("bytes_uploaded").get<std::uint64_t>();
    s.counts.bytes_uploaded_ahead = c.at("bytes_uploaded_ahead").get<std::uint64_t>();
    s.counts.integer_chunks = c.at("integer_chunks").get<std::uint64_t>();
    s.counts.float_chunks = c.at("float_chunks").get<std::uint64_t>();
    s.counts.fold.candidates = c.at("candidates").get<std::uint64_t>();
    s.counts.fold.recomputed = c.at("recomputed_fp64").get<std::uint64_t>();
    s.counts.widened_queries = c.at("widened_queries").get<std::uint64_t>();
    s.counts.exhaustive_queries = c.at("exhaustive_queries").get<std::uint64_t>();
    s.counts.non_finite_distances = c.at("non_finite_distances").get<std::uint64_t>();
    const auto& p = json.at("pool");
    s.pool.peak_reserved_bytes = p.at("peak_reserved_bytes").get<std::size_t>();
    s.pool.peak_in_use_bytes = p.at("peak_in_use_bytes").get<std::size_t>();
    s.pool.peak_cached_bytes = p.at("peak_cached_bytes").get<std::size_t>();
    s.pool.reserved_bytes = p.at("reserved_bytes").get<std::size_t>();
    s.pool.cached_bytes = p.at("cached_bytes").get<std::size_t>();
    s.pool.allocations = p.at("allocations").get<std::uint64_t>();
    s.pool.cache_hits = p.at("cache_hits").get<std::uint64_t>();
    s.pool.cache_misses = p.at("cache_misses").get<std::uint64_t>();
    s.pool.device_allocations = p.at("device_allocations").get<std::uint64_t>();
    s.pool.out_of_memory_errors = p.at("out_of_memory_errors").get<std::uint64_t>();
    s.pool.trims = p.at("trims").get<std::uint64_t>();
    return r;
  } catch (const nlohmann::json::exception& error) {
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("a device's report is not what device_report_json writes: {}",
                                  error.what()));
  }
}

exact::JobSummary total_summary(std::span<const DeviceReport> reports, const exact::Neighbours& merged,
                                double seconds) {
  exact::JobSummary total;
  std::size_t devices = 0;
  for (const DeviceReport& r : reports) {
    const exact::JobSummary& s = r.part.summary;
    total.base_rows += r.part.share.rows;
    ++devices;
    total.chunks += s.chunks;
    total.retries += s.retries;
    total.largest_chunk_rows = std::max(total.largest_chunk_rows, s.largest_chunk_rows);
    total.query_blocks = std::max(total.query_blocks, s.query_blocks);
    total.largest_query_block = std::max(total.largest_query_block, s.largest_query_block);
    total.query_block_retries += s.query_block_retries;
    add_times(total.times, s.times);
    add_counts(total.counts, s.counts);
    add_pool(total.pool, s.pool);
  }
  total.device = fmt::format("{} device{}", devices, devices == 1 ? "" : "s");
  total.queries = merged.queries;
  total.k = merged.k;
  total.seconds = seconds;
  total.counts.non_finite_distances = static_cast<std::uint64_t>(std::ranges::count_if(
      merged.distances, [](float d) { return !std::isfinite(d); }));
  return total;
}

void print_device_reports(std::span<const DeviceReport> reports, bool with_ranks) {
  // Devices are numbered within their process, as --devices lists them.
  for (std::size_t at = 0, i = 0; at < reports.size(); ++at, ++i) {
    const DeviceReport& r = reports[at];
    if (at > 0 && reports[at - 1].rank != r.rank) i = 0;
    const exact::JobSummary& s = r.part.summary;
    const std::string where = with_ranks ? fmt::format("rank {} ", r.rank) : std::string();
    if (r.part.share.rows == 0) {
      fmt::print("  {}device {} {}: no rows (fewer rows than devices allow; see docs/cli.md)\n",
                 where, i, r.part.device);
      continue;
    }
    fmt::print("  {}device {} {}: base rows {}..{} ({} rows) in {:.2f} s, {} chunks, {} retries; "
               "pool: peak reserved {}, peak in use {}, {} allocations ({:.1f}% from the cache), "
               "{} out-of-memory errors\n",
               where, i, r.part.device, r.part.share.first_row,
               r.part.share.first_row + r.part.share.rows - 1, r.part.share.rows, s.seconds,
               s.chunks, s.retries, format_bytes(s.pool.peak_reserved_bytes),
               format_bytes(s.pool.peak_in_use_bytes), s.pool.allocations,
               s.pool.hit_rate() * 100, s.pool.out_of_memory_errors);
  }
}

}  // namespace gpupool::cli
