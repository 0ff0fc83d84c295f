// The pool benchmark (the pool_bench executable and `gpupool bench`): what an allocation costs,
// gpupool beside its peers on the same traces.
//
//   pair           alloc + free of one size on a pool hit (256 B .. 256 MiB): median ns per pair
//   trace          a random trace: ≤ 1000 live buffers, sizes uniform 1 B .. 4 MiB, alloc/free coin
//                  flip: ns per operation, the median of 5 runs after a warm-up run
//   threads        the same trace on 1, 2, 4, 8, 16 threads at once (each its own trace, repeated for
//                  a 250 ms window after a warm-up pass): the window over all operations finished in
//                  it, in ns/op (lower = more aggregate throughput)
//   fragmentation  peak reserved / peak requested bytes on the random trace and on an ANN-serving
//                  trace (bursts of query-sized buffers beside a few large long-lived corpus buffers);
//                  then both traces with virtual segments under a hard limit of --limit × the
//                  trace's peak (default 1.02): whether they run within it, and at what cost;
//                  --trace FILE adds a recorded trace (e.g. PyTorch's, bench/data/traces) to both
//
// Allocators: gpupool (device segments, then virtual segments: "gpupool/virtual", then virtual
// segments with a page budget of 1%: "gpupool/budget", PoolConfig::virtual_page_slack) on the device
// of GPUPOOL_DEVICE (default: cuda:0 when there is a GPU, else a
// simulated device), and in CUDA builds with a GPU, cudaMallocAsync/cudaFreeAsync on the device's
// default memory pool with its release threshold at the maximum (so it caches, as it does when
// tuned). PyTorch's caching allocator is measured on the same traces by bench/peers/torch_allocator.py
// (the trace generator below is mirrored there bit for bit).
//
// Output: a table on stdout; with --json FILE, one JSON object per line:
//   {"bench": "pair", "allocator": "gpupool", "device": "...", "size": 256, "ns_per_op": 31.2,
//    "core_check_ns": 1.52}
//
// Each pair and trace row carries a core check measured just before it: ns per step of a fixed
// loop that issues several independent loads, stores and adds a cycle. It is the same on every
// quiet core of one machine and slows when another hardware thread — on a shared host, possibly
// another tenant's — runs on the same core; the row slows with it, so a row is read beside it.
#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <charconv>
#include <cerrno>
#include <system_error>
#include <fmt/format.h>
#include <expected>
#include <filesystem>
#include <fstream>
#include <map>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <thread>
#include <vector>
#if GPUPOOL_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#include "pool_benchmark.hpp"
import gpupool;

