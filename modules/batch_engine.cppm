// gpupool:batch_engine — the loop behind process_in_batches and DeviceBatches: its options,
// progress and report (exported), and the engine itself (gpupool::batching_detail, not exported:
// an interface partition only because the templates are instantiated in the caller's code).
module;
#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <expected>
#include <functional>
#include <iterator>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>
export module gpupool:batch_engine;
import :error;
import :units;
import :precision;
import :device;
import :buffer;
import :pool;
import :batch_planner;

export namespace gpupool {

// ---- Progress (pool/progress.cpp) -------------------------------------------------------------

struct BatchProgress {
  std::size_t items_done = 0;
  std::optional<std::size_t> items_total;  // nullopt for streams of unknown length
  std::size_t batches_done = 0;
  std::size_t batch_size = 0;       // the size of the batch just done
  std::size_t retries = 0;          // out-of-memory retries so far
  double items_per_second = 0;      // items done ÷ seconds since the call began
};
using ProgressCallback = std::function<void(const BatchProgress&)>;

enum class ProgressStyle : std::uint8_t {
  Auto,  // a bar when the stream is a terminal, log lines otherwise
  Bar,   // one line redrawn in place (\r)
  Lines  // a log line at most every `interval`, and one at the end
};

// "[#########-----------]  45.0%  450/1000 items  batch 64  retries 2  1.2k items/s"
std::string format_progress_bar(const BatchProgress& progress, std::size_t width = 30);
// "batching: 450/1000 items (45.0%), 7 batches, batch size 64, 2 retries, 1234.5 items/s"
std::string format_progress_line(const BatchProgress& progress);

// A ProgressCallback for tools: writes to `out` (stderr by default) in `style`.
ProgressCallback terminal_progress(std::FILE* out = stderr, ProgressStyle style = ProgressStyle::Auto,
                                   std::chrono::milliseconds interval = std::chrono::seconds(5));

// ---- Options and report ---------------------------------------------------------------------

struct BatchingOptions {
  std::optional<std::size_t> batch_size;      // the first size; nullopt = plan from the headroom
  // Device bytes f needs per item; nullopt = measure them on a probe batch of probe_items items
  // through the pool's peak in-use bytes. Every batch is measured that way (for the planner's
  // fit estimate), so the device's peak statistics are reset before each batch (begin_phase).
  std::optional<std::size_t> bytes_per_item;
  std::size_t probe_items = 4;
  double safety_fraction = 0.8;               // share of the headroom the first size may use
  PlannerConfig planner;
  std::size_t max_item_length = std::size_t{1} << 24;  // elements per item (sized items only)
  ProgressCallback on_progress;
  // What the items are, for messages: "batch of queries 0..9" (singular and plural).
  std::string item_name = "item", items_name = "items";
};

struct BatchingReport {
  std::size_t items = 0;
  std::size_t batches = 0;               // successful calls of f
  std::size_t retries = 0;               // out-of-memory failures recovered from
  std::size_t first_batch_size = 0;      // planned after the probe (or given)
  std::size_t final_batch_size = 0;      // the planner's size at the end
  std::size_t largest_batch = 0;         // the most items one successful call got
  std::size_t bytes_per_item = 0;        // given or measured (0: the probe used no pool memory)
};

template <class R>
struct BatchedResults {
  std::vector<R> results;  // one per input item, in input order
  BatchingReport report;
};

// The view of one batch that f receives.
template <class Items, class Targets>
struct Batch {
  Items items;             // a slice of the input, or the buffered items of a stream
  Targets targets;         // the matching targets (empty when there are none)
  std::size_t first = 0;   // index of items[0] in the whole input
  std::size_t size() const { return static_cast<std::size_t>(std::ranges::size(items)); }
  std::size_t end_index() const { return first + size(); }
};

// Passed where there are no targets.
struct NoTargets {};

}  // namespace gpupool

