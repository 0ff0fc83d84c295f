// Fuzzes one GpuMemoryPool driven by several threads at once (run under ThreadSanitizer in CI).
// The first input byte picks 2..4 threads; every 6 bytes after it make one operation (a kind
// byte, 4 bytes of operand a, 1 byte of b), dealt to the threads in turn. Each thread allocates,
// frees, releases, takes batches, trims, cleans up, caps the cache and reads stats and pressure
// while the others do. The device is roomy (no allocation may fail) and buffers carry patterns.
//
// The check is linearisability-style: whatever the interleaving, the pool's final state must be
// the one every sequential order of the same operations gives — in use, requested, live buffers,
// allocations and frees equal the sums over the threads; reserved = in use + cached and the
// device holds exactly the reserved bytes; no two live buffers overlap and each kept its pattern;
// after everything is freed and emergency_cleanup_all() the device holds 0 bytes. Snapshots
// taken during the run must be consistent in themselves (reserved = in use + cached, pressure in
// [0, 1]). The total of operations and their rate are printed at exit.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include <fmt/format.h>
import gpupool;
#include "op_counter.hpp"
#include "support/pool_model.hpp"

namespace {

using namespace gpupool;
using gpupool::testing::model_block_holds;

constexpr std::size_t kBytesPerOp = 6;
constexpr std::size_t kMaxOpsPerThread = 64;
constexpr std::size_t kMaxLivePerThread = 8;
constexpr std::size_t kLargestRequest = std::size_t{512} << 10;
// 4 threads × 8 live buffers × 512 KiB (+ batches) stay far inside it: nothing may fail.
constexpr std::size_t kCapacity = std::size_t{128} << 20;

enum Kind : std::uint8_t { Alloc, Free, Release, Batch, Trim, Cleanup, CacheCap, Look, kKinds };

struct Op {
  Kind kind;
  std::uint32_t a;
  std::uint8_t b;
};

struct Live {
  ManagedBuffer buffer;
  std::size_t requested;
  std::uint8_t pattern;
};

// The places of a buffer that carry its pattern (as in pool_model.hpp).
template <class Visit>
void for_each_probe(std::size_t bytes, Visit visit) {
  gpupool::testing::PoolModelChecker::for_each_probe(bytes, visit);
}

std::size_t request_bytes(std::uint32_t seed) {
  const std::uint32_t bits = seed % 20;  // 1 B .. 512 KiB on a log scale
  return std::min<std::size_t>(kLargestRequest, 1 + (seed / 20) % (std::size_t{1} << bits));
}

// One thread's operations and what it holds; failures are collected, not thrown.
class Worker {
 public:
  Worker(GpuMemoryPool& pool, const Device& device, std::size_t id)
      : pool_(pool), device_(device), id_(id) {}

  void run(const std::vector<Op>& ops) {
    for (const Op& op : ops) {
      if (failure_) return;
      step(op);
    }
  }
  std::vector<Live>& live() { return live_; }
  std::uint64_t allocations() const { return allocations_; }
  std::uint64_t frees() const { return frees_; }
  const std::optional<std::string>& failure() const { return failure_; }

 private:
  void fail(std::string what) {
    if (!failure_) failure_ = fmt::format("thread {}: {}", id_, std::move(what));
  }

  void adopt(ManagedBuffer buffer, std::size_t bytes) {
    const auto pattern = static_cast<std::uint8_t>(id_ * 64 + allocations_ * 7 + 1);
    auto* begin = static_cast<std::byte*>(buffer.raw_data());
    for_each_probe(bytes, [&](std::size_t at) { begin[at] = std::byte{pattern}; });
    if (!model_block_holds(bytes, buffer.capacity_bytes()))
      fail(fmt::format("a buffer of {} bytes has a block of {}", bytes, buffer.capacity_bytes()));
    live_.push_back(Live{std::move(buffer), bytes, pattern});
    ++allocations_;
  }

  void free_at(std::uint32_t seed, bool release) {
    if (live_.empty()) return;
    const std::size_t index = seed % live_.size();
    Live& victim = live_[index];
    const auto* bytes = static_cast<const std::byte*>(victim.buffer.raw_data());
    bool intact = true;
    for_each_probe(victim.requested,
                   [&](std::size_t at) { intact = intact && bytes[at] == std::byte{victim.pattern}; });
    if (!intact) fail(fmt::format("a live buffer of {} bytes lost its pattern", victim.requested));
    if (release && !victim.buffer.release()) fail("release failed");
    if (&victim != &live_.back()) std::swap(victim, live_.back());
    live_.pop_back();
    ++frees_;
  }

