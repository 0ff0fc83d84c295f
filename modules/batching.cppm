// gpupool:batching — OOM-safe adaptive batching over ranges and streams.
//
//   process_in_batches(pool, device, f, inputs[, targets], options)
//       f(batch) → Result<std::vector<R>>, one result per item; the results come back in input
//       order. Random-access sized ranges are sliced (no copy); any other input range (a
//       generator, a file reader) is read once, with at most one batch of items buffered.
//   process_in_batches_into(pool, device, f, inputs[, targets], sink, options)
//       the same, but each batch's results go to sink(first_index, results) instead of a vector:
//       for streams whose results do not fit in RAM either.
//   DeviceBatches / device_batches(...)
//       a range of host rows uploaded batch by batch into pool buffers (like CUDA.jl's
//       CuIterator): each batch's buffer goes back to the pool as soon as the loop moves on.
//
// How the batch size is chosen (docs/batching.md has a worked example):
//   1. first size = headroom × safety_fraction ÷ bytes per item. Headroom (memory_headroom) is
//      what the pool could still hand out: device free memory plus the pool's cached bytes,
//      within the pool's hard limit. Bytes per item are the caller's, or measured on a small
//      probe batch through the pool's peak in-use bytes (items of uneven length:
//      estimate_bytes_per_item).
//   2. on an OutOfMemory or PoolLimitExceeded error from f (the kind, never the message), the
//      pool's cache is trimmed and the size bisected between the last size that succeeded and
//      the one that failed (halved when none succeeded). A failure at size 1 ends the call with
//      an error naming the item's index; consecutive failures are bounded by max_retries.
//   3. after grow_after successes in a row the size grows by growth_factor, never to a size that
//      failed at comparable headroom, and no further than headroom ÷ the bytes per item the last
//      batch was measured to use; when the headroom drops, the size shrinks with it.
// Items already done are never redone: a failed call of f commits nothing, and every item goes
// to exactly one successful call.
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
export module gpupool:batching;
import :error;
import :units;
import :precision;
import :device;
import :buffer;
import :pool;
export import :batch_planner;
export import :batch_engine;
export import :device_batches;

export namespace gpupool {

// f(const Batch<...>&) → Result<std::vector<R>> with one R per item of the batch. Returns every
// item's result in input order with a report, or the first error that is not out-of-memory
// (with the batch's item range), or an out-of-memory error naming the item that could not be
// done. InvalidInput for bad inputs (see docs/batching.md). `inputs` is read through a
// reference: keep it alive for the call.
template <std::ranges::input_range Range, class F>
auto process_in_batches(GpuMemoryPool& pool, const Device& device, F&& f, Range&& inputs,
                        const BatchingOptions& options = {}) {
  return batching_detail::collect(pool, device, f, inputs, NoTargets{}, options);
}

// The same with targets: a random-access sized range of finite numbers, one per item; each
// batch gets its slice as batch.targets.
template <std::ranges::input_range Range, std::ranges::random_access_range Targets, class F>
  requires std::ranges::sized_range<Targets>
auto process_in_batches(GpuMemoryPool& pool, const Device& device, F&& f, Range&& inputs,
                        const Targets& targets, const BatchingOptions& options = {}) {
  return batching_detail::collect(pool, device, f, inputs, targets, options);
}

// Streams: each batch's results go to sink(first_index, std::vector<R>&&) → Result<void>, in
// input order, instead of being collected. An error from the sink ends the call.
template <std::ranges::input_range Range, class F, class Sink>
Result<BatchingReport> process_in_batches_into(GpuMemoryPool& pool, const Device& device, F&& f,
                                               Range&& inputs, Sink&& sink,
                                               const BatchingOptions& options = {}) {
  return batching_detail::drain(pool, device, f, inputs, NoTargets{}, sink, options);
}

template <std::ranges::input_range Range, std::ranges::random_access_range Targets, class F, class Sink>
  requires std::ranges::sized_range<Targets>
Result<BatchingReport> process_in_batches_into(GpuMemoryPool& pool, const Device& device, F&& f,
                                               Range&& inputs, const Targets& targets, Sink&& sink,
                                               const BatchingOptions& options = {}) {
  return batching_detail::drain(pool, device, f, inputs, targets, sink, options);
}

}  // namespace gpupool