namespace gpupool::batching_detail {

// The device's peak in-use bytes since begin_phase, read without stats()'s pass over every size
// class (it runs once per batch, between the batches' device work).
std::size_t peak_in_use_bytes(const GpuMemoryPool& pool, const Device& device);

// Length of an item for validation and the uneven-size rule: its element count when it is a
// sized range, else 1 (scalars, structs).
template <class Item>
std::size_t item_length(const Item& item) {
  if constexpr (std::ranges::sized_range<const Item>)
    return static_cast<std::size_t>(std::ranges::size(item));
  else
    return 1;
}

template <class Item>
Result<void> validate_item(const Item& item, std::size_t index, const BatchingOptions& options) {
  if constexpr (std::ranges::sized_range<const Item>) {
    std::size_t length = item_length(item);
    if (length == 0)
      return make_error(ErrorKind::InvalidInput,
                        "item " + std::to_string(index) + " is empty: expected at least 1 element");
    if (length > options.max_item_length)
      return make_error(ErrorKind::InvalidInput,
                        "item " + std::to_string(index) + " has " + std::to_string(length) +
                            " elements: expected at most max_item_length = " +
                            std::to_string(options.max_item_length));
  }
  return {};
}

template <class Targets>
Result<void> validate_targets(const Targets& targets) {
  std::size_t index = 0;
  for (const auto& value : targets) {
    if (!std::isfinite(static_cast<double>(value)))
      return make_error(ErrorKind::InvalidInput,
                        "target " + std::to_string(index) + " is " +
                            std::to_string(static_cast<double>(value)) + ": expected a finite number");
    ++index;
  }
  return {};
}

Result<void> validate_options(const BatchingOptions& options);
// "item 5" or "items 5..9" (or the names given).
std::string describe_items(std::size_t first, std::size_t count, std::string_view item = "item",
                           std::string_view items = "items");

// The targets of a batch: a subrange of the caller's random-access targets (nothing copied).
template <class Targets>
auto target_slice(const Targets& targets, std::size_t first, std::size_t count) {
  if constexpr (std::is_same_v<Targets, NoTargets>) {
    (void)first, (void)count;
    return NoTargets{};
  } else {
    auto begin = std::ranges::begin(targets) + static_cast<std::ptrdiff_t>(first);
    return std::ranges::subrange(begin, begin + static_cast<std::ptrdiff_t>(count));
  }
}

template <class Targets>
std::optional<std::size_t> target_count(const Targets& targets) {
  if constexpr (std::is_same_v<Targets, NoTargets>) return std::nullopt;
  else return static_cast<std::size_t>(std::ranges::size(targets));
}

// A random-access sized range: batches are subranges of it, nothing is copied.
template <class Range, class Targets>
class SlicedSource {
 public:
  SlicedSource(Range& range, const Targets& targets) : range_(range), targets_(targets) {}
  std::optional<std::size_t> total() const { return static_cast<std::size_t>(std::ranges::size(range_)); }

  Result<void> validate(const BatchingOptions& options, LengthStats& population) {
    std::size_t n = *total();
    if (n == 0) return make_error(ErrorKind::InvalidInput, "the input is empty: expected at least 1 item");
    if (auto count = target_count(targets_); count && *count != n)
      return make_error(ErrorKind::InvalidInput,
                        "the input has " + std::to_string(n) + " items but " +
                            std::to_string(*count) + " targets: expected one target per item");
    if constexpr (!std::is_same_v<Targets, NoTargets>)
      if (auto ok = validate_targets(targets_); !ok) return ok;
    // Only items with a length have anything to check; a pass over millions of scalars would
    // cost more than the batching it prepares.
    if constexpr (std::ranges::sized_range<const std::ranges::range_value_t<Range>>) {
      std::size_t index = 0;
      for (const auto& item : range_) {
        if (auto ok = validate_item(item, index++, options); !ok) return ok;
        population.add(item_length(item));
      }
    }
    return {};
  }