  void step(const Op& op) {
    switch (op.kind) {
      case Alloc: {
        if (live_.size() >= kMaxLivePerThread) return free_at(op.a, false);
        const std::size_t bytes = request_bytes(op.a);
        auto buffer = pool_.get_managed_buffer(device_, bytes, Precision::Bytes);
        if (!buffer) return fail(fmt::format("alloc of {} failed: {}", bytes, buffer.error().message()));
        return adopt(std::move(*buffer), bytes);
      }
      case Free: return free_at(op.a, false);
      case Release: return free_at(op.a, true);
      case Batch: {
        if (live_.size() + 4 > kMaxLivePerThread) return free_at(op.a, true);
        std::vector<BufferRequest> requests;
        for (std::uint32_t i = 0; i < op.b % 4u + 1; ++i)
          requests.push_back({request_bytes(op.a * 7919u + i * 104729u), Precision::Bytes});
        auto batch = pool_.create_buffer_batch(device_, requests);
        if (!batch) return fail(fmt::format("batch failed: {}", batch.error().message()));
        for (const BufferRequest& request : requests) {
          auto buffer = batch->remove(0);
          if (!buffer) return fail(fmt::format("batch remove failed: {}", buffer.error().message()));
          adopt(std::move(*buffer), request.elements);
        }
        return;
      }
      case Trim: pool_.trim(device_, std::size_t{op.a % 9} << 18); return;
      case Cleanup: pool_.emergency_cleanup(device_); return;
      case CacheCap: {
        std::optional<std::size_t> cap;
        if (op.a % 4) cap = std::size_t{op.a % 33} << 18;
        if (!pool_.set_max_cached_bytes(device_, cap)) fail("set_max_cached_bytes failed");
        return;
      }
      case Look: {
        const PoolStats s = pool_.stats(device_);
        if (s.reserved_bytes != s.in_use_bytes + s.cached_bytes)
          fail(fmt::format("a snapshot with reserved {} != in use {} + cached {}", s.reserved_bytes,
                           s.in_use_bytes, s.cached_bytes));
        const double pressure = pool_.memory_pressure(device_);
        if (!(pressure >= 0.0 && pressure <= 1.0)) fail(fmt::format("pressure {}", pressure));
        return;
      }
      case kKinds: return;
    }
  }

  GpuMemoryPool& pool_;
  const Device& device_;
  std::size_t id_;
  std::vector<Live> live_;
  std::uint64_t allocations_ = 0;
  std::uint64_t frees_ = 0;
  std::optional<std::string> failure_;
};

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_pool_threads: %s\n", what.c_str());
  std::abort();
}

// The final state against the sums over the threads (any sequential order gives these).
void check_final(GpuMemoryPool& pool, const Device& device, std::vector<Worker>& workers) {
  std::size_t in_use = 0, requested = 0, live = 0;
  std::uint64_t allocations = 0, frees = 0;
  std::vector<std::pair<const std::byte*, std::size_t>> blocks;
  for (Worker& w : workers) {
    for (const Live& l : w.live()) {
      in_use += l.buffer.capacity_bytes();
      requested += l.requested;
      blocks.emplace_back(static_cast<const std::byte*>(l.buffer.raw_data()),
                          l.buffer.capacity_bytes());
    }
    live += w.live().size();
    allocations += w.allocations();
    frees += w.frees();
  }
  const PoolStats s = pool.stats(device);
  auto expect = [](const char* what, auto got, auto want) {
    if (got != want) violated(fmt::format("final {} {} != the threads' sum {}", what, got, want));
  };
  expect("in use", s.in_use_bytes, in_use);
  expect("requested", s.requested_bytes, requested);
  expect("live buffers", s.live_buffers, live);
  expect("allocations", s.allocations, allocations);
  expect("frees", s.frees, frees);
  expect("reserved", s.reserved_bytes, s.in_use_bytes + s.cached_bytes);
  const auto memory = device.memory_info();
  expect("device bytes", memory->total - memory->free, s.reserved_bytes);
  std::sort(blocks.begin(), blocks.end());
  for (std::size_t i = 1; i < blocks.size(); ++i)
    if (blocks[i - 1].first + blocks[i - 1].second > blocks[i].first)
      violated("two live buffers overlap");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1 + kBytesPerOp) return 0;
  static const Device device = *Device::simulated({.capacity = kCapacity, .name = "threads"});
  const std::size_t threads = 2 + data[0] % 3;
  std::vector<std::vector<Op>> ops(threads);
  std::size_t total = 0;
  for (std::size_t at = 1; at + kBytesPerOp <= size; at += kBytesPerOp) {
    auto& mine = ops[total % threads];
    if (mine.size() == kMaxOpsPerThread) break;
    Op op{static_cast<Kind>(data[at] % kKinds), 0, data[at + 5]};
    std::memcpy(&op.a, data + at + 1, sizeof op.a);
    mine.push_back(op);
    ++total;
  }
  gpupool::fuzzing::OpCounter::of("fuzz_pool_threads").add(total);
  {
    GpuMemoryPool pool;
    std::vector<Worker> workers;
    for (std::size_t t = 0; t < threads; ++t) workers.emplace_back(pool, device, t);
    std::vector<std::thread> running;
    for (std::size_t t = 0; t < threads; ++t)
      running.emplace_back([&, t] { workers[t].run(ops[t]); });
    for (std::thread& t : running) t.join();
    for (const Worker& w : workers)
      if (w.failure()) violated(*w.failure());
    check_final(pool, device, workers);
    for (Worker& w : workers) w.live().clear();
    pool.emergency_cleanup_all();
    const auto memory = device.memory_info();
    if (memory->free != memory->total)
      violated(fmt::format("after emergency_cleanup_all the device still holds {} bytes",
                           memory->total - memory->free));
  }
  return 0;
}