namespace gpupool {

namespace {

// ---- traces -------------------------------------------------------------------------------------

// splitmix64: tiny, fast and easy to mirror exactly in the PyTorch peer.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// One step of a trace: allocate `bytes` into slot `slot`, or free slot `slot` (bytes = 0).
struct TraceOp {
  std::uint32_t slot;
  std::uint64_t bytes;
};

// ≤ 1000 live buffers, sizes uniform 1 B .. 4 MiB, alloc/free coin flip.
std::vector<TraceOp> random_trace(std::uint64_t seed, std::size_t ops) {
  constexpr std::size_t kMaxLive = 1000;
  constexpr std::uint64_t kMaxBytes = 4ull << 20;
  SplitMix64 rng{seed};
  std::vector<std::uint32_t> live;  // slots in use
  std::vector<std::uint32_t> free_slots;
  for (std::uint32_t s = kMaxLive; s-- > 0;) free_slots.push_back(s);
  std::vector<TraceOp> trace;
  trace.reserve(ops);
  while (trace.size() < ops) {
    bool alloc = live.empty() || (live.size() < kMaxLive && (rng.next() & 1));
    if (alloc) {
      std::uint32_t slot = free_slots.back();
      free_slots.pop_back();
      live.push_back(slot);
      trace.push_back({slot, 1 + rng.next() % kMaxBytes});
    } else {
      std::size_t index = rng.next() % live.size();
      std::uint32_t slot = live[index];
      live[index] = live.back();
      live.pop_back();
      free_slots.push_back(slot);
      trace.push_back({slot, 0});
    }
  }
  for (std::uint32_t slot : live) trace.push_back({slot, 0});  // end empty
  return trace;
}

// ANN serving: 4 corpus shards of 96–160 MiB live throughout (one replaced every 200 bursts), and
// bursts of 8–64 query-side buffers (query batches of 1–1024 × 128 fp32, distance tiles of
// batch × 4096 fp32, top-k lists of batch × 100 × 8 bytes), all freed at the end of the burst.
std::vector<TraceOp> ann_serving_trace(std::uint64_t seed, std::size_t bursts) {
  SplitMix64 rng{seed};
  std::vector<TraceOp> trace;
  auto shard_bytes = [&] { return (96ull << 20) + (rng.next() % 65) * (1ull << 20); };
  for (std::uint32_t shard = 0; shard < 4; ++shard) trace.push_back({shard, shard_bytes()});
  for (std::size_t burst = 0; burst < bursts; ++burst) {
    if (burst % 200 == 199) {
      auto shard = static_cast<std::uint32_t>(rng.next() % 4);
      trace.push_back({shard, 0});
      trace.push_back({shard, shard_bytes()});
    }
    std::size_t count = 8 + rng.next() % 57;
    for (std::uint32_t i = 0; i < count; ++i) {
      std::uint64_t batch = 1 + rng.next() % 1024;
      std::uint64_t bytes = 0;
      switch (rng.next() % 3) {
        case 0: bytes = batch * 128 * 4; break;
        case 1: bytes = batch * 4096 * 4; break;
        default: bytes = batch * 100 * 8; break;
      }
      trace.push_back({4 + i, bytes});
    }
    for (std::uint32_t i = 0; i < count; ++i) trace.push_back({4 + i, 0});
  }
  for (std::uint32_t shard = 0; shard < 4; ++shard) trace.push_back({shard, 0});
  return trace;
}

// A recorded pool trace (tracing.cppm: `gpupool replay`'s CSV or JSON, e.g. PyTorch's from
// tools/torch_snapshot_to_trace.py) as slot operations: an allocation takes the lowest free slot
// and its free empties it. Frees of allocations made before the recording, trims and failed
// allocations are left out (they are not requests); what is live at the end is freed then.
std::vector<TraceOp> ops_of(const Trace& recorded) {
  std::vector<TraceOp> ops;
  std::map<std::uint64_t, std::uint32_t> slot_of;  // live allocation id → its slot
  std::priority_queue<std::uint32_t, std::vector<std::uint32_t>, std::greater<>> free_slots;
  std::uint32_t slots = 0;
  for (const TraceEvent& event : recorded.events) {
    if (event.kind == TraceEventKind::Alloc && event.bytes > 0 && !slot_of.contains(event.id)) {
      std::uint32_t slot = slots;
      if (free_slots.empty()) ++slots;
      else slot = free_slots.top(), free_slots.pop();
      slot_of[event.id] = slot;
      ops.push_back({slot, event.bytes});
    } else if (event.kind == TraceEventKind::Free) {
      auto live = slot_of.find(event.id);
      if (live == slot_of.end()) continue;
      ops.push_back({live->second, 0});
      free_slots.push(live->second);
      slot_of.erase(live);
    }
  }
  for (const auto& [id, slot] : slot_of) ops.push_back({slot, 0});
  return ops;
}

std::uint32_t slots_of(const std::vector<TraceOp>& trace) {
  std::uint32_t slots = 0;
  for (const TraceOp& op : trace) slots = std::max(slots, op.slot + 1);
  return slots;
}

// ---- allocators under test ------------------------------------------------------------------------

// What the benchmark needs of an allocator: alloc/free into numbered slots of one thread, and
// the fragmentation figures of a trace.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual std::string name() const = 0;
  // A per-thread context owning `slots` slots; `thread` numbers the threads of a threads run (each
  // on device thread % devices where the allocator spans several).
  class Slots {
   public:
    virtual ~Slots() = default;
    virtual bool alloc(std::uint32_t slot, std::uint64_t bytes) = 0;
    virtual void free(std::uint32_t slot) = 0;
  };
  virtual std::unique_ptr<Slots> slots(std::uint32_t count, std::size_t thread = 0) = 0;
  virtual void reset_peaks() = 0;
  virtual std::uint64_t peak_reserved() = 0;
  virtual void release_cache() = 0;
  // Device allocations and frees so far, where the allocator counts them: a timed run that
  // calls the device measures the device's lock, not the allocator.
  virtual std::optional<std::uint64_t> device_calls() { return std::nullopt; }
  virtual std::size_t device_count() const { return 1; }
};

// One pool over `devices`: the single-thread cases use the first; a threads run puts thread t on
// devices[t % devices.size()].
class GpupoolAllocator final : public Allocator {
 public:
  GpupoolAllocator(std::vector<Device> devices, std::string name, PoolConfig config = {})
      : devices_(std::move(devices)), device_(devices_.front()), name_(std::move(name)),
        pool_(std::move(config)) {}
  GpupoolAllocator(Device device, std::string name, PoolConfig config = {})
      : GpupoolAllocator(std::vector<Device>{std::move(device)}, std::move(name), std::move(config)) {}
  std::string name() const override { return name_; }
  std::size_t device_count() const override { return devices_.size(); }
  PoolStats stats(const Device& device) const { return pool_.stats(device); }
  const std::vector<Device>& devices() const { return devices_; }
  class PoolSlots final : public Slots {
   public:
    PoolSlots(GpuMemoryPool pool, Device device, std::uint32_t count)
        : pool_(std::move(pool)), device_(std::move(device)), buffers_(count) {}
    bool alloc(std::uint32_t slot, std::uint64_t bytes) override {
      auto buffer = pool_.get_managed_buffer(device_, bytes, Precision::Bytes);
      if (!buffer) return false;
      buffers_[slot] = std::move(*buffer);
      return true;
    }
    void free(std::uint32_t slot) override { buffers_[slot] = ManagedBuffer(); }
   private:
    GpuMemoryPool pool_;
    Device device_;
    std::vector<ManagedBuffer> buffers_;
  };
  std::unique_ptr<Slots> slots(std::uint32_t count, std::size_t thread = 0) override {
    return std::make_unique<PoolSlots>(pool_, devices_[thread % devices_.size()], count);
  }
  void reset_peaks() override { pool_.reset_peaks(device_); }
  std::uint64_t peak_reserved() override { return pool_.stats(device_).peak_reserved_bytes; }
  void release_cache() override { pool_.emergency_cleanup(device_); }
  std::optional<std::uint64_t> device_calls() override {
    std::uint64_t calls = 0;
    for (const Device& device : devices_) {
      const PoolStats s = pool_.stats(device);
      calls += s.device_allocations + s.device_frees;
    }
    return calls;
  }