  // Nothing to read ahead: the items are all there.
  Result<void> fill(std::size_t, std::size_t, const BatchingOptions&) { return {}; }
  // How many of the next `count` items from `done` there are (fewer at the end).
  std::size_t available(std::size_t done, std::size_t count) const { return std::min(count, *total() - done); }
  auto batch(std::size_t done, std::size_t count) const {
    auto begin = std::ranges::begin(range_) + static_cast<std::ptrdiff_t>(done);
    using Items = decltype(std::ranges::subrange(begin, begin));
    using TargetView = decltype(target_slice(targets_, 0, 0));
    return Batch<Items, TargetView>{std::ranges::subrange(begin, begin + static_cast<std::ptrdiff_t>(count)),
                                    target_slice(targets_, done, count), done};
  }
  void consume(std::size_t) {}
  bool exhausted(std::size_t done) const { return done >= *total(); }
  LengthStats sample(std::size_t done, std::size_t count) const {
    LengthStats stats;
    auto slice = batch(done, count);
    for (const auto& item : slice.items) stats.add(item_length(item));
    return stats;
  }

 private:
  Range& range_;
  const Targets& targets_;
};

// Any other input range: read once, front to back. Items read but not yet done by a successful
// call of f stay in `buffer_` (at most the largest batch asked for); nothing else is kept.
template <class Range, class Targets>
class StreamSource {
 public:
  using Item = std::ranges::range_value_t<Range>;
  StreamSource(Range& range, const Targets& targets)
      : range_(range), targets_(targets), it_(std::ranges::begin(range)) {}
  std::optional<std::size_t> total() const { return std::nullopt; }

  Result<void> validate(const BatchingOptions&, LengthStats&) {
    if (it_ == std::ranges::end(range_))
      return make_error(ErrorKind::InvalidInput, "the input is empty: expected at least 1 item");
    if constexpr (!std::is_same_v<Targets, NoTargets>)
      if (auto ok = validate_targets(targets_); !ok) return ok;
    return {};
  }

  // Reads items until `count` are buffered from `done` on (or the stream ends). Each item is
  // validated as it arrives.
  Result<void> fill(std::size_t done, std::size_t count, const BatchingOptions& options) {
    while (buffer_.size() < count && it_ != std::ranges::end(range_)) {
      std::size_t index = done + buffer_.size();
      Item item = *it_;
      ++it_;
      if (auto ok = validate_item(item, index, options); !ok) return std::unexpected(ok.error());
      if (auto limit = target_count(targets_); limit && index >= *limit)
        return make_error(ErrorKind::InvalidInput,
                          "the input has more items than the " + std::to_string(*limit) +
                              " targets (item " + std::to_string(index) +
                              " has none): expected one target per item");
      buffer_.push_back(std::move(item));
    }
    if (it_ == std::ranges::end(range_))
      if (auto limit = target_count(targets_); limit && done + buffer_.size() < *limit)
        return make_error(ErrorKind::InvalidInput,
                          "the input ended after " + std::to_string(done + buffer_.size()) +
                              " items but there are " + std::to_string(*limit) +
                              " targets: expected one target per item");
    return {};
  }
  std::size_t available(std::size_t, std::size_t count) const { return std::min(count, buffer_.size()); }
  auto batch(std::size_t done, std::size_t count) const {
    using TargetView = decltype(target_slice(targets_, 0, 0));
    return Batch<std::span<const Item>, TargetView>{std::span<const Item>(buffer_.data(), count),
                                                    target_slice(targets_, done, count), done};
  }
  // A successful batch of `count` items: they leave the buffer.
  void consume(std::size_t count) {
    buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(count));
  }
  bool exhausted(std::size_t) const { return buffer_.empty() && it_ == std::ranges::end(range_); }
  LengthStats sample(std::size_t, std::size_t count) const {
    LengthStats stats;
    for (std::size_t i = 0; i < std::min(count, buffer_.size()); ++i) stats.add(item_length(buffer_[i]));
    return stats;
  }

 private:
  Range& range_;
  const Targets& targets_;
  std::ranges::iterator_t<Range> it_;
  std::vector<Item> buffer_;
};

// The progress figures the loop keeps.
class ProgressTracker {
 public:
  ProgressTracker(const ProgressCallback& callback, std::optional<std::size_t> total)
      : callback_(callback), start_(std::chrono::steady_clock::now()) {
    progress_.items_total = total;
  }
  void batch_done(std::size_t size, std::size_t retries) {
    progress_.items_done += size;
    ++progress_.batches_done;
    progress_.batch_size = size;
    progress_.retries = retries;
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    progress_.items_per_second = seconds > 0 ? static_cast<double>(progress_.items_done) / seconds : 0;
    if (callback_) callback_(progress_);
  }

