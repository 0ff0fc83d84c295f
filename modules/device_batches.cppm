// gpupool:device_batches — DeviceBatches / device_batches(...): a range of host rows uploaded
// batch by batch into pool buffers (like CUDA.jl's CuIterator); each batch's buffer goes back to
// the pool as soon as the loop moves on.
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
export module gpupool:device_batches;
import :error;
import :units;
import :precision;
import :device;
import :buffer;
import :pool;
import :batch_planner;
import :batch_engine;

export namespace gpupool {

// ---- DeviceBatches: host rows uploaded batch by batch (CUDA.jl's CuIterator) ---------------

struct DeviceBatch {
  ManagedBuffer buffer;      // rows × dim elements, uploaded
  std::size_t first_row = 0;
  std::size_t rows = 0;
};

struct DeviceBatchOptions {
  std::optional<std::size_t> rows_per_batch;  // the first size; nullopt = from the headroom
  double safety_fraction = 0.5;  // the loop body needs memory too: half the headroom by default
  PlannerConfig planner;
};

// A single-pass range over `rows` (row-major, `dim` elements per row) whose elements are
// Result<DeviceBatch>: each batch allocated from the pool and uploaded when the loop reaches it,
// and handed back to the pool when the loop moves on (before the next one is allocated), so at
// most one batch is held. An upload that runs out of memory trims the cache and retries smaller;
// an element holding an error is the last one. The host rows must outlive the range.
template <class T>
class DeviceBatches {
 public:
  class iterator {
   public:
    using value_type = Result<DeviceBatch>;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(DeviceBatches* owner) : owner_(owner) {}
    Result<DeviceBatch>& operator*() const { return owner_->current_; }
    Result<DeviceBatch>* operator->() const { return &owner_->current_; }
    iterator& operator++() {
      owner_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.owner_->finished_; }

   private:
    DeviceBatches* owner_ = nullptr;
  };

  // InvalidInput for dim 0, no rows, a length that is not a multiple of dim, or bad options.
  static Result<DeviceBatches> create(GpuMemoryPool pool, Device device, std::span<const T> rows,
                                      std::size_t dim, DeviceBatchOptions options = {}) {
    if (dim == 0)
      return make_error(ErrorKind::InvalidInput, "dim is 0: expected at least 1 element per row");
    if (rows.empty() || rows.size() % dim != 0)
      return make_error(ErrorKind::InvalidInput,
                        "the host data has " + std::to_string(rows.size()) + " elements: expected a "
                            "positive multiple of dim = " + std::to_string(dim));
    if (!(options.safety_fraction > 0 && options.safety_fraction <= 1))
      return make_error(ErrorKind::InvalidInput,
                        "safety_fraction is " + std::to_string(options.safety_fraction) +
                            ": expected a value in (0, 1]");
    auto planner = BatchPlanner::create(options.planner);
    if (!planner) return std::unexpected(planner.error());
    return DeviceBatches(std::move(pool), std::move(device), rows, dim, options, *planner);
  }

  DeviceBatches(DeviceBatches&&) noexcept = default;
  DeviceBatches& operator=(DeviceBatches&&) noexcept = default;

  iterator begin() {
    if (!started_) {
      started_ = true;
      advance();
    }
    return iterator(this);
  }
  std::default_sentinel_t end() const noexcept { return {}; }
  std::size_t total_rows() const noexcept { return rows_.size() / dim_; }
  const BatchPlanner& planner() const noexcept { return planner_; }

 private:
  DeviceBatches(GpuMemoryPool pool, Device device, std::span<const T> rows, std::size_t dim,
                DeviceBatchOptions options, BatchPlanner planner)
      : pool_(std::move(pool)), device_(std::move(device)), rows_(rows), dim_(dim),
        options_(options), planner_(std::move(planner)) {}

  // Hands the current batch back, then uploads the next (or finishes).
  void advance() {
    const bool had_error = !current_.has_value();
    current_ = DeviceBatch{};  // the previous buffer goes back to the pool here
    if (had_error || next_row_ >= total_rows()) {
      finished_ = true;
      return;
    }
    if (!planned_) plan_first();
    current_ = upload_next();
  }

  void plan_first() {
    planned_ = true;
    std::size_t row_bytes = dim_ * sizeof(T);
    if (options_.rows_per_batch) return planner_.start(*options_.rows_per_batch);
    auto headroom = memory_headroom(pool_, device_);
    planner_.start(headroom ? planner_.size_for_headroom(headroom->bytes, options_.safety_fraction, row_bytes) : 1);
  }

  Result<DeviceBatch> upload_next() {
    while (true) {
      if (auto headroom = memory_headroom(pool_, device_)) planner_.observe_headroom(headroom->bytes);
      std::size_t rows = std::min(planner_.size(), total_rows() - next_row_);
      auto batch = upload(next_row_, rows);
      if (batch) {
        planner_.on_success(rows);
        next_row_ += rows;
        return batch;
      }
      if (!batch.error().is_out_of_memory()) return batch;
      pool_.trim(device_);
      OomDecision decision = planner_.on_out_of_memory(rows);
      if (decision != OomDecision::Retry)
        return std::unexpected(batching_detail::give_up_error(decision, batch.error(), next_row_, rows,
                                                              planner_.retries()));
    }
  }

  Result<DeviceBatch> upload(std::size_t first_row, std::size_t rows) {
    auto buffer = pool_.get_managed_buffer(device_, rows * dim_, precision_of<T>::value);
    if (!buffer) return std::unexpected(buffer.error());
    if (auto ok = buffer->upload(rows_.subspan(first_row * dim_, rows * dim_)); !ok)
      return std::unexpected(ok.error());
    return DeviceBatch{std::move(*buffer), first_row, rows};
  }

  GpuMemoryPool pool_;
  Device device_;
  std::span<const T> rows_;
  std::size_t dim_;
  DeviceBatchOptions options_;
  BatchPlanner planner_;
  Result<DeviceBatch> current_{DeviceBatch{}};
  std::size_t next_row_ = 0;
  bool started_ = false, planned_ = false, finished_ = false;
};

template <class T>
Result<DeviceBatches<T>> device_batches(GpuMemoryPool pool, Device device, std::span<const T> rows,
                                        std::size_t dim, DeviceBatchOptions options = {}) {
  return DeviceBatches<T>::create(std::move(pool), std::move(device), rows, dim, options);
}

}  // namespace gpupool