 private:
  std::vector<Device> devices_;
  Device device_;
  std::string name_;
  GpuMemoryPool pool_;
};

#if GPUPOOL_WITH_CUDA
// cudaMallocAsync on each device's default memory pool, release threshold at the maximum; the
// single-thread cases use the first device, a threads run puts thread t on ordinals[t % size].
class CudaMallocAsyncAllocator final : public Allocator {
 public:
  explicit CudaMallocAsyncAllocator(std::vector<int> ordinals)
      : ordinals_(std::move(ordinals)), ordinal_(ordinals_.front()) {
    for (int ordinal : ordinals_) {
      cudaMemPool_t pool{};
      cudaDeviceGetDefaultMemPool(&pool, ordinal);
      std::uint64_t threshold = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    }
    cudaSetDevice(ordinal_);
    cudaDeviceGetDefaultMemPool(&pool_, ordinal_);
  }
  std::string name() const override { return "cudaMallocAsync"; }
  class AsyncSlots final : public Slots {
   public:
    AsyncSlots(int ordinal, std::uint32_t count) : pointers_(count, nullptr) {
      cudaSetDevice(ordinal);
      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    }
    ~AsyncSlots() override {
      for (void* p : pointers_)
        if (p) cudaFreeAsync(p, stream_);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    bool alloc(std::uint32_t slot, std::uint64_t bytes) override {
      return cudaMallocAsync(&pointers_[slot], bytes, stream_) == cudaSuccess;
    }
    void free(std::uint32_t slot) override {
      cudaFreeAsync(pointers_[slot], stream_);
      pointers_[slot] = nullptr;
    }
   private:
    cudaStream_t stream_{};
    std::vector<void*> pointers_;
  };
  std::unique_ptr<Slots> slots(std::uint32_t count, std::size_t thread = 0) override {
    return std::make_unique<AsyncSlots>(ordinals_[thread % ordinals_.size()], count);
  }
  std::size_t device_count() const override { return ordinals_.size(); }
  void reset_peaks() override {
    std::uint64_t zero = 0;
    cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero);
  }
  std::uint64_t peak_reserved() override {
    std::uint64_t value = 0;
    cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &value);
    return value;
  }
  void release_cache() override {
    cudaDeviceSynchronize();
    cudaMemPoolTrimTo(pool_, 0);
  }

 private:
  std::vector<int> ordinals_;
  int ordinal_;
  cudaMemPool_t pool_{};
};
#endif

