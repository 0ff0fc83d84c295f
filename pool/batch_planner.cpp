// BatchPlanner: the batch-size policy of gpupool:batching (first size from the headroom,
// bisection on out-of-memory, growth capped by failures at comparable headroom), and the
// estimate of bytes per item for items of uneven length.
module;
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <optional>
#include <vector>
module gpupool;

namespace gpupool {

Result<BatchPlanner> BatchPlanner::create(PlannerConfig config) {
  if (!(config.growth_factor >= 1.2 && config.growth_factor <= 2.0))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("growth_factor is {}: expected a value in [1.2, 2]", config.growth_factor));
  if (config.grow_after == 0)
    return make_error(ErrorKind::InvalidInput, "grow_after is 0: expected at least 1 success");
  if (config.max_retries == 0)
    return make_error(ErrorKind::InvalidInput, "max_retries is 0: expected at least 1");
  if (config.max_batch_size == 0)
    return make_error(ErrorKind::InvalidInput, "max_batch_size is 0: expected at least 1 item");
  if (!(config.comparable_headroom >= 1.0 && std::isfinite(config.comparable_headroom)))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("comparable_headroom is {}: expected a finite value >= 1",
                                  config.comparable_headroom));
  return BatchPlanner(config);
}

std::size_t BatchPlanner::clamp(std::size_t size) const noexcept {
  return std::clamp<std::size_t>(size, 1, config_.max_batch_size);
}

// How close below a failed size is close enough: 1/8 of the size, at least 1 item. Each step
// closer costs a failure and, on a GPU, a fresh allocation of the good size afterwards (the
// failure trims the cache): milliseconds for blocks of gigabytes, for at most 12% more items.
std::size_t BatchPlanner::tolerance(std::size_t size) noexcept { return std::max<std::size_t>(1, size / 8); }

std::size_t BatchPlanner::size_for_headroom(std::size_t headroom_bytes, double safety_fraction,
                                            std::size_t bytes_per_item) const noexcept {
  if (bytes_per_item == 0) return config_.max_batch_size;
  long double items = static_cast<long double>(headroom_bytes) * safety_fraction /
                      static_cast<long double>(bytes_per_item);
  if (items >= static_cast<long double>(SIZE_MAX)) return config_.max_batch_size;
  return clamp(static_cast<std::size_t>(items));
}

void BatchPlanner::start(std::size_t size) noexcept {
  size_ = clamp(size);
  successes_in_a_row_ = 0;
}

void BatchPlanner::observe_headroom(std::size_t headroom_bytes) noexcept {
  headroom_ = headroom_bytes;
  if (reference_headroom_ == 0) {
    reference_headroom_ = headroom_bytes;
    return;
  }
  const long double now = static_cast<long double>(headroom_bytes);
  const long double before = static_cast<long double>(reference_headroom_);
  if (now * config_.comparable_headroom < before) {
    // Less memory than the size was proven with: shrink in proportion rather than wait for an
    // out-of-memory error, and stop counting the old successes as evidence.
    size_ = clamp(static_cast<std::size_t>(static_cast<long double>(size_) * now / before));
    last_success_.reset();
    successes_in_a_row_ = 0;
    reference_headroom_ = headroom_bytes;
  } else if (now > before * config_.comparable_headroom) {
    reference_headroom_ = headroom_bytes;  // more memory: ceiling() lets old failures go
  }
}

std::optional<std::size_t> BatchPlanner::ceiling() const noexcept {
  std::optional<std::size_t> lowest;
  for (const Failure& failure : failures_) {
    bool comparable = headroom_ == 0 || static_cast<long double>(headroom_) <=
                                            static_cast<long double>(failure.headroom) *
                                                config_.comparable_headroom;
    if (comparable && (!lowest || failure.size < *lowest)) lowest = failure.size;
  }
  return lowest;
}

void BatchPlanner::on_success(std::size_t size) noexcept {
  consecutive_failures_ = 0;
  last_success_ = size;
  ++successes_in_a_row_;
  const std::optional<std::size_t> cap = ceiling();
  // Below a known failure a success is evidence enough to bisect upwards at once; into the
  // unknown, grow only after a run of successes.
  const std::size_t needed = cap ? 1 : config_.grow_after;
  if (successes_in_a_row_ < needed || size < size_) return;
  std::size_t grown = clamp(static_cast<std::size_t>(
      std::ceil(static_cast<long double>(size_) * config_.growth_factor)));
  if (cap) {
    if (*cap <= size_ + tolerance(size_)) return;  // close enough: stay
    grown = std::min(grown, size_ + (*cap - size_) / 2);
  }
  if (fit_estimate_) grown = std::min(grown, clamp(*fit_estimate_));
  if (grown > size_) {
    size_ = grown;
    successes_in_a_row_ = 0;
  }
}

OomDecision BatchPlanner::on_out_of_memory(std::size_t size) noexcept {
  ++retries_;
  ++consecutive_failures_;
  successes_in_a_row_ = 0;
  if (size <= 1) return OomDecision::FailedAtOne;
  if (consecutive_failures_ >= config_.max_retries) return OomDecision::RetriesExhausted;
  if (last_success_ && *last_success_ >= size && consecutive_failures_ == 1) {
    // This size or a larger one just worked at comparable headroom: a passing failure, not a
    // limit. Keep the size (the trim may be all it needed) and record nothing; if it fails
    // again, last_success_ is gone and it counts.
    last_success_.reset();
    return OomDecision::Retry;
  }
  remember_failure(size);
  if (last_success_ && *last_success_ < size) {
    // Bisect; once the interval is within the tolerance growth stops at, take the known-good
    // end rather than spend more failures on the last few percent.
    const std::size_t gap = size - *last_success_;
    size_ = gap <= tolerance(*last_success_) ? *last_success_ : clamp(*last_success_ + gap / 2);
  } else {
    size_ = clamp(size / 2);  // nothing smaller is known to fit: halve
  }
  return OomDecision::Retry;
}

// Keeps the list short: a failure that is smaller at no less headroom makes an older one
// redundant (whenever the older applies, the new one does and caps lower).
void BatchPlanner::remember_failure(std::size_t size) {
  std::erase_if(failures_, [&](const Failure& f) { return f.size >= size && f.headroom <= headroom_; });
  failures_.push_back({size, headroom_});
}

// ---- the estimate for items of uneven length -------------------------------------------------

void LengthStats::add(std::size_t length) noexcept {
  ++count;
  double x = static_cast<double>(length);
  sum += x;
  sum_of_squares += x * x;
  max = std::max(max, length);
}

double LengthStats::mean() const noexcept { return count ? sum / static_cast<double>(count) : 0.0; }

double LengthStats::coefficient_of_variation() const noexcept {
  double m = mean();
  if (count == 0 || m == 0) return 0.0;
  double variance = std::max(0.0, sum_of_squares / static_cast<double>(count) - m * m);
  return std::sqrt(variance) / m;
}

std::size_t estimate_bytes_per_item(std::size_t probe_bytes, const LengthStats& probe,
                                    const LengthStats& population) noexcept {
  if (probe_bytes == 0 || probe.sum <= 0) return 0;
  const double bytes_per_unit = static_cast<double>(probe_bytes) / probe.sum;
  const double mean = population.mean();
  // Lengths that vary little: size for the mean. Otherwise bias towards the longest items,
  // which are the ones that run out of memory.
  const double length = population.coefficient_of_variation() < 0.1
                            ? mean
                            : 0.7 * mean + 0.3 * static_cast<double>(population.max);
  return std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(bytes_per_unit * length)));
}

}  // namespace gpupool
