#!/usr/bin/env python3
"""PyTorch's CUDA caching allocator on pool_bench's traces, called from C++.

Builds (torch.utils.cpp_extension.load_inline, with the machine's g++) a small C++ loop that
calls c10::cuda::CUDACachingAllocator::raw_alloc / raw_delete, the allocator torch tensors use,
and runs the cases of bench/pool_bench.cpp on the same traces (its splitmix64 generator is
mirrored here bit for bit): pair (alloc+free of one size on a hit, median of rounds), trace (the
random trace, ns/op), threads (1..16 threads, each its own trace repeated for a 250 ms window,
the window over all ops finished in it) and
fragmentation (peak reserved / peak requested from torch.cuda.memory_stats). Prints the same
table as pool_bench and, with --json FILE, the same JSON lines (allocator "torch").
Exits 0 with a message when PyTorch or a GPU is missing.
"""
import argparse
import json
import sys

try:
    import torch
    from torch.utils.cpp_extension import load_inline
except ImportError:
    print("torch_allocator: PyTorch is not installed; nothing measured")
    sys.exit(0)

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace {
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};
struct Op { uint32_t slot; uint64_t bytes; };

std::vector<Op> random_trace(uint64_t seed, size_t ops) {
  const size_t max_live = 1000;
  const uint64_t max_bytes = 4ull << 20;
  SplitMix64 rng{seed};
  std::vector<uint32_t> live, free_slots;
  for (uint32_t s = max_live; s-- > 0;) free_slots.push_back(s);
  std::vector<Op> trace;
  while (trace.size() < ops) {
    bool alloc = live.empty() || (live.size() < max_live && (rng.next() & 1));
    if (alloc) {
      uint32_t slot = free_slots.back(); free_slots.pop_back(); live.push_back(slot);
      trace.push_back({slot, 1 + rng.next() % max_bytes});
    } else {
      size_t i = rng.next() % live.size();
      uint32_t slot = live[i]; live[i] = live.back(); live.pop_back(); free_slots.push_back(slot);
      trace.push_back({slot, 0});
    }
  }
  for (uint32_t slot : live) trace.push_back({slot, 0});
  return trace;
}

std::vector<Op> ann_serving_trace(uint64_t seed, size_t bursts) {
  SplitMix64 rng{seed};
  std::vector<Op> trace;
  auto shard_bytes = [&] { return (96ull << 20) + (rng.next() % 65) * (1ull << 20); };
  for (uint32_t shard = 0; shard < 4; ++shard) trace.push_back({shard, shard_bytes()});
  for (size_t burst = 0; burst < bursts; ++burst) {
    if (burst % 200 == 199) {
      auto shard = static_cast<uint32_t>(rng.next() % 4);
      trace.push_back({shard, 0});
      trace.push_back({shard, shard_bytes()});
    }
    size_t count = 8 + rng.next() % 57;
    for (uint32_t i = 0; i < count; ++i) {
      uint64_t batch = 1 + rng.next() % 1024, bytes = 0;
      switch (rng.next() % 3) {
        case 0: bytes = batch * 128 * 4; break;
        case 1: bytes = batch * 4096 * 4; break;
        default: bytes = batch * 100 * 8; break;
      }
      trace.push_back({4 + i, bytes});
    }
    for (uint32_t i = 0; i < count; ++i) trace.push_back({4 + i, 0});
  }
  for (uint32_t shard = 0; shard < 4; ++shard) trace.push_back({shard, 0});
  return trace;
}

uint32_t slots_of(const std::vector<Op>& t) {
  uint32_t n = 0; for (auto& op : t) n = std::max(n, op.slot + 1); return n;
}

double run(const std::vector<Op>& trace, std::vector<void*>& ptrs) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  auto start = std::chrono::steady_clock::now();
  for (const Op& op : trace) {
    if (op.bytes == 0) { alloc::raw_delete(ptrs[op.slot]); ptrs[op.slot] = nullptr; }
    else ptrs[op.slot] = alloc::raw_alloc(op.bytes);
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

double pair_ns(int64_t bytes, int64_t rounds, int64_t pairs) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  alloc::raw_delete(alloc::raw_alloc(bytes));
  std::vector<double> per_round;
  for (int64_t r = 0; r < rounds; ++r) {
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < pairs; ++i) alloc::raw_delete(alloc::raw_alloc(bytes));
    per_round.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / pairs);
  }
  std::sort(per_round.begin(), per_round.end());
  return per_round[per_round.size() / 2];
}

double trace_ns(int64_t seed, int64_t ops, bool warm) {
  auto trace = random_trace(seed, ops);
  std::vector<void*> ptrs(slots_of(trace), nullptr);
  if (warm) run(trace, ptrs);
  return run(trace, ptrs) / trace.size();
}