// ---- measurements -------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
double ns_since(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

struct NamedTrace {
  std::string name;
  std::vector<TraceOp> trace;
};

struct Options {
  bool quick = false;
  bool core_check_only = false;  // --core-check: print the core check and stop
  std::string json_path;
  std::vector<int> thread_counts{1, 2, 4, 8, 16};
  std::string devices;  // --devices N|all: the threads case spread over that many devices
  std::string only;  // one bench (pair, trace, threads, fragmentation), or all when empty
  double limit_ratio = 1.02;  // the limited fragmentation rows' hard limit / the trace's peak
  std::vector<NamedTrace> recorded;  // --trace files, measured beside the made-up traces
  // What the fragmentation rows run: the random trace, the ANN-serving trace, then `recorded`
  // (made once, after the arguments: fragmentation_traces).
  std::vector<NamedTrace> fragmentation;
  // --heap-pad: bytes held on the heap before any allocator is made, which moves the pools, their
  // thread caches and the benchmark's slots against the stack (layout effects show as a pair
  // cost that depends on the shift alone).
  std::size_t heap_pad = 0;
  bool wants(std::string_view bench) const { return only.empty() || only == bench; }
};

// Device calls made between two readings of an allocator's count, where it counts them.
std::optional<std::uint64_t> calls_between(std::optional<std::uint64_t> before,
                                           std::optional<std::uint64_t> after) {
  if (!before || !after) return std::nullopt;
  return *after - *before;
}

// The traces the fragmentation rows run: the random trace, the ANN-serving trace and the recorded
// ones.
std::vector<NamedTrace> fragmentation_traces(const Options& options) {
  std::vector<NamedTrace> traces;
  traces.push_back({"random", random_trace(7, options.quick ? 20'000 : 200'000)});
  traces.push_back({"ann_serving", ann_serving_trace(11, options.quick ? 200 : 2000)});
  traces.insert(traces.end(), options.recorded.begin(), options.recorded.end());
  return traces;
}

// The core check (see the top of this file): ns per step of a loop bound by the core's issue
// width, not by latency or memory — six independent chains of loads, adds and one store a step
// over 4 KiB that stays in L1. The median of 5 runs of 200,000 steps.
double core_check_ns() {
  alignas(64) static std::array<std::uint64_t, 512> words;
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = i * 7 + 1;
  std::array<double, 5> runs{};
  for (double& run : runs) {
    std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0;
    constexpr int kSteps = 200'000;
    const auto start = Clock::now();
    for (int step = 0; step < kSteps; ++step) {
      const std::size_t i = (static_cast<std::size_t>(step) * 4) & 511;
      s0 += words[i];
      s1 ^= words[i + 1];
      s2 += words[i + 2] >> 1;
      s3 += words[i + 3];
      s4 += s0 & 3;
      s5 ^= s1 + 1;
      words[(i + 256) & 511] = s2;
      // Keeps the six sums in registers, one step at a time: no vectorising, no folding.
      asm volatile("" : "+r"(s0), "+r"(s1), "+r"(s2), "+r"(s3), "+r"(s4), "+r"(s5));
    }
    run = ns_since(start) / kSteps;
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

// Median over rounds of the mean cost of one alloc+free pair, after a warm-up that fills the cache.
std::optional<double> pair_ns(Allocator& allocator, std::uint64_t bytes, int rounds, int pairs) {
  auto slots = allocator.slots(1);
  if (!slots->alloc(0, bytes)) return std::nullopt;
  slots->free(0);
  std::vector<double> per_round;
  for (int r = 0; r < rounds; ++r) {
    auto start = Clock::now();
    for (int i = 0; i < pairs; ++i) {
      if (!slots->alloc(0, bytes)) return std::nullopt;
      slots->free(0);
    }
    per_round.push_back(ns_since(start) / pairs);
  }
  std::sort(per_round.begin(), per_round.end());
  return per_round[per_round.size() / 2];
}

// Runs a trace; returns ns per operation, or nullopt if an allocation failed.
std::optional<double> run_trace(Allocator::Slots& slots, const std::vector<TraceOp>& trace) {
  auto start = Clock::now();
  for (const TraceOp& op : trace) {
    if (op.bytes == 0) slots.free(op.slot);
    else if (!slots.alloc(op.slot, op.bytes)) return std::nullopt;
  }
  return ns_since(start) / static_cast<double>(trace.size());
}

// Peak bytes the trace itself holds at once.
std::uint64_t peak_requested(const std::vector<TraceOp>& trace) {
  std::vector<std::uint64_t> sizes(slots_of(trace), 0);
  std::uint64_t live = 0, peak = 0;
  for (const TraceOp& op : trace) {
    if (op.bytes == 0) {
      live -= sizes[op.slot];
      sizes[op.slot] = 0;
    } else {
      sizes[op.slot] = op.bytes;
      live += op.bytes;
      peak = std::max(peak, live);
    }
  }
  return peak;
}

// The trace on `threads` threads at once, each with its own trace, for a fixed window: every thread
// runs its trace once (the warm-up: its thread cache and arena shard as a long-running service's
// threads have them; a thread's cache ends with the thread), then all repeat theirs from a common
// start until the main thread stops them after `window`. ns per operation = the window / the
// operations all threads finished in it, with the device calls made meanwhile (where the
// allocator counts them). A window rather than one pass each: a pass takes a few milliseconds,
// about what waking 16 threads and a few device calls take, and the figure would be theirs.
struct ThreadedRun {
  double ns_per_op;
  std::optional<std::uint64_t> device_calls;
};
std::optional<ThreadedRun> threaded_trace_ns(Allocator& allocator, int threads, std::size_t ops,
                                             std::chrono::milliseconds window) {
  std::vector<std::vector<TraceOp>> traces;
  for (int t = 0; t < threads; ++t) traces.push_back(random_trace(1000 + static_cast<std::uint64_t>(t), ops));
  std::vector<std::unique_ptr<Allocator::Slots>> contexts;
  for (int t = 0; t < threads; ++t)
    contexts.push_back(allocator.slots(slots_of(traces[t]), static_cast<std::size_t>(t)));
  struct alignas(64) Counted {  // a line of its own per thread
    std::uint64_t ops = 0;
  };
  std::vector<Counted> counted(static_cast<std::size_t>(threads));
  std::atomic<bool> failed{false}, stop{false};
  // The window opens as the last thread reaches the second meeting point, before any thread goes
  // on: the main thread may wake well after the others started counting.
  Clock::time_point start{};
  int meetings = 0;
  std::barrier meet(threads + 1, [&]() noexcept {
    if (++meetings == 2) start = Clock::now();
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      Allocator::Slots& slots = *contexts[t];
      meet.arrive_and_wait();
      if (!run_trace(slots, traces[t])) failed = true;
      meet.arrive_and_wait();
      // Whole passes, so that each ends with nothing live; the pass in which the stop is seen is
      // finished uncounted.
      std::uint64_t done = 0;
      for (bool counting = !failed; counting;) {
        for (const TraceOp& op : traces[t]) {
          if (op.bytes == 0) slots.free(op.slot);
          else if (!slots.alloc(op.slot, op.bytes)) failed = true;
          if (counting && (++done & 255) == 0 && stop.load(std::memory_order_relaxed)) counting = false;
          if (failed) break;
        }
        if (failed) counting = false;
      }
      counted[static_cast<std::size_t>(t)].ops = done;
      meet.arrive_and_wait();
    });
  meet.arrive_and_wait();
  meet.arrive_and_wait();  // every warm-up done
  const std::optional<std::uint64_t> calls_before = allocator.device_calls();
  std::this_thread::sleep_until(start + window);
  stop.store(true, std::memory_order_relaxed);
  const double wall = ns_since(start);
  meet.arrive_and_wait();  // every thread's last pass finished
  const std::optional<std::uint64_t> calls_after = allocator.device_calls();
  for (auto& worker : workers) worker.join();
  if (failed) return std::nullopt;
  std::uint64_t total = 0;
  for (const Counted& c : counted) total += c.ops;
  if (total == 0) return std::nullopt;
  return ThreadedRun{wall / static_cast<double>(total), calls_between(calls_before, calls_after)};
}

std::string short_bytes(std::uint64_t bytes) {
  if (bytes >= (1ull << 20)) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1ull << 10)) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

struct Row {
  std::string bench, allocator, key;
  std::uint64_t size = 0;
  int threads = 0;
  double value = 0;
  std::string unit;
  std::optional<std::uint64_t> device_calls = {};  // made by a timed run, where counted
  std::size_t devices = 1;  // the threads rows: the devices the threads are spread over
  std::optional<double> core_check_ns = {};  // the pair and trace rows: the core check just before
};

class Report {
 public:
  // `json`: open, or not open when no JSON file was asked for.
  Report(std::string device, std::ofstream json) : device_(std::move(device)), json_(std::move(json)) {}
  void add(Row row) {
    std::string what = row.size      ? short_bytes(row.size)
                       : row.threads ? fmt::format("{} threads{}", row.threads,
                                                   row.devices > 1 ? fmt::format(", {} dev", row.devices) : "")
                                     : row.key;
    std::string calls = row.device_calls ? fmt::format(" ({} device calls)", *row.device_calls) : "";
    if (row.core_check_ns) calls += fmt::format(" (core check {:.2f} ns)", *row.core_check_ns);
    if (row.unit == "ns/op")
      fmt::print("{:<14} {:<16} {:<20} {:>10.1f} {}{}\n", row.bench, row.allocator, what, row.value,
                 row.unit, calls);
    else
      fmt::print("{:<14} {:<16} {:<20} {:>10.3f} {}\n", row.bench, row.allocator, what, row.value, row.unit);
    std::fflush(stdout);
    if (!json_) return;
    nlohmann::json line{{"bench", row.bench}, {"allocator", row.allocator}, {"device", device_}};
    if (row.size) line["size"] = row.size;
    if (row.threads) line["threads"] = row.threads;
    if (row.devices > 1) line["devices"] = row.devices;
    if (!row.key.empty()) line["trace"] = row.key;
    line[row.unit == "ns/op" ? "ns_per_op" : "fragmentation"] = row.value;
    if (row.device_calls) line["device_calls"] = *row.device_calls;
    if (row.core_check_ns) line["core_check_ns"] = *row.core_check_ns;
    json_ << line.dump() << '\n';
  }
  // One device's pool figures after a threads run spread over several devices.
  void add_device_figures(const std::string& allocator, const Device& device, const PoolStats& s) {
    const std::string name = fmt::format("{}:{}", device.kind() == DeviceKind::Cuda ? "cuda" : "sim",
                                         device.properties().ordinal);
    fmt::print("{:<14} {:<16} {:<20} {} allocations, {:.1f}% from the cache, peak reserved {}, "
               "{} device calls\n",
               "devices", allocator, name, s.allocations, 100.0 * s.hit_rate(),
               format_bytes(s.peak_reserved_bytes), s.device_allocations + s.device_frees);
    std::fflush(stdout);
    if (!json_) return;
    nlohmann::json line{{"bench", "devices"}, {"allocator", allocator}, {"device", device_},
                        {"on_device", name}, {"allocations", s.allocations},
                        {"hit_rate", s.hit_rate()}, {"peak_reserved_bytes", s.peak_reserved_bytes},
                        {"device_calls", s.device_allocations + s.device_frees}};
    json_ << line.dump() << '\n';
  }

 private:
  std::string device_;
  std::ofstream json_;
};

// The threads rows; over several devices, then each device's pool figures.
void bench_threads(Allocator& allocator, const Options& options, Report& report) {
  if (!options.wants("threads")) return;
  for (int threads : options.thread_counts) {
    auto run = threaded_trace_ns(allocator, threads, options.quick ? 5'000 : 50'000,
                                 std::chrono::milliseconds(options.quick ? 20 : 250));
    if (!run) continue;
    report.add({"threads", allocator.name(), "random", 0, threads, run->ns_per_op, "ns/op",
                run->device_calls, allocator.device_count()});
  }
  if (const auto* ours = dynamic_cast<const GpupoolAllocator*>(&allocator); ours && ours->device_count() > 1)
    for (const Device& device : ours->devices())
      report.add_device_figures(ours->name(), device, ours->stats(device));
}

void bench_allocator(Allocator& allocator, const Options& options, Report& report) {
  const int rounds = options.quick ? 3 : 9;
  const int pairs = options.quick ? 20'000 : 200'000;
  for (std::uint64_t bytes : {256ull, 4096ull, 65536ull, 1ull << 20, 16ull << 20, 256ull << 20}) {
    if (!options.wants("pair")) break;
    const double check = core_check_ns();
    auto ns = pair_ns(allocator, bytes, rounds, pairs);
    if (ns) report.add({"pair", allocator.name(), "", bytes, 0, *ns, "ns/op", {}, 1, check});
    else fmt::print(stderr, "pool_bench: {} could not allocate {}\n", allocator.name(), format_bytes(bytes));
  }
  allocator.release_cache();

  const std::size_t trace_ops = options.quick ? 20'000 : 200'000;
  auto trace = random_trace(42, trace_ops);
  if (options.wants("trace")) {
    auto slots = allocator.slots(slots_of(trace));
    (void)run_trace(*slots, trace);  // warm-up: the cache holds what the trace needs
    // The median of a few runs: one run on a busy host can take twice as long.
    const double check = core_check_ns();
    const std::optional<std::uint64_t> calls_before = allocator.device_calls();
    std::vector<double> runs;
    for (int r = 0; r < (options.quick ? 1 : 5); ++r)
      if (auto ns = run_trace(*slots, trace)) runs.push_back(*ns);
    const std::optional<std::uint64_t> calls =
        calls_between(calls_before, allocator.device_calls());
    if (!runs.empty()) {
      std::sort(runs.begin(), runs.end());
      report.add({"trace", allocator.name(), "random", 0, 0, runs[runs.size() / 2], "ns/op", calls, 1,
                  check});
    }
  }
  bench_threads(allocator, options, report);

  for (const NamedTrace& named : options.fragmentation) {
    if (!options.wants("fragmentation")) break;
    allocator.release_cache();
    allocator.reset_peaks();
    auto slots = allocator.slots(slots_of(named.trace));
    if (!run_trace(*slots, named.trace)) continue;
    double ratio = static_cast<double>(allocator.peak_reserved()) /
                   static_cast<double>(peak_requested(named.trace));
    report.add({"fragmentation", allocator.name(), named.name, 0, 0, ratio, "peak reserved/requested"});
  }
  allocator.release_cache();
}

// Fragmentation the pool is held to: virtual segments under a hard limit of limit_ratio x the
// trace's peak. Without a limit the pool grows rather than move pages (a move synchronizes the
// device and unmaps); under one, the pages lying wholly in free space move to the blocks that need
// them. The rows say whether the trace ran within the limit, its peak reserved / peak requested,
// and the ns per operation and device calls of that one run from an empty pool.
void bench_limited_fragmentation(const Device& device, const Options& options, Report& report) {
  for (const NamedTrace& named : options.fragmentation) {
    const std::uint64_t peak = peak_requested(named.trace);
    const auto limit = static_cast<std::size_t>(options.limit_ratio * static_cast<double>(peak));
    GpupoolAllocator limited(device, "gpupool/virtual",
                             PoolConfig{.max_pool_size = limit, .virtual_segments = true});
    auto slots = limited.slots(slots_of(named.trace));
    const std::optional<std::uint64_t> calls_before = limited.device_calls();
    auto ns = run_trace(*slots, named.trace);
    const std::string key = fmt::format("{} under {:.2f}x", named.name, options.limit_ratio);
    if (!ns) {
      fmt::print("{:<14} {:<16} {:<20} {:>10} (an allocation failed under the limit)\n",
                 "fragmentation", limited.name(), key, "-");
      continue;
    }
    const std::optional<std::uint64_t> calls = calls_between(calls_before, limited.device_calls());
    report.add({"fragmentation", limited.name(), key, 0, 0,
                static_cast<double>(limited.peak_reserved()) / static_cast<double>(peak),
                "peak reserved/requested"});
    report.add({"limited trace", limited.name(), key, 0, 0, *ns, "ns/op", calls});
  }
}

}  // namespace

namespace {

// "1,2,4": each a whole number from 1 to 1024; nullopt for anything else.
std::optional<std::vector<int>> parse_thread_counts(std::string_view list) {
  std::vector<int> counts;
  while (true) {
    const auto comma = list.find(',');
    const std::string_view item = list.substr(0, comma);
    int count = 0;
    auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), count);
    if (item.empty() || error != std::errc{} || end != item.data() + item.size() || count < 1 ||
        count > 1024)
      return std::nullopt;
    counts.push_back(count);
    if (comma == std::string_view::npos) return counts;
    list.remove_prefix(comma + 1);
  }
}