 private:
  const ProgressCallback& callback_;
  std::chrono::steady_clock::time_point start_;
  BatchProgress progress_;
};

// Runs f on one batch; an exception from f becomes an error (none crosses the public API).
template <class F, class BatchT>
auto call_batch_function(F& f, const BatchT& batch) -> std::invoke_result_t<F&, const BatchT&> {
  try {
    return std::invoke(f, batch);
  } catch (const std::exception& e) {
    return make_error(ErrorKind::InvalidState,
                      "the batch function threw on " + describe_items(batch.first, batch.size()) +
                          ": " + e.what() + " (expected it to return a GpuError instead)");
  } catch (...) {
    return make_error(ErrorKind::InvalidState,
                      "the batch function threw a non-standard exception on " +
                          describe_items(batch.first, batch.size()));
  }
}

// Device bytes a call used beyond what was in use before it: the pool's peak in-use since
// begin_phase, minus the bytes in use when it began (measured with the headroom just before,
// which saves a pass over the pool's statistics per batch).
class PeakProbe {
 public:
  PeakProbe(GpuMemoryPool& pool, const Device& device, std::size_t in_use_before)
      : pool_(pool), device_(device), in_use_before_(in_use_before) {
    pool_.begin_phase(device_);
  }
  std::size_t bytes_used() const {
    std::size_t peak = peak_in_use_bytes(pool_, device_);
    return peak > in_use_before_ ? peak - in_use_before_ : 0;
  }

 private:
  GpuMemoryPool& pool_;
  const Device& device_;
  std::size_t in_use_before_ = 0;
};

GpuError give_up_error(OomDecision decision, const GpuError& cause, std::size_t first,
                       std::size_t size, std::size_t retries, std::string_view item = "item",
                       std::string_view items = "items");
// The first planned size for this headroom (measured after the probe, when there was one).
std::size_t first_planned_size(const MemoryHeadroom& headroom, const BatchPlanner& planner,
                               const BatchingOptions& options, std::size_t bytes_per_item);

