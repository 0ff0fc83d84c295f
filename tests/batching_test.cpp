#include <catch2/catch.hpp>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <iterator>
#include <limits>
#include <numeric>
#include <optional>
#include <ranges>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {

constexpr std::size_t kItemBytes = 4096;  // device bytes the test work needs per item

Device sim(std::size_t capacity) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  return *device;
}

PlannerConfig planner_config(PlannerConfig config = {}) { return config; }

BatchPlanner planner(PlannerConfig config = {}) {
  auto made = BatchPlanner::create(config);
  REQUIRE(made);
  return *made;
}

std::vector<std::int64_t> iota_items(std::size_t n) {
  std::vector<std::int64_t> items(n);
  std::iota(items.begin(), items.end(), std::int64_t{1000});
  return items;
}

// The largest batch of the test work that fits on a fresh device of this capacity (under this
// pool limit): found by allocating, so it includes the pool's size-class rounding.
std::size_t largest_fitting(std::size_t capacity, std::optional<std::size_t> limit = std::nullopt) {
  Device device = sim(capacity);
  GpuMemoryPool pool({.max_pool_size = limit, .caching = false});
  std::size_t lo = 0, hi = capacity / kItemBytes + 1;  // lo fits (0 trivially), hi does not
  while (hi - lo > 1) {
    std::size_t mid = lo + (hi - lo) / 2;
    if (pool.allocate_bytes(device, mid * kItemBytes, device.default_stream())) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Work whose device memory grows linearly with the batch: one buffer of kItemBytes per item,
// the items uploaded into it and read back, each result = 3 × item + 1. It records every
// successful call so tests can check that each item went to exactly one of them.
struct RecordingWork {
  GpuMemoryPool& pool;
  Device device;
  std::vector<std::size_t> handed;  // per item: successful calls that got it
  std::vector<std::size_t> batch_sizes;
  std::size_t failures = 0;

  RecordingWork(GpuMemoryPool& p, Device d, std::size_t n) : pool(p), device(std::move(d)), handed(n, 0) {}

  template <class BatchT>
  Result<std::vector<std::int64_t>> operator()(const BatchT& batch) {
    auto buffer = pool.allocate_bytes(device, batch.size() * kItemBytes, device.default_stream());
    if (!buffer) {
      ++failures;
      return std::unexpected(buffer.error());
    }
    std::vector<std::int64_t> host(batch.items.begin(), batch.items.end());
    if (auto ok = buffer->upload(std::as_bytes(std::span(host))); !ok) return std::unexpected(ok.error());
    std::vector<std::int64_t> back(host.size(), -1);  // poisoned first
    if (auto ok = buffer->download(std::as_writable_bytes(std::span(back))); !ok)
      return std::unexpected(ok.error());
    for (auto& value : back) value = 3 * value + 1;
    for (std::size_t i = batch.first; i < batch.end_index(); ++i) ++handed[i];
    batch_sizes.push_back(batch.size());
    return back;
  }
};

void check_exactly_once_in_order(const std::vector<std::int64_t>& items,
                                 const std::vector<std::int64_t>& results, const RecordingWork& work) {
  REQUIRE(results.size() == items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    INFO("item " << i);
    REQUIRE(results[i] == 3 * items[i] + 1);
    REQUIRE(work.handed[i] == 1);
  }
}

// An input range that can be read once only (an input iterator, not forward): a stand-in for a
// generator or a file reader. It counts what it produced.
class CountingStream {
 public:
  explicit CountingStream(std::size_t n) : n_(n) {}
  class iterator {
   public:
    using value_type = std::int64_t;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(CountingStream* s) : s_(s) {}
    std::int64_t operator*() const { return static_cast<std::int64_t>(s_->next_) * 7; }
    iterator& operator++() {
      ++s_->next_;
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.s_->next_ >= it.s_->n_; }

   private:
    CountingStream* s_ = nullptr;
  };
  iterator begin() { return iterator(this); }
  std::default_sentinel_t end() { return {}; }
  std::size_t produced() const { return next_; }  // items read so far

 private:
  std::size_t n_;
  std::size_t next_ = 0;
};
static_assert(std::ranges::input_range<CountingStream>);
static_assert(!std::ranges::forward_range<CountingStream>);

}  // namespace

// ---- The planner, with no device --------------------------------------------------------------

TEST_CASE("planner: the first size is headroom x safety / bytes per item, clamped", "[batching]") {
  BatchPlanner p = planner({.max_batch_size = 1000});
  CHECK(p.size_for_headroom(1000 * 100, 0.8, 100) == 800);
  CHECK(p.size_for_headroom(10, 0.8, 100) == 1);          // never 0
  CHECK(p.size_for_headroom(1ull << 40, 0.8, 1) == 1000);  // the configured maximum
  CHECK(p.size_for_headroom(12345, 0.8, 0) == 1000);        // unknown bytes: no memory bound
}

TEST_CASE("planner: halves when nothing succeeded, bisects towards the last success", "[batching]") {
  BatchPlanner p = planner();
  p.start(1000);
  CHECK(p.on_out_of_memory(1000) == OomDecision::Retry);
  CHECK(p.size() == 500);
  p.on_success(500);
  CHECK(p.ceiling() == std::optional<std::size_t>(1000));
  CHECK(p.size() == 750);  // below a known failure, one success bisects upwards
  CHECK(p.on_out_of_memory(750) == OomDecision::Retry);
  CHECK(p.size() == 625);  // between the last success (500) and the failure (750)
  CHECK(p.ceiling() == std::optional<std::size_t>(750));
  CHECK(p.retries() == 2);
}

TEST_CASE("planner: grows after a run of successes, never to a size that failed", "[batching]") {
  BatchPlanner p = planner({.growth_factor = 2.0, .grow_after = 3});
  p.observe_headroom(1 << 20);
  p.start(10);
  p.on_success(10);
  p.on_success(10);
  CHECK(p.size() == 10);
  p.on_success(10);
  CHECK(p.size() == 20);
  CHECK(p.on_out_of_memory(20) == OomDecision::Retry);
  CHECK(p.size() == 15);
  for (int i = 0; i < 50; ++i) {
    p.on_success(p.size());
    REQUIRE(p.size() < 20);
  }
  CHECK(p.size() >= 18);
}

TEST_CASE("planner: failures stop capping when the headroom rises, the size shrinks with it", "[batching]") {
  BatchPlanner p = planner({.growth_factor = 1.5, .grow_after = 1});
  p.observe_headroom(1000);
  p.start(100);
  REQUIRE(p.on_out_of_memory(100) == OomDecision::Retry);
  REQUIRE(p.ceiling() == std::optional<std::size_t>(100));
  p.observe_headroom(1050);  // within the comparable margin: the failure still counts
  CHECK(p.ceiling() == std::optional<std::size_t>(100));
  p.observe_headroom(2000);  // twice the memory: try again
  CHECK_FALSE(p.ceiling());
  p.start(80);
  p.observe_headroom(1000);  // back down by half: shrink at once, the failure caps again
  CHECK(p.size() == 40);
  CHECK(p.ceiling() == std::optional<std::size_t>(100));
}

TEST_CASE("planner: growth stops at the fit estimate, which may move up", "[batching]") {
  BatchPlanner p = planner({.growth_factor = 2.0, .grow_after = 1});
  p.start(100);
  p.set_fit_estimate(150);
  p.on_success(100);
  CHECK(p.size() == 150);
  p.on_success(150);
  CHECK(p.size() == 150);  // no failure needed to stop here
  p.set_fit_estimate(400);
  p.on_success(150);
  CHECK(p.size() == 300);
  p.set_fit_estimate(std::nullopt);
  p.on_success(300);
  CHECK(p.size() == 600);
}

TEST_CASE("planner: gives up at size 1 and after max_retries failures in a row", "[batching]") {
  BatchPlanner one = planner();
  one.start(1);
  CHECK(one.on_out_of_memory(1) == OomDecision::FailedAtOne);

  BatchPlanner bounded = planner({.max_retries = 3});
  bounded.start(1 << 20);
  CHECK(bounded.on_out_of_memory(bounded.size()) == OomDecision::Retry);
  CHECK(bounded.on_out_of_memory(bounded.size()) == OomDecision::Retry);
  CHECK(bounded.on_out_of_memory(bounded.size()) == OomDecision::RetriesExhausted);
  bounded.on_success(bounded.size());
  CHECK(bounded.consecutive_failures() == 0);

  // A size that just worked fails: once more at that size (the trim may be all it needed), then
  // halve.
  BatchPlanner again = planner();
  again.start(100);
  again.on_success(100);
  CHECK(again.on_out_of_memory(100) == OomDecision::Retry);
  CHECK(again.size() == 100);
  CHECK_FALSE(again.ceiling());  // a passing failure is no limit
  CHECK(again.on_out_of_memory(100) == OomDecision::Retry);
  CHECK(again.size() == 50);
  CHECK(again.ceiling() == std::optional<std::size_t>(100));
}

TEST_CASE("planner: bad configurations are refused naming the field and value", "[batching]") {
  auto low = BatchPlanner::create({.growth_factor = 1.1});
  REQUIRE_FALSE(low);
  CHECK(low.error().kind() == ErrorKind::InvalidInput);
  CHECK(low.error().message().find("growth_factor is 1.1") != std::string::npos);
  CHECK_FALSE(BatchPlanner::create({.growth_factor = 2.5}));
  CHECK_FALSE(BatchPlanner::create({.grow_after = 0}));
  CHECK_FALSE(BatchPlanner::create({.max_retries = 0}));
  CHECK_FALSE(BatchPlanner::create({.max_batch_size = 0}));
  CHECK_FALSE(BatchPlanner::create({.comparable_headroom = 0.5}));
}

TEST_CASE("the per-item estimate: the mean for even lengths, biased to the longest otherwise", "[batching]") {
  LengthStats even, uneven;
  for (std::size_t length : {100, 100, 100, 100}) even.add(length);
  for (std::size_t length : {10, 10, 10, 370}) uneven.add(length);
  CHECK(even.coefficient_of_variation() == Approx(0.0));
  // The probe used 4000 bytes for 400 elements: 10 bytes per element.
  CHECK(estimate_bytes_per_item(4000, even, even) == 1000);
  // mean 100, max 370, cv > 0.1: 0.7 × 100 + 0.3 × 370 = 181 elements.
  CHECK(estimate_bytes_per_item(4000, even, uneven) == 1810);
  CHECK(estimate_bytes_per_item(0, even, even) == 0);
}

// ---- Headroom ---------------------------------------------------------------------------------

TEST_CASE("headroom: device free plus the pool's cache, within the pool limit", "[batching]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool;
  REQUIRE(memory_headroom(pool, device)->bytes == 8 * MiB);
  {
    auto held = pool.allocate_bytes(device, 1 * MiB, device.default_stream());
    REQUIRE(held);
    auto cached = pool.allocate_bytes(device, 2 * MiB, device.default_stream());
    REQUIRE(cached);
    REQUIRE(memory_headroom(pool, device)->bytes == 5 * MiB);
    cached->release();
    CHECK(pool.stats(device).cached_bytes == 2 * MiB);
    CHECK(memory_headroom(pool, device)->bytes == 7 * MiB);  // the cache counts as available
    REQUIRE(pool.set_max_pool_size(device, 4 * MiB));
    CHECK(memory_headroom(pool, device)->bytes == 3 * MiB);  // the limit minus what is in use
    CHECK(memory_headroom(pool, device)->limit_room == std::optional<std::size_t>(3 * MiB));
    // A device shrunk below what the pool caches: its free memory reads 0, and the cache counts
    // only up to the device's total beyond what is in use.
    REQUIRE(device.set_simulated_capacity(2 * MiB));
    auto shrunk = memory_headroom(pool, device);
    REQUIRE(shrunk);
    CHECK(shrunk->device_free == 0);
    CHECK(shrunk->cached == 2 * MiB);
    CHECK(shrunk->bytes == 1 * MiB);
  }
}

// ---- process_in_batches over random-access ranges ---------------------------------------------

TEST_CASE("batching: a random-access range is sliced in order, every item once, nothing copied",
          "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(3000);
  RecordingWork work(pool, device, items.size());
  bool slices_alias_input = true;
  auto f = [&](const auto& batch) {
    slices_alias_input = slices_alias_input && &*batch.items.begin() == &items[batch.first];
    return work(batch);
  };
  auto out = process_in_batches(pool, device, f, items, {.bytes_per_item = kItemBytes});
  REQUIRE(out);
  check_exactly_once_in_order(items, out->results, work);
  CHECK(slices_alias_input);
  CHECK(out->report.items == items.size());
  CHECK(out->report.batches == work.batch_sizes.size());
  const std::size_t fits = largest_fitting(4 * MiB);
  CHECK(out->report.largest_batch <= fits);
  CHECK(out->report.final_batch_size * 2 >= fits);
}

TEST_CASE("batching: for every failing allocation position, each item is done once, in order",
          "[batching]") {
  const std::size_t capacity = 1 * MiB;
  const std::size_t fits = largest_fitting(capacity);
  auto items = iota_items(2000);
  // A clean run: how many device allocations it makes (pass-through pool: one per call of f).
  std::size_t clean_allocations = 0;
  {
    Device device = sim(capacity);
    GpuMemoryPool pool({.caching = false});
    RecordingWork work(pool, device, items.size());
    auto out = process_in_batches(pool, device, work, items, {.bytes_per_item = kItemBytes});
    REQUIRE(out);
    clean_allocations = pool.stats(device).device_allocations;
  }
  REQUIRE(clean_allocations > 5);
  for (std::uint64_t position = 1; position <= clean_allocations; ++position) {
    INFO("allocation " << position << " fails");
    Device device = sim(capacity);
    GpuMemoryPool pool({.caching = false});
    REQUIRE(device.inject_faults({.fail_nth_allocation = position}));
    RecordingWork work(pool, device, items.size());
    auto out = process_in_batches(pool, device, work, items, {.bytes_per_item = kItemBytes});
    REQUIRE(out);
    check_exactly_once_in_order(items, out->results, work);
    CHECK(out->report.retries >= 1);
    CHECK(out->report.largest_batch <= fits);
    CHECK(out->report.final_batch_size <= fits);
    CHECK(out->report.final_batch_size * 2 >= fits);
  }
}

TEST_CASE("batching: capacity shrinking midway, at every batch position", "[batching]") {
  const std::size_t capacity = 2 * MiB, shrunk = 640 * KiB;
  const std::size_t fits_after = largest_fitting(shrunk);
  auto items = iota_items(8000);
  for (std::size_t shrink_at_call = 1; shrink_at_call <= 8; ++shrink_at_call) {
    INFO("the capacity shrinks during call " << shrink_at_call);
    Device device = sim(capacity);
    GpuMemoryPool pool;
    RecordingWork work(pool, device, items.size());
    std::size_t calls = 0;
    auto f = [&](const auto& batch) {
      auto result = work(batch);
      if (++calls == shrink_at_call) REQUIRE(device.set_simulated_capacity(shrunk));
      return result;
    };
    auto out = process_in_batches(pool, device, f, items, {.bytes_per_item = kItemBytes});
    REQUIRE(out);
    check_exactly_once_in_order(items, out->results, work);
    REQUIRE(calls > shrink_at_call + 2);  // batches ran after the shrink: the size had to adapt
    CHECK(out->report.final_batch_size <= fits_after);
    CHECK(out->report.final_batch_size * 2 >= fits_after);
  }
}

TEST_CASE("batching: the pool's hard limit is recovered from like out-of-memory", "[batching]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool pool({.max_pool_size = 1 * MiB});
  const std::size_t fits = largest_fitting(64 * MiB, 1 * MiB);
  auto items = iota_items(1500);
  RecordingWork work(pool, device, items.size());
  // A first size far too large: the probe is skipped and the limit is hit at once.
  auto out = process_in_batches(pool, device, work, items, {.batch_size = 1000});
  REQUIRE(out);
  check_exactly_once_in_order(items, out->results, work);
  CHECK(out->report.retries >= 1);
  CHECK(out->report.final_batch_size <= fits);
  CHECK(out->report.final_batch_size * 2 >= fits);
}

TEST_CASE("batching: the probe batch measures bytes per item through the pool", "[batching]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(5000);
  RecordingWork work(pool, device, items.size());
  auto out = process_in_batches(pool, device, work, items, {.probe_items = 4});
  REQUIRE(out);
  check_exactly_once_in_order(items, out->results, work);
  CHECK(work.batch_sizes.front() == 4);
  CHECK(out->report.bytes_per_item == kItemBytes);  // 4 × 4096 is a size class of its own
  // Headroom after the probe: the whole device (its block is cached, and cache counts).
  CHECK(out->report.first_batch_size == static_cast<std::size_t>(8 * MiB * 0.8 / kItemBytes));
  CHECK(work.batch_sizes.at(1) == out->report.first_batch_size);
}

TEST_CASE("batching: items of uneven length are planned by the longest-biased estimate", "[batching]") {
  Device device = sim(16 * MiB);
  GpuMemoryPool pool;
  std::vector<std::vector<float>> items;
  for (std::size_t i = 0; i < 400; ++i) items.push_back(std::vector<float>(i % 8 == 0 ? 1024 : 256, 1.0f));
  std::vector<std::size_t> handed(items.size(), 0);
  auto f = [&](const auto& batch) -> Result<std::vector<double>> {
    std::size_t elements = 0;
    for (const auto& item : batch.items) elements += item.size();
    auto buffer = pool.get_managed_buffer(device, elements, Precision::Fp32);
    if (!buffer) return std::unexpected(buffer.error());
    std::vector<double> sums;
    for (const auto& item : batch.items) sums.push_back(std::accumulate(item.begin(), item.end(), 0.0));
    for (std::size_t i = batch.first; i < batch.end_index(); ++i) ++handed[i];
    return sums;
  };
  auto out = process_in_batches(pool, device, f, items, {.probe_items = 8});
  REQUIRE(out);
  for (std::size_t i = 0; i < items.size(); ++i) {
    REQUIRE(out->results[i] == static_cast<double>(items[i].size()));
    REQUIRE(handed[i] == 1);
  }
  // Probe: items 0..7 = 1024 + 7 × 256 = 2816 elements in 11264 bytes (an exact class): 4 bytes
  // per element. Population: mean 352, max 1024, cv > 0.1 → 0.7 × 352 + 0.3 × 1024 = 553.6.
  CHECK(out->report.bytes_per_item == static_cast<std::size_t>(std::ceil(4 * 553.6)));
}

TEST_CASE("batching: an item that does not fit alone ends the call naming its index", "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(100);
  std::vector<std::size_t> handed(items.size(), 0);
  auto f = [&](const auto& batch) -> Result<std::vector<std::int64_t>> {
    if (batch.first <= 37 && 37 < batch.end_index())
      return make_error(ErrorKind::OutOfMemory, "item 37 needs more than the device has");
    for (std::size_t i = batch.first; i < batch.end_index(); ++i) ++handed[i];
    return std::vector<std::int64_t>(batch.size(), 0);
  };
  std::vector<std::int64_t> seen;
  auto sink = [&](std::size_t first, std::vector<std::int64_t>&& results) -> Result<void> {
    REQUIRE(first == seen.size());
    seen.insert(seen.end(), results.begin(), results.end());
    return {};
  };
  auto out = process_in_batches_into(pool, device, f, items, sink, {.batch_size = 64});
  REQUIRE_FALSE(out);
  CHECK(out.error().kind() == ErrorKind::OutOfMemory);
  CHECK(out.error().message().find("item 37 does not fit") != std::string::npos);
  CHECK(seen.size() == 37);
  for (std::size_t i = 0; i < items.size(); ++i) CHECK(handed[i] == (i < 37 ? 1u : 0u));
}

TEST_CASE("batching: out-of-memory retries in a row are bounded", "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(10000);
  std::size_t calls = 0;
  auto f = [&](const auto&) -> Result<std::vector<std::int64_t>> {
    ++calls;
    return make_error(ErrorKind::PoolLimitExceeded, "never enough");
  };
  auto out = process_in_batches(pool, device, f, items, {.batch_size = 8192, .planner = {.max_retries = 5}});
  REQUIRE_FALSE(out);
  CHECK(out.error().kind() == ErrorKind::PoolLimitExceeded);
  CHECK(out.error().message().find("max_retries") != std::string::npos);
  CHECK(out.error().message().find("items 0..") != std::string::npos);
  CHECK(calls == 5);
}

TEST_CASE("batching: other errors from f end the call with the batch's items", "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(100);
  auto failing = [&](const auto& batch) -> Result<std::vector<std::int64_t>> {
    if (batch.first >= 40) return make_error(ErrorKind::Io, "the disk went away");
    return std::vector<std::int64_t>(batch.size(), 1);
  };
  auto out = process_in_batches(pool, device, failing, items, {.batch_size = 20, .planner = {.max_batch_size = 20}});
  REQUIRE_FALSE(out);
  CHECK(out.error().kind() == ErrorKind::Io);
  CHECK(out.error().message().find("items 40..59") != std::string::npos);

  auto wrong_count = [](const auto&) -> Result<std::vector<int>> { return std::vector<int>(1, 0); };
  auto counted = process_in_batches(pool, device, wrong_count, items, {.batch_size = 10});
  REQUIRE_FALSE(counted);
  CHECK(counted.error().kind() == ErrorKind::InvalidInput);
  CHECK(counted.error().message().find("returned 1 results for items 0..9") != std::string::npos);

  auto throwing = [](const auto&) -> Result<std::vector<int>> { throw std::runtime_error("boom"); };
  auto thrown = process_in_batches(pool, device, throwing, items, {.batch_size = 10});
  REQUIRE_FALSE(thrown);
  CHECK(thrown.error().kind() == ErrorKind::InvalidState);
  CHECK(thrown.error().message().find("boom") != std::string::npos);
}

TEST_CASE("batching: bad inputs and options are refused naming the index or field", "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto ones = [](const auto& batch) -> Result<std::vector<int>> { return std::vector<int>(batch.size(), 1); };
  auto message_of = [](const auto& result) { return result ? std::string() : result.error().message(); };
  auto kind_of = [](const auto& result) { return result ? ErrorKind::Internal : result.error().kind(); };

  std::vector<int> empty;
  auto none = process_in_batches(pool, device, ones, empty);
  CHECK(kind_of(none) == ErrorKind::InvalidInput);
  CHECK(message_of(none).find("empty") != std::string::npos);

  std::vector<int> items(10, 1);
  std::vector<double> nine(9, 0.5);
  CHECK(message_of(process_in_batches(pool, device, ones, items, nine)).find("10 items but 9 targets") !=
        std::string::npos);
  std::vector<double> targets(10, 0.5);
  targets[3] = std::numeric_limits<double>::quiet_NaN();
  CHECK(message_of(process_in_batches(pool, device, ones, items, targets)).find("target 3 is nan") !=
        std::string::npos);
  targets[3] = std::numeric_limits<double>::infinity();
  CHECK(kind_of(process_in_batches(pool, device, ones, items, targets)) == ErrorKind::InvalidInput);

  std::vector<std::vector<float>> rows(8, std::vector<float>(4, 1.0f));
  rows[5].clear();
  CHECK(message_of(process_in_batches(pool, device, ones, rows)).find("item 5 is empty") != std::string::npos);
  rows[5].assign(4, 1.0f);
  rows[2].assign(100, 1.0f);
  CHECK(message_of(process_in_batches(pool, device, ones, rows, {.max_item_length = 64}))
            .find("item 2 has 100 elements: expected at most max_item_length = 64") != std::string::npos);

  CHECK(message_of(process_in_batches(pool, device, ones, items, {.batch_size = 0})).find("batch_size is 0") !=
        std::string::npos);
  CHECK(message_of(process_in_batches(pool, device, ones, items, {.safety_fraction = 1.5}))
            .find("safety_fraction is 1.5") != std::string::npos);
  CHECK(message_of(process_in_batches(pool, device, ones, items, {.planner = {.growth_factor = 3}}))
            .find("growth_factor is 3") != std::string::npos);
}

TEST_CASE("batching: targets travel with their items", "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(257);
  std::vector<double> targets;
  for (auto item : items) targets.push_back(0.5 * static_cast<double>(item));
  auto f = [](const auto& batch) -> Result<std::vector<double>> {
    std::vector<double> out;
    auto target = batch.targets.begin();
    for (auto item : batch.items) out.push_back(static_cast<double>(item) - 2 * *target++);
    return out;
  };
  auto out = process_in_batches(pool, device, f, items, targets, {.batch_size = 16});
  REQUIRE(out);
  REQUIRE(out->results.size() == items.size());
  for (double value : out->results) REQUIRE(value == 0.0);
}

TEST_CASE("batching: the progress callback reports items, batches, sizes and retries", "[batching]") {
  Device device = sim(1 * MiB);
  GpuMemoryPool pool;
  auto items = iota_items(1000);
  RecordingWork work(pool, device, items.size());
  std::vector<BatchProgress> seen;
  BatchingOptions options{.batch_size = 400, .on_progress = [&](const BatchProgress& p) { seen.push_back(p); }};
  auto out = process_in_batches(pool, device, work, items, options);
  REQUIRE(out);
  REQUIRE(seen.size() == out->report.batches);
  std::size_t done = 0;
  for (std::size_t i = 0; i < seen.size(); ++i) {
    done += work.batch_sizes[i];
    CHECK(seen[i].items_done == done);
    CHECK(seen[i].items_total == std::optional<std::size_t>(1000));
    CHECK(seen[i].batches_done == i + 1);
    CHECK(seen[i].batch_size == work.batch_sizes[i]);
    CHECK(seen[i].items_per_second > 0);
  }
  CHECK(seen.back().items_done == 1000);
  CHECK(seen.back().retries == out->report.retries);
  CHECK(out->report.retries >= 1);  // 400 items need 1.6 MiB of a 1 MiB device
  CHECK(work.failures == out->report.retries);
}

// ---- Streams ------------------------------------------------------------------------------------

TEST_CASE("batching: a stream of a million items never holds more than about two batches",
          "[batching]") {
  const std::size_t n = 1'000'000;
  Device device = sim(64 * MiB);
  GpuMemoryPool pool({.max_pool_size = 4 * MiB});
  CountingStream stream(n);
  const std::size_t bytes_per_item = 64;  // 8 int64 lanes per item on the device
  std::size_t next_expected = 0, largest_batch = 0, largest_tried = 0, most_buffered = 0, most_in_use = 0;
  bool values_right = true;
  std::vector<BatchProgress> progress;
  auto f = [&](const auto& batch) -> Result<std::vector<std::int64_t>> {
    most_buffered = std::max(most_buffered, stream.produced() - batch.first);
    largest_tried = std::max(largest_tried, batch.size());
    auto buffer = pool.allocate_bytes(device, batch.size() * bytes_per_item, device.default_stream());
    if (!buffer) return std::unexpected(buffer.error());
    most_in_use = std::max(most_in_use, pool.stats(device).in_use_bytes);
    std::vector<std::int64_t> host(batch.items.begin(), batch.items.end());
    if (auto ok = buffer->upload(std::as_bytes(std::span(host))); !ok) return std::unexpected(ok.error());
    for (auto& value : host) value += 1;
    largest_batch = std::max(largest_batch, batch.size());
    return host;
  };
  auto sink = [&](std::size_t first, std::vector<std::int64_t>&& results) -> Result<void> {
    values_right = values_right && first == next_expected;
    for (std::size_t i = 0; i < results.size(); ++i)
      values_right = values_right && results[i] == static_cast<std::int64_t>(first + i) * 7 + 1;
    next_expected = first + results.size();
    return {};
  };
  auto report = process_in_batches_into(pool, device, f, stream, sink,
                                        {.on_progress = [&](const BatchProgress& p) { progress.push_back(p); }});
  REQUIRE(report);
  CHECK(values_right);
  CHECK(next_expected == n);
  CHECK(report->items == n);
  CHECK(report->bytes_per_item == bytes_per_item);
  // The device side: at most ~two batches in use at any time (one, here: f frees its buffer).
  const std::size_t batch_bytes = largest_batch * bytes_per_item;
  CHECK(most_in_use <= 2 * batch_bytes);
  CHECK(pool.stats(device).in_use_bytes == 0);
  // The host side: items read but not yet done never exceed the largest batch tried (one that
  // failed stays buffered for the smaller retry), and that is at most twice a successful one.
  CHECK(most_buffered <= largest_tried);
  CHECK(largest_tried <= 2 * largest_batch);
  CHECK(largest_batch * 10 < n);  // it did not fit at once: the bound above means something
  REQUIRE_FALSE(progress.empty());
  CHECK_FALSE(progress.back().items_total);
  CHECK(progress.back().items_done == n);
}

TEST_CASE("batching: streams with targets check the count as they go", "[batching]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto ones = [](const auto& batch) -> Result<std::vector<int>> { return std::vector<int>(batch.size(), 1); };
  auto discard = [](std::size_t, std::vector<int>&&) -> Result<void> { return {}; };
  std::vector<double> targets(100, 1.0);
  CountingStream longer(150);
  auto too_many = process_in_batches_into(pool, device, ones, longer, targets, discard, {.batch_size = 32});
  REQUIRE_FALSE(too_many);
  CHECK(too_many.error().message().find("item 100 has none") != std::string::npos);
  CountingStream shorter(60);
  auto too_few = process_in_batches_into(pool, device, ones, shorter, targets, discard, {.batch_size = 32});
  REQUIRE_FALSE(too_few);
  CHECK(too_few.error().message().find("ended after 60 items but there are 100 targets") != std::string::npos);
  CountingStream empty(0);
  auto nothing = process_in_batches_into(pool, device, ones, empty, discard);
  REQUIRE_FALSE(nothing);
  CHECK(nothing.error().message().find("empty") != std::string::npos);
}

// ---- DeviceBatches ------------------------------------------------------------------------------

TEST_CASE("device batches: rows uploaded batch by batch, each released when the loop moves on",
          "[batching]") {
  const std::size_t dim = 16, rows = 3000;
  Device device = sim(1 * MiB);
  GpuMemoryPool pool({.caching = false});  // so an injected fault reaches the adaptor
  std::vector<float> host(rows * dim);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = std::sin(static_cast<float>(i) * 0.37f) + 2.0f;
  for (std::uint64_t fault : {0, 3}) {
    INFO("device allocation " << fault << " fails (0: none)");
    if (fault) REQUIRE(device.inject_faults({.fail_nth_allocation = fault}));
    auto batches = device_batches(pool, device, std::span<const float>(host), dim, {.rows_per_batch = 700});
    REQUIRE(batches);
    std::size_t next_row = 0;
    bool one_held_at_a_time = true;
    for (auto& batch : *batches) {
      REQUIRE(batch);
      REQUIRE(batch->first_row == next_row);
      // Only this batch's buffer is in use: the previous one went back before it was allocated.
      one_held_at_a_time = one_held_at_a_time && pool.stats(device).in_use_bytes == batch->buffer.capacity_bytes();
      std::vector<float> back(batch->rows * dim, -1.0f);
      REQUIRE(batch->buffer.download(std::span<float>(back)));
      REQUIRE(std::equal(back.begin(), back.end(), host.begin() + static_cast<std::ptrdiff_t>(next_row * dim)));
      next_row += batch->rows;
    }
    CHECK(next_row == rows);
    CHECK(one_held_at_a_time);
    CHECK(pool.stats(device).in_use_bytes == 0);
    if (fault) CHECK(batches->planner().retries() >= 1);
    REQUIRE(device.inject_faults({}));
  }
}

TEST_CASE("device batches: sized from the headroom, bad shapes refused", "[batching]") {
  Device device = sim(1 * MiB);
  GpuMemoryPool pool;
  std::vector<float> host(64 * 5000, 1.0f);
  auto batches = device_batches(pool, device, std::span<const float>(host), 64);
  REQUIRE(batches);
  std::size_t first_rows = 0, total = 0;
  for (auto& batch : *batches) {
    REQUIRE(batch);
    if (first_rows == 0) first_rows = batch->rows;
    total += batch->rows;
  }
  CHECK(total == 5000);
  CHECK(first_rows == static_cast<std::size_t>(1 * MiB * 0.5 / (64 * sizeof(float))));
  auto no_dim = device_batches(pool, device, std::span<const float>(host), 0);
  REQUIRE_FALSE(no_dim);
  CHECK(no_dim.error().message().find("dim is 0") != std::string::npos);
  auto ragged = device_batches(pool, device, std::span<const float>(host).first(100), 64);
  REQUIRE_FALSE(ragged);
  CHECK(ragged.error().message().find("100 elements: expected a positive multiple of dim = 64") !=
        std::string::npos);
}

// ---- Progress for people ------------------------------------------------------------------------

TEST_CASE("progress: bar and log line formats", "[batching]") {
  BatchProgress p{.items_done = 450, .items_total = 1000, .batches_done = 7, .batch_size = 64,
                  .retries = 2, .items_per_second = 1234.5};
  CHECK(format_progress_bar(p, 10) == "[####------]  45.0%  450/1000 items  batch 64  retries 2  1.2k items/s");
  CHECK(format_progress_line(p) ==
        "batching: 450/1000 items (45.0%), 7 batches, batch size 64, 2 retries, 1234.5 items/s");
  p.items_total.reset();
  CHECK(format_progress_bar(p, 10) == "[stream] 450 items  batch 64  retries 2  1.2k items/s");
  CHECK(format_progress_line(p) == "batching: 450 items, 7 batches, batch size 64, 2 retries, 1234.5 items/s");
}

TEST_CASE("progress: log lines are periodic, the bar redraws in place", "[batching]") {
  auto read_all = [](std::FILE* file) {
    std::rewind(file);
    std::string text;
    for (int c; (c = std::fgetc(file)) != EOF;) text.push_back(static_cast<char>(c));
    return text;
  };
  BatchProgress p{.items_done = 0, .items_total = 100, .batches_done = 0, .batch_size = 10};
  std::FILE* lines_file = std::tmpfile();
  REQUIRE(lines_file);
  CHECK(::gpupool::terminal_progress(lines_file).operator bool());  // Auto on a file: lines
  auto lines = terminal_progress(lines_file, ProgressStyle::Lines, std::chrono::hours(1));
  for (int i = 1; i <= 10; ++i) {
    p.items_done = static_cast<std::size_t>(i) * 10;
    p.batches_done = static_cast<std::size_t>(i);
    lines(p);
  }
  std::string logged = read_all(lines_file);
  CHECK(std::count(logged.begin(), logged.end(), '\n') == 2);  // the first, and the last
  CHECK(logged.find("100/100 items (100.0%)") != std::string::npos);
  CHECK(logged.find('\r') == std::string::npos);
  std::fclose(lines_file);

  std::FILE* bar_file = std::tmpfile();
  REQUIRE(bar_file);
  auto bar = terminal_progress(bar_file, ProgressStyle::Bar);
  p.items_done = 50;
  bar(p);
  p.items_done = 100;
  bar(p);
  std::string drawn = read_all(bar_file);
  CHECK(std::count(drawn.begin(), drawn.end(), '\r') == 2);
  CHECK(drawn.back() == '\n');
  std::fclose(bar_file);
}

// ---- A property over random memory, faults and growth ------------------------------------------

TEST_CASE("batching: any capacity, fault position and growth factor keep items once and in order",
          "[batching][property]") {
  rc::prop("exactly once, in order", [] {
    const std::size_t n = *rc::gen::inRange<std::size_t>(1, 600);
    const std::size_t capacity = *rc::gen::inRange<std::size_t>(64, 2048) * KiB;
    const std::uint64_t fault = *rc::gen::inRange<std::uint64_t>(0, 40);
    const double growth = *rc::gen::inRange(120, 201) / 100.0;
    const bool caching = *rc::gen::arbitrary<bool>();
    Device device = sim(capacity);
    GpuMemoryPool pool({.caching = caching});
    if (fault) RC_ASSERT(device.inject_faults({.fail_nth_allocation = fault}).has_value());
    auto items = iota_items(n);
    RecordingWork work(pool, device, n);
    auto out = process_in_batches(pool, device, work, items, {.planner = {.growth_factor = growth}});
    if (!out) {
      // Only when the fault hit a batch of one item: an out-of-memory error naming it, with
      // every item before it done exactly once and none after it.
      RC_ASSERT(out.error().is_out_of_memory());
      RC_ASSERT(out.error().message().find("does not fit") != std::string::npos);
      auto first_undone = std::find(work.handed.begin(), work.handed.end(), 0u) - work.handed.begin();
      RC_ASSERT(out.error().message().find("item " + std::to_string(first_undone)) != std::string::npos);
      for (std::size_t i = 0; i < n; ++i) RC_ASSERT(work.handed[i] == (static_cast<std::ptrdiff_t>(i) < first_undone ? 1u : 0u));
      return;
    }
    RC_ASSERT(out->results.size() == n);
    for (std::size_t i = 0; i < n; ++i) {
      RC_ASSERT(out->results[i] == 3 * items[i] + 1);
      RC_ASSERT(work.handed[i] == 1u);
    }
  });
}