// The devices of --devices: the first device, then (on CUDA) the host's other GPUs in ordinal
// order, or more simulated devices of the first one's size; "all" is every GPU (one simulated
// device); empty is the first alone.
Result<std::vector<Device>> bench_devices(const Device& first, std::string_view spec) {
  const bool cuda = first.kind() == DeviceKind::Cuda;
  std::size_t count = 1;
  if (spec == "all") {
    count = cuda ? static_cast<std::size_t>(Device::cuda_device_count()) : 1;
  } else if (!spec.empty()) {
    auto [end, error] = std::from_chars(spec.data(), spec.data() + spec.size(), count);
    if (error != std::errc{} || end != spec.data() + spec.size() || count < 1 || count > 64)
      return make_error(ErrorKind::InvalidInput, "expected a device count from 1 to 64, or all");
    if (cuda && count > static_cast<std::size_t>(Device::cuda_device_count()))
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("{} devices asked for; this host has {} GPUs", count,
                                    Device::cuda_device_count()));
  }
  std::vector<Device> devices{first};
  const int first_ordinal = first.properties().ordinal;
  for (int ordinal = 0; cuda && devices.size() < count; ++ordinal) {
    if (ordinal == first_ordinal) continue;
    auto device = Device::cuda(ordinal);
    if (!device) return std::unexpected(device.error());
    devices.push_back(std::move(*device));
  }
  while (!cuda && devices.size() < count) {
    auto device = Device::simulated({.capacity = first.properties().total_memory});
    if (!device) return std::unexpected(device.error());
    devices.push_back(std::move(*device));
  }
  return devices;
}