// The one batching loop, over either source; `emit(first, results)` takes each batch's results.
template <class Source, class F, class Emit>
Result<BatchingReport> run_batches(GpuMemoryPool& pool, const Device& device, F& f, Source& source,
                                   Emit&& emit, const BatchingOptions& options) {
  if (auto ok = validate_options(options); !ok) return std::unexpected(ok.error());
  LengthStats population;
  if (auto ok = source.validate(options, population); !ok) return std::unexpected(ok.error());
  auto planner = BatchPlanner::create(options.planner);
  if (!planner) return std::unexpected(planner.error());

  BatchingReport report;
  ProgressTracker progress(options.on_progress, source.total());
  // Without a given size or bytes per item, the first batch is a probe that measures them.
  bool probing = !options.batch_size && !options.bytes_per_item;
  if (options.batch_size) {
    planner->start(*options.batch_size);
  } else if (options.bytes_per_item) {
    auto headroom = memory_headroom(pool, device);
    if (!headroom) return std::unexpected(headroom.error());
    planner->start(first_planned_size(*headroom, *planner, options, *options.bytes_per_item));
    report.bytes_per_item = *options.bytes_per_item;
  } else {
    planner->start(options.probe_items);
  }
  report.first_batch_size = planner->size();

  std::size_t done = 0;
  while (!source.exhausted(done)) {
    auto headroom = memory_headroom(pool, device);
    if (!headroom) return std::unexpected(headroom.error());
    planner->observe_headroom(headroom->bytes);
    if (auto ok = source.fill(done, planner->size(), options); !ok) return std::unexpected(ok.error());
    const std::size_t size = source.available(done, planner->size());
    if (size == 0) break;
    auto batch = source.batch(done, size);

    PeakProbe probe(pool, device, headroom->pool_in_use);
    auto results = call_batch_function(f, batch);
    if (!results) {
      if (!results.error().is_out_of_memory())
        return std::unexpected(results.error().with_context(
            "batch of " + describe_items(done, size, options.item_name, options.items_name)));
      pool.trim(device);  // what the failed call left cached would otherwise stay held
      OomDecision decision = planner->on_out_of_memory(size);
      if (decision != OomDecision::Retry)
        return std::unexpected(give_up_error(decision, results.error(), done, size, planner->retries(),
                                             options.item_name, options.items_name));
      continue;
    }
    if (results->size() != size)
      return make_error(ErrorKind::InvalidInput,
                        "the batch function returned " + std::to_string(results->size()) +
                            " results for " +
                            describe_items(done, size, options.item_name, options.items_name) +
                            ": expected one result per item (" + std::to_string(size) + ")");
    const std::size_t used = probe.bytes_used();
    if (probing) {
      LengthStats probed = source.sample(done, size);
      report.bytes_per_item = estimate_bytes_per_item(used, probed, population.count ? population : probed);
    }
    if (used > 0) planner->set_fit_estimate(headroom->bytes / ((used + size - 1) / size));
    if (auto ok = emit(done, std::move(*results)); !ok) return std::unexpected(ok.error());
    source.consume(size);
    done += size;
    ++report.batches;
    report.largest_batch = std::max(report.largest_batch, size);
    if (probing) {
      probing = false;
      auto after_probe = memory_headroom(pool, device);
      if (!after_probe) return std::unexpected(after_probe.error());
      planner->start(first_planned_size(*after_probe, *planner, options, report.bytes_per_item));
      report.first_batch_size = planner->size();
    } else {
      planner->on_success(size);
    }
    progress.batch_done(size, planner->retries());
  }
  report.items = done;
  report.retries = planner->retries();
  report.final_batch_size = planner->size();
  return report;
}

template <class Range, class Targets>
auto make_source(Range& inputs, const Targets& targets) {
  if constexpr (std::ranges::random_access_range<Range> && std::ranges::sized_range<Range>)
    return SlicedSource<Range, Targets>(inputs, targets);
  else
    return StreamSource<Range, Targets>(inputs, targets);
}

template <class Range, class Targets>
using SourceOf = decltype(make_source(std::declval<Range&>(), std::declval<const Targets&>()));

// R of f's Result<std::vector<R>>.
template <class F, class Range, class Targets>
using ResultOf = typename std::invoke_result_t<
    F&, decltype(std::declval<const SourceOf<Range, Targets>&>().batch(0, 0))>::value_type::value_type;

template <class F, class Range, class Targets>
Result<BatchedResults<ResultOf<F, Range, Targets>>> collect(GpuMemoryPool& pool, const Device& device,
                                                          F& f, Range& inputs, const Targets& targets,
                                                          const BatchingOptions& options) {
  using R = ResultOf<F, Range, Targets>;
  BatchedResults<R> out;
  auto source = make_source(inputs, targets);
  if (auto total = source.total()) out.results.reserve(*total);
  auto emit = [&out](std::size_t, std::vector<R>&& results) -> Result<void> {
    // Batches run in input order and each is emitted once, so appending keeps the order.
    out.results.insert(out.results.end(), std::make_move_iterator(results.begin()),
                       std::make_move_iterator(results.end()));
    return {};
  };
  auto report = run_batches(pool, device, f, source, emit, options);
  if (!report) return std::unexpected(report.error());
  out.report = *report;
  return out;
}

template <class F, class Range, class Targets, class Sink>
Result<BatchingReport> drain(GpuMemoryPool& pool, const Device& device, F& f, Range& inputs,
                             const Targets& targets, Sink& sink, const BatchingOptions& options) {
  using R = ResultOf<F, Range, Targets>;
  auto source = make_source(inputs, targets);
  auto emit = [&sink](std::size_t first, std::vector<R>&& results) -> Result<void> {
    return std::invoke(sink, first, std::move(results));
  };
  return run_batches(pool, device, f, source, emit, options);
}

}  // namespace gpupool::batching_detail