double ann_trace(int64_t seed, int64_t bursts) {
  auto trace = ann_serving_trace(seed, bursts);
  std::vector<void*> ptrs(slots_of(trace), nullptr);
  return run(trace, ptrs) / trace.size();
}

// pool_bench's threads case: each thread runs its trace once (warm-up), then all repeat theirs
// from a common start until stopped after window_ms; the window / the operations finished in it.
double threads_ns(int64_t threads, int64_t ops, int64_t window_ms) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  std::vector<std::vector<Op>> traces;
  for (int64_t t = 0; t < threads; ++t) traces.push_back(random_trace(1000 + t, ops));
  std::vector<std::vector<void*>> ptrs;
  for (auto& trace : traces) ptrs.emplace_back(slots_of(trace), nullptr);
  struct alignas(64) Counted { uint64_t ops = 0; };
  std::vector<Counted> counted(threads);
  std::atomic<int> warm{0};
  std::atomic<bool> go{false}, stop{false};
  int device = c10::cuda::current_device();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      c10::cuda::set_device(device);
      run(traces[t], ptrs[t]);
      warm.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      uint64_t done = 0;
      for (bool counting = true; counting;)
        for (const Op& op : traces[t]) {
          if (op.bytes == 0) { alloc::raw_delete(ptrs[t][op.slot]); ptrs[t][op.slot] = nullptr; }
          else ptrs[t][op.slot] = alloc::raw_alloc(op.bytes);
          if (counting && (++done & 255) == 0 && stop.load(std::memory_order_relaxed)) counting = false;
        }
      counted[t].ops = done;
    });
  while (warm.load() < threads) std::this_thread::yield();
  go.store(true);
  auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(window_ms));
  stop.store(true);
  double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  for (auto& th : pool) th.join();
  uint64_t total = 0; for (auto& c : counted) total += c.ops;
  return wall / static_cast<double>(total);
}

std::vector<int64_t> peak_requested(int64_t which, int64_t seed, int64_t n) {
  auto trace = which == 0 ? random_trace(seed, n) : ann_serving_trace(seed, n);
  std::vector<uint64_t> sizes(slots_of(trace), 0);
  uint64_t live = 0, peak = 0;
  for (auto& op : trace) {
    if (op.bytes == 0) { live -= sizes[op.slot]; sizes[op.slot] = 0; }
    else { sizes[op.slot] = op.bytes; live += op.bytes; peak = std::max(peak, live); }
  }
  return {static_cast<int64_t>(peak)};
}

void run_random(int64_t seed, int64_t ops) {
  auto trace = random_trace(seed, ops);
  std::vector<void*> ptrs(slots_of(trace), nullptr);
  run(trace, ptrs);
}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write JSON lines here")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("torch_allocator: no CUDA device; nothing measured")
        return 0
    ext = load_inline("gpupool_torch_allocator_peer", cpp_sources=CPP,
                      functions=["pair_ns", "trace_ns", "ann_trace", "threads_ns", "peak_requested",
                                 "run_random"],
                      extra_cflags=["-O2"], with_cuda=True, verbose=False)
    device = torch.cuda.get_device_name(0)
    out = open(args.json, "w") if args.json else None
    print(f"torch_allocator on {device} (PyTorch {torch.__version__})")

    def report(bench, case, value, unit, **keys):
        fmt = "{:>10.1f}" if unit == "ns/op" else "{:>10.3f}"
        print(f"{bench:<14} {'torch':<16} {case:<20} " + fmt.format(value) + f" {unit}", flush=True)
        if out:
            line = {"bench": bench, "allocator": "torch", "device": device, **keys}
            line["ns_per_op" if unit == "ns/op" else "fragmentation"] = value
            out.write(json.dumps(line) + "\n")

    rounds, pairs = (3, 20000) if args.quick else (9, 200000)
    for size in [256, 4096, 65536, 1 << 20, 16 << 20, 256 << 20]:
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1024 else f"{size} B"
        report("pair", label, ext.pair_ns(size, rounds, pairs), "ns/op", size=size)
    ops = 20000 if args.quick else 200000
    report("trace", "random", ext.trace_ns(42, ops, True), "ns/op", trace="random")
    for threads in [1, 2, 4, 8, 16]:
        report("threads", f"{threads} threads",
               ext.threads_ns(threads, 5000 if args.quick else 50000, 20 if args.quick else 250),
               "ns/op", threads=threads)
    for name, which, seed, n in [("random", 0, 7, ops), ("ann_serving", 1, 11, 200 if args.quick else 2000)]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if which == 0:
            ext.run_random(seed, n)
        else:
            ext.ann_trace(seed, n)
        reserved = torch.cuda.memory_stats()["reserved_bytes.all.peak"]
        report("fragmentation", name, reserved / ext.peak_requested(which, seed, n)[0],
               "peak reserved/requested", trace=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