bool known_bench(std::string_view name) {
  return name == "pair" || name == "trace" || name == "threads" || name == "fragmentation";
}

}  // namespace

int bench::run_pool_bench(int argc, char** argv) {
  Options options;
  bool usage_error = false;
  for (int i = 1; i < argc && !usage_error; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--quick") options.quick = true;
    else if (arg == "--core-check") options.core_check_only = true;
    else if (arg == "--json" && i + 1 < argc) options.json_path = argv[++i];
    else if (arg == "--only" && i + 1 < argc) {
      options.only = argv[++i];
      usage_error = !known_bench(options.only);
    } else if (arg == "--limit" && i + 1 < argc) {
      const std::string_view text = argv[++i];
      auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), options.limit_ratio);
      usage_error = error != std::errc{} || end != text.data() + text.size() ||
                    !(options.limit_ratio >= 1.0 && options.limit_ratio <= 4.0);
    } else if (arg == "--trace" && i + 1 < argc) {
      const std::string path = argv[++i];
      auto recorded = read_trace(path);
      if (!recorded) {
        fmt::print(stderr, "pool_bench: --trace {}: {}\n", path, recorded.error().message());
        return 2;
      }
      std::string name = std::filesystem::path(path).filename().string();
      name = name.substr(0, name.find('.'));
      options.recorded.push_back({std::move(name), ops_of(*recorded)});
    } else if (arg == "--heap-pad" && i + 1 < argc) {
      const std::string_view text = argv[++i];
      auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), options.heap_pad);
      usage_error = error != std::errc{} || end != text.data() + text.size() || options.heap_pad > (1u << 20);
    } else if (arg == "--devices" && i + 1 < argc) {
      options.devices = argv[++i];
    } else if (arg == "--threads" && i + 1 < argc) {
      auto counts = parse_thread_counts(argv[++i]);
      if (counts) options.thread_counts = std::move(*counts);
      usage_error = !counts;
    } else {
      usage_error = true;
    }
  }
  if (usage_error) {
    fmt::print(stderr,
               "usage: pool_bench (or gpupool bench) [--quick] [--json FILE] [--threads 1,2,4,8,16]\n"
               "                  [--only pair|trace|threads|fragmentation] [--limit RATIO]\n"
               "                  [--trace FILE]... [--devices N|all] [--heap-pad BYTES]\n"
               "       pool_bench --core-check\n"
               "  --threads: whole numbers from 1 to 1024, comma-separated\n"
               "  --devices: N or all: the threads rows put thread t on device t % N (every GPU,\n"
               "             or N simulated devices); the other rows run on the first\n"
               "  --limit: the hard limit of the limited fragmentation rows, as a multiple of the\n"
               "           trace's peak (1 to 4, default 1.02)\n"
               "  --trace: also a recorded pool trace in the fragmentation rows (gpupool replay's\n"
               "           CSV or JSON; repeatable)\n"
               "  --heap-pad: hold this many bytes (0 to 1 MiB) on the heap first, moving the pools\n"
               "              and the slots against the stack, to find layout effects\n"
               "  --core-check: print this core's check (ns a step of a loop bound by its issue\n"
               "                width) and stop: bench/pool_on_quiet_core.sh picks a core by it\n"
               "  device: GPUPOOL_DEVICE (cuda:N, sim, sim:SIZE; default: a GPU if any, else sim:64GiB)\n");
    return 2;
  }
  if (options.core_check_only) {
    fmt::print("core check {:.3f} ns\n", core_check_ns());
    return 0;
  }
  std::ofstream json;
  if (!options.json_path.empty()) {
    json.open(options.json_path);
    if (!json) {
      fmt::print(stderr, "pool_bench: cannot write the JSON file {} ({})\n", options.json_path,
                 std::strerror(errno));
      return 1;
    }
  }
  auto device = Device::from_environment("auto");
  if (device && device->kind() == DeviceKind::Simulated && !std::getenv("GPUPOOL_DEVICE"))
    device = Device::simulated({.capacity = 64ull << 30});  // a simulated device never touches these pages
  if (!device) {
    fmt::print(stderr, "pool_bench: {}\n", device.error().message());
    return 1;
  }
  auto devices = bench_devices(*device, options.devices);
  if (!devices) {
    fmt::print(stderr, "pool_bench: --devices {}: {}\n", options.devices, devices.error().message());
    return 2;
  }
  std::string device_name = device->properties().name;
  const std::unique_ptr<std::byte[]> heap_pad(options.heap_pad ? new std::byte[options.heap_pad] : nullptr);
  fmt::print("pool_bench on {} ({} threads of hardware)\n", device_name, std::thread::hardware_concurrency());
  fmt::print("{:<14} {:<16} {:<20} {:>10} {}\n", "bench", "allocator", "case", "value", "unit");
  if (options.wants("fragmentation")) options.fragmentation = fragmentation_traces(options);
  Report report(device_name, std::move(json));
  GpupoolAllocator ours(*devices, "gpupool");
  bench_allocator(ours, options, report);
  GpupoolAllocator virtual_segments(*devices, "gpupool/virtual", PoolConfig{.virtual_segments = true});
  bench_allocator(virtual_segments, options, report);
  GpupoolAllocator page_budget(*devices, "gpupool/budget",
                               PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.01});
  bench_allocator(page_budget, options, report);
  if (options.wants("fragmentation")) bench_limited_fragmentation(*device, options, report);
#if GPUPOOL_WITH_CUDA
  if (device->kind() == DeviceKind::Cuda) {
    std::vector<int> ordinals;
    for (const Device& d : *devices) ordinals.push_back(d.properties().ordinal);
    CudaMallocAsyncAllocator peer(std::move(ordinals));
    bench_allocator(peer, options, report);
  }
#endif
  return 0;
}

}  // namespace gpupool
