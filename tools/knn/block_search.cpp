// One query block against the base (see block_search.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>
#include "block_search.hpp"
#include "exact_knn.hpp"

namespace gpupool::exact {

namespace {

// The wall time of consecutive device steps: lap() waits for the pool's stream, then adds the
// time since the last lap to a figure. The stream, not the device: an upload ahead on a stream of
// its own goes on meanwhile.
class StepClock {
 public:
  explicit StepClock(const Device& device) : stream_(device.default_stream()), last_(Clock::now()) {}
  Result<void> lap(double& seconds) {
    if (auto ok = stream_.synchronize(); !ok) return ok;
    host_lap(seconds);
    return {};
  }
  void host_lap(double& seconds) {
    const Clock::time_point now = Clock::now();
    seconds += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Stream stream_;
  Clock::time_point last_;
};

Precision upload_precision(StoredElement element) noexcept {
  switch (element) {
    case StoredElement::UInt8: return Precision::Bytes;
    case StoredElement::Int8: return Precision::Int8;
    case StoredElement::Fp16: return Precision::Fp16;
    case StoredElement::Fp32: return Precision::Fp32;
  }
  return Precision::Bytes;
}

std::size_t first_candidates(std::size_t k) noexcept { return std::min(kMaxK, k + 32); }

// An upload ahead takes at most this share of the headroom (1/32: the batching shrinks its chunks
// when the headroom falls by a tenth).
constexpr std::size_t kAheadShareOfHeadroom = 32;

bool is_infinite(float bound) noexcept { return std::isinf(bound); }

// Scaled into range, fp16 keeps a row whose norm is down to 2^-17 of the largest value (2^6..2^7
// down to its smallest normal, 2^-14, with a few bits left); a smaller row computes as nearly
// zero beside the others, and its distances as noise.
constexpr double kFp16Span = 0x1p-17;

double row_norm2(const StoredRows& rows, std::size_t row, std::vector<double>& scratch) {
  scratch.resize(rows.dim);
  rows.row_values(row, scratch.data());
  double sum = 0;
  for (double v : scratch) sum += v * v;
  return sum;
}

}  // namespace

Result<RowsUpload> RowsUpload::start(GpuMemoryPool& pool, const Device& device,
                                     const Stream& upload, const StoredRows& rows,
                                     Precision precision, std::shared_ptr<const void> memory) {
  auto buffer = pool.get_managed_buffer(device, rows.rows * rows.dim, precision);
  if (!buffer) return std::unexpected(buffer.error());
  // The pool may hand out memory whose last work on its stream is still queued: the copy waits
  // for what that stream holds now.
  auto pool_work = device.create_event();
  if (!pool_work) return std::unexpected(pool_work.error());
  if (auto ok = pool_work->record(buffer->stream()); !ok) return std::unexpected(ok.error());
  if (auto ok = pool_work->make_wait(upload); !ok) return std::unexpected(ok.error());
  const std::span<const std::byte> bytes = rows.bytes();
  if (auto ok = device.copy(buffer->raw_data(), bytes.data(), bytes.size(), CopyKind::HostToDevice,
                            upload);
      !ok)
    return std::unexpected(ok.error());
  auto copied = device.create_event();
  if (!copied) return std::unexpected(copied.error());
  if (auto ok = copied->record(upload); !ok) return std::unexpected(ok.error());
  return RowsUpload(rows, std::move(memory), std::move(*buffer), std::move(*copied));
}

RowsUpload::~RowsUpload() {
  // A buffer never taken goes back to the pool only behind its copy.
  if (buffer_.valid()) (void)copied_.make_wait(buffer_.stream());
}

bool RowsUpload::holds(const StoredRows& rows) const noexcept {
  return buffer_.valid() && rows_.data == rows.data && rows_.rows == rows.rows &&
         rows_.dim == rows.dim && rows_.element == rows.element;
}

Result<ManagedBuffer> RowsUpload::take() {
  if (auto ok = copied_.make_wait(buffer_.stream()); !ok) return std::unexpected(ok.error());
  return std::move(buffer_);
}

BlockSearch::BlockSearch(GpuMemoryPool& pool, const Device& device, const HostQueries& queries,
                         std::size_t first, std::size_t count, const JobOptions& options,
                         JobTimes& times, JobCounts& counts)
    : pool_(pool), device_(device), queries_(queries), first_(first), count_(count),
      options_(options), times_(times), counts_(counts), lists_(count, options.k) {}

Arithmetic BlockSearch::arithmetic_for(const ValueStats& stats) const noexcept {
  Arithmetic a = options_.fast ? Arithmetic{options_.precision, 0, false, false}
                               : exact_arithmetic(queries_.stats, stats, options_.metric, queries_.dim);
  // fp32 values need no conversion in their usual range, so they are scaled only outside it;
  // every other form is converted anyway and takes the scaling with it.
  const double largest = std::max(queries_.stats.max_abs(), stats.max_abs());
  const bool fp32_in_range = largest >= 0x1p-32 && largest <= 0x1p32;
  if (!a.integer && !(a.precision == Precision::Fp32 && fp32_in_range))
    a.exponent = range_exponent(queries_.stats, stats);
  return a;
}

Result<const ManagedBuffer*> BlockSearch::unit_scales(std::size_t rows) {
  if (unit_scales_.valid() && unit_scales_.size_bytes() >= rows * sizeof(float)) return &unit_scales_;
  unit_scales_ = ManagedBuffer{};  // its memory serves the larger one
  auto scales = pool_.get_managed_buffer(device_, rows, Precision::Fp32);
  if (!scales) return std::unexpected(scales.error());
  const std::vector<float> ones(rows, 1.0f);
  if (auto ok = scales->upload(std::span<const float>(ones)); !ok)
    return std::unexpected(ok.error());
  unit_scales_ = std::move(*scales);
  return &unit_scales_;
}

// fp32 (or stored) values on the device → the arithmetic's form: convert_stored for the exact
// forms and fp16 / bf16, quantisation with per-row scales for the fast mode's int8.
namespace {
Result<DeviceMatrix> to_form(GpuMemoryPool& pool, const Device& device, ManagedBuffer&& uploaded,
                             StoredElement stored, std::size_t dim, const Arithmetic& a,
                             bool quantise) {
  const std::size_t values = uploaded.size_bytes() / stored_size(stored);
  if (!quantise && a.offset == 0 && a.exponent == 0 && upload_precision(stored) == a.precision)
    return DeviceMatrix{std::move(uploaded), {}};
  const Precision through = quantise ? Precision::Fp32 : a.precision;
  auto converted = pool.get_managed_buffer(device, values, through);
  if (!converted) return std::unexpected(converted.error());
  if (through != upload_precision(stored) || a.offset != 0 || a.exponent != 0) {
    if (auto ok = convert_stored(uploaded, *converted,
                                 {.element = stored, .offset = a.offset, .exponent = a.exponent});
        !ok)
      return std::unexpected(ok.error());
  } else {
    *converted = std::move(uploaded);
  }
  if (!quantise) return DeviceMatrix{std::move(*converted), {}};
  uploaded = ManagedBuffer{};
  auto int8 = pool.get_managed_buffer(device, values, Precision::Int8);
  if (!int8) return std::unexpected(int8.error());
  auto scales = pool.get_managed_buffer(device, values / dim, Precision::Fp32);
  if (!scales) return std::unexpected(scales.error());
  if (auto ok = convert(*converted, *int8, {.dim = dim, .scales = &*scales}); !ok)
    return std::unexpected(ok.error());
  return DeviceMatrix{std::move(*int8), std::move(*scales)};
}
}  // namespace

Result<DeviceMatrix> BlockSearch::queries_on_device(const Arithmetic& a,
                                                    std::span<const std::size_t> subset) {
  const std::size_t dim = queries_.dim, rows = subset.empty() ? count_ : subset.size();
  std::vector<float> host(rows * dim);
  for (std::size_t r = 0; r < rows; ++r) {
    const double* from = queries_.row(first_ + (subset.empty() ? r : subset[r]));
    std::transform(from, from + dim, host.begin() + static_cast<std::ptrdiff_t>(r * dim),
                   [](double v) { return static_cast<float>(v); });
  }
  auto uploaded = pool_.get_managed_buffer(device_, host.size(), Precision::Fp32);
  if (!uploaded) return std::unexpected(uploaded.error());
  if (auto ok = uploaded->upload(std::span<const float>(host)); !ok) return std::unexpected(ok.error());
  const bool quantise = a.precision == Precision::Int8 && !a.integer;
  auto form = to_form(pool_, device_, std::move(*uploaded), StoredElement::Fp32, dim, a, quantise);
  if (!form) return form;
  if (a.precision == Precision::Int8 && a.integer) {
    auto scales = unit_scales(rows);
    if (!scales) return std::unexpected(scales.error());
    form->unit_scales = *scales;
  }
  return form;
}

Result<const DeviceMatrix*> BlockSearch::block_queries(const Arithmetic& a) {
  const auto key = std::tuple{static_cast<int>(a.precision), a.offset, a.exponent};
  auto found = query_forms_.find(key);
  if (found != query_forms_.end()) return &found->second;
  auto form = queries_on_device(a, {});
  if (!form) return std::unexpected(form.error().with_context(fmt::format(
                 "putting queries {}..{} on the device", first_, first_ + count_ - 1)));
  return &query_forms_.emplace(key, std::move(*form)).first->second;
}

Result<ManagedBuffer> BlockSearch::stored_on_device(const StoredRows& chunk) {
  std::optional<RowsUpload> ahead = std::exchange(ahead_, std::nullopt);
  if (ahead && ahead->holds(chunk)) {
    auto taken = ahead->take();
    if (!taken) return taken;
    counts_.bytes_uploaded += chunk.bytes().size();
    counts_.bytes_uploaded_ahead += chunk.bytes().size();
    return taken;
  }
  ahead.reset();  // another chunk's rows: the batching changed the chunks' size
  auto uploaded = pool_.get_managed_buffer(device_, chunk.rows * chunk.dim,
                                           upload_precision(chunk.element));
  if (!uploaded) return std::unexpected(uploaded.error());
  if (auto ok = uploaded->upload(chunk.bytes()); !ok) return std::unexpected(ok.error());
  counts_.bytes_uploaded += chunk.bytes().size();
  return uploaded;
}

void BlockSearch::upload_ahead(const NextChunk& next) {
  ahead_.reset();
  // Only where the copy leaves the memory a chunk works with nearly as it was: the batching
  // sizes chunks by the headroom it sees, and an upload ahead must not shrink them.
  const std::size_t bytes = next.rows.bytes().size();
  auto headroom = memory_headroom(pool_, device_);
  if (bytes == 0 || !headroom || bytes > headroom->bytes / kAheadShareOfHeadroom) return;
  if (!upload_stream_) {
    auto made = device_.create_stream();
    if (!made) return;
    upload_stream_ = std::move(*made);
  }
  // A failure costs only the overlap: the chunk uploads in its turn, and meets any lasting
  // device error there.
  auto started = RowsUpload::start(pool_, device_, *upload_stream_, next.rows,
                                   upload_precision(next.rows.element), next.memory);
  if (started) ahead_.emplace(std::move(*started));
}

Result<DeviceMatrix> BlockSearch::chunk_on_device(const StoredRows& chunk, const Arithmetic& a) {
  auto uploaded = stored_on_device(chunk);
  if (!uploaded) return std::unexpected(uploaded.error());
  const bool quantise = a.precision == Precision::Int8 && !a.integer;
  auto form = to_form(pool_, device_, std::move(*uploaded), chunk.element, chunk.dim, a, quantise);
  if (!form) return form;
  if (a.precision == Precision::Int8 && a.integer) {
    auto scales = unit_scales(chunk.rows);
    if (!scales) return std::unexpected(scales.error());
    form->unit_scales = *scales;
  }
  return form;
}

std::vector<float> BlockSearch::upper_bounds(std::span<const std::size_t> subset,
                                             std::span<const double> row_bounds,
                                             double unit) const {
  const std::size_t rows = subset.empty() ? count_ : subset.size();
  std::vector<float> out(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const double wanted = (kth_bound(subset.empty() ? r : subset[r]) +
                           (row_bounds.empty() ? 0.0 : row_bounds[r])) / unit;
    float bound = static_cast<float>(wanted);
    if (static_cast<double>(bound) < wanted)
      bound = std::nextafter(bound, std::numeric_limits<float>::infinity());
    out[r] = bound;
  }
  return out;
}

double BlockSearch::kth_bound(std::size_t q) const noexcept {
  const double own = lists_.kth(q);
  if (!options_.shared_bounds || options_.fast) return own;
  return std::min(own, options_.shared_bounds->kth(first_ + q));
}

void BlockSearch::share_kth() const noexcept {
  if (!options_.shared_bounds || options_.fast) return;
  for (std::size_t q = 0; q < count_; ++q) options_.shared_bounds->lower(first_ + q, lists_.kth(q));
}

Result<ChunkCandidates> BlockSearch::candidates(const DeviceMatrix& queries,
                                                const DeviceMatrix& chunk, std::size_t capacity,
                                                std::span<const std::size_t> subset,
                                                std::span<const double> row_bounds, double unit) {
  std::vector<float> bounds = upper_bounds(subset, row_bounds, unit);
  // No bound yet (the first chunk), or, in the fast mode, a list still open to NaN distances
  // (which a bound would leave out): the device searches unbounded.
  const bool unbounded = options_.fast ? std::ranges::any_of(bounds, is_infinite)
                                       : std::ranges::all_of(bounds, is_infinite);
  if (unbounded) bounds.clear();
  DistanceOptions distance{.dim = queries_.dim, .metric = options_.metric,
                           .mode = options_.fast ? options_.mode : ComputeMode::Fp32Accurate,
                           .query_scales = queries.scales_or_null(),
                           .corpus_scales = chunk.scales_or_null(),
                           .upper_bounds = bounds};
  auto found = gpupool::knn(pool_, queries.values, chunk.values, capacity, distance);
  if (!found) return std::unexpected(found.error());
  ChunkCandidates out{found->queries, found->k, unit, {}, {}};
  auto distances = found->distances.to_host<float>();
  if (!distances) return std::unexpected(distances.error());
  auto indices = indices_to_host(found->indices);
  if (!indices) return std::unexpected(indices.error());
  out.distances = std::move(*distances);
  out.indices = std::move(*indices);
  return out;
}

std::vector<double> BlockSearch::bounds(const Arithmetic& a, const ValueStats& stats,
                                        std::span<const std::size_t> subset) const {
  const std::size_t rows = subset.empty() ? count_ : subset.size(), dim = queries_.dim;
  BoundNorms norms{.row_norm2_max = offset_norm2_max(stats, a.offset, dim),
                   .row_norm2_min = offset_norm2_min(stats, a.offset),
                   .largest = std::max(queries_.stats.max_abs(), stats.max_abs())};
  std::vector<double> out(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t q = first_ + (subset.empty() ? r : subset[r]);
    norms.query_norm2 = queries_.norm2[q];
    if (a.offset != 0) {
      norms.query_norm2 = 0;
      for (std::size_t c = 0; c < dim; ++c) {
        const double v = queries_.row(q)[c] + a.offset;
        norms.query_norm2 += v * v;
      }
    }
    out[r] = error_bound(a, options_.metric, dim, norms);
  }
  return out;
}

Result<void> BlockSearch::check_fp16_span(const StoredRows& chunk, const ValueStats& stats,
                                          std::size_t first_row) const {
  if (!options_.fast || options_.precision != Precision::Fp16) return {};
  const double largest = std::max(queries_.stats.max_abs(), stats.max_abs());
  const double floor = largest * kFp16Span;
  if (queries_.stats.min_norm2 >= floor * floor && stats.min_norm2 >= floor * floor) return {};
  // The smallest non-zero row, for the message: a query, or a row of this chunk.
  std::string which;
  double smallest = std::numeric_limits<double>::infinity();
  for (std::size_t q = 0; q < queries_.rows; ++q)
    if (queries_.norm2[q] > 0 && queries_.norm2[q] < smallest) {
      smallest = queries_.norm2[q];
      which = fmt::format("query {}", q);
    }
  std::vector<double> scratch;
  for (std::size_t r = 0; r < chunk.rows; ++r)
    if (const double n = row_norm2(chunk, r, scratch); n > 0 && n < smallest) {
      smallest = n;
      which = fmt::format("base row {}", first_row + r);
    }
  return make_error(ErrorKind::InvalidInput,
                    fmt::format("{} has norm {:.3g} beside values up to {:.3g}: fp16 holds rows "
                                "down to 2^-17 of the largest value, and would compute this one "
                                "as nearly zero; use --precision bf16 or fp32, or the exact mode "
                                "(leave out --fast)",
                                which, std::sqrt(smallest), largest));
}

Result<void> BlockSearch::prepare(const ValueStats& stats) {
  StepClock clock(device_);
  auto queries = block_queries(arithmetic_for(stats));
  if (!queries) return std::unexpected(queries.error());
  clock.host_lap(times_.uploading);
  return {};
}

Result<void> BlockSearch::process(const StoredRows& chunk, const ValueStats& stats,
                                  std::size_t first_row, const NextChunk* next) {
  auto done = search_chunk(chunk, stats, first_row, next);
  // A chunk that failed (out of memory, say) is retried smaller: the memory of an upload ahead
  // goes back before the batching looks at the headroom again.
  if (!done) ahead_.reset();
  return done;
}

Result<void> BlockSearch::search_chunk(const StoredRows& chunk, const ValueStats& stats,
                                       std::size_t first_row, const NextChunk* next) {
  if (auto ok = check_fp16_span(chunk, stats, first_row); !ok) return ok;
  StepClock clock(device_);
  const Arithmetic a = arithmetic_for(stats);
  auto on_device = chunk_on_device(chunk, a);
  if (!on_device) return std::unexpected(on_device.error());
  auto queries = block_queries(a);
  if (!queries) return std::unexpected(queries.error());
  if (auto ok = clock.lap(times_.uploading); !ok) return ok;
  if (next && options_.upload_ahead) upload_ahead(*next);
  // Positions in the block of the queries still to prove, and the bounds for them.
  std::vector<std::size_t> subset;
  auto row_bounds = options_.fast ? std::vector<double>{} : bounds(a, stats, subset);
  // Where the device's distances are exact, k candidates prove a chunk (a tie at the k-th goes
  // to the smaller row, already in the list); else k + 32 to start with.
  const bool exact_everywhere =
      std::all_of(row_bounds.begin(), row_bounds.end(), [](double b) { return b == 0; });
  std::size_t capacity = std::min(
      options_.fast || exact_everywhere ? options_.k : first_candidates(options_.k), chunk.rows);
  const double unit = distance_unit(a, options_.metric);
  auto found = candidates(**queries, *on_device, capacity, subset, row_bounds, unit);
  if (!found) return std::unexpected(found.error());
  clock.host_lap(times_.searching);
  if (options_.fast) {
    lists_.fold_fast(*found, first_row);
    clock.host_lap(times_.merging);
    return {};
  }
  (a.integer ? counts_.integer_chunks : counts_.float_chunks) += 1;
  auto failed = lists_.fold_exact(*found, {}, row_bounds, queries_, first_, chunk, first_row,
                                  options_.metric, counts_.fold);
  clock.host_lap(times_.merging);
  while (!failed.empty()) {
    std::vector<std::size_t> next(failed.size());
    for (std::size_t i = 0; i < failed.size(); ++i)
      next[i] = subset.empty() ? failed[i] : subset[failed[i]];
    subset = std::move(next);
    if (capacity >= kMaxK || capacity >= chunk.rows) {
      // knn cannot hand out more: every row of the chunk for these queries, in fp64.
      for (std::size_t q : subset)
        lists_.fold_all_rows(q, queries_, first_, chunk, first_row, options_.metric, counts_.fold);
      counts_.exhaustive_queries += subset.size();
      clock.host_lap(times_.merging);
      break;
    }
    capacity = std::min({capacity * 4, kMaxK, chunk.rows});
    counts_.widened_queries += subset.size();
    auto few = queries_on_device(a, subset);
    if (!few) return std::unexpected(few.error());
    row_bounds = bounds(a, stats, subset);
    auto more = candidates(*few, *on_device, capacity, subset, row_bounds, unit);
    if (!more) return std::unexpected(more.error());
    clock.host_lap(times_.searching);
    failed = lists_.fold_exact(*more, subset, row_bounds, queries_, first_, chunk, first_row,
                               options_.metric, counts_.fold);
    clock.host_lap(times_.merging);
  }
  share_kth();
  return {};
}

}  // namespace gpupool::exact
