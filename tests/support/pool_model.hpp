// A GpuMemoryPool on a simulated device, driven by a list of operations and checked after every
// one against a simple model of what the pool must hold. The rapidcheck property
// (tests/pool_property_test.cpp) and the libFuzzer target (fuzz/fuzz_pool.cpp) share it, so both
// check the same invariants:
//   - live buffers never overlap, and each keeps the bytes written into it (its first and last
//     16 bytes and two between: the overlap check covers every byte, the pattern catches stray
//     writes — and fresh pages are not all touched);
//   - a buffer's block is its request rounded by the documented size-class rule;
//   - (blocks above 64 KiB share device segments: free space stranded in a segment that live
//     blocks still use is the only reason a fitting request may fail or a cleanup keep bytes —
//     within a batch, also the rest of a free segment the batch's own large block came from;
//     with virtual segments, the free parts of pages live blocks touch, and the pages a new
//     block's ends share with nothing yet);
//   - in use, requested, live count, allocations and frees equal the model's exactly;
//   - reserved = in use + cached, and the device holds exactly the reserved bytes;
//   - an allocation succeeds exactly when in use + its block fits both the hard limit and the
//     device (the simulated device has no fragmentation, and the pool trims its cache first);
//     a batch likewise, all or nothing;
//   - trim(keep) leaves at most `keep` cached and reports what it gave back;
//   - after everything is freed and emergency_cleanup_all(), the device holds 0 bytes.
// Include after `import gpupool;`.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gpupool::testing {

struct PoolOp {
  enum Kind : std::uint8_t { Alloc, Free, Release, Batch, Trim, Cleanup, SetLimit, ClearLimit, SetCacheCap, kKinds };
  Kind kind = Alloc;
  std::uint32_t a = 0;  // meaning depends on kind: size seed, index, keep bytes, limit ...
  std::uint32_t b = 0;  // second operand: precision, batch length ...
};

// The fuzz targets' encoding: 6 bytes per operation, a kind byte, 4 bytes of `a` (little-endian
// on the machines we run), 1 byte of `b`.
constexpr std::size_t kBytesPerOp = 6;
inline PoolOp decode_op(const std::uint8_t* bytes) {
  PoolOp op;
  op.kind = static_cast<PoolOp::Kind>(bytes[0] % PoolOp::kKinds);
  std::memcpy(&op.a, bytes + 1, sizeof op.a);
  op.b = bytes[5];
  return op;
}

// The size-class rule of docs/pool.md, written independently of pool/size_classes.cppm:
// 256-byte steps up to 4 KiB, then 16 equal steps per power of two.
inline std::size_t model_class_bytes(std::size_t bytes) {
  if (bytes <= 4096) return (bytes + 255) / 256 * 256;
  std::size_t power = 1;
  while (power * 2 < bytes) power *= 2;  // bytes in (power, 2 power]
  std::size_t step = power / 16;
  return (bytes + step - 1) / step * step;
}
// docs/pool.md: blocks are carved from segments above 64 KiB, from virtual segments above 4 KiB.
inline constexpr std::size_t kModelArenaThreshold = std::size_t{64} << 10;
inline constexpr std::size_t kModelVirtualArenaThreshold = std::size_t{4} << 10;
// The least block a request gets: its class's bytes up to the threshold; above, carved from a
// segment, the request rounded up to 256 bytes (a cached block of the class may be larger, up to
// the class's bytes).
inline std::size_t model_block_bytes(std::size_t bytes,
                                     std::size_t threshold = kModelArenaThreshold) {
  if (bytes <= threshold) return model_class_bytes(bytes);
  return (bytes + 255) / 256 * 256;
}
inline bool model_block_holds(std::size_t bytes, std::size_t block,
                              std::size_t threshold = kModelArenaThreshold) {
  return block >= model_block_bytes(bytes, threshold) && block <= model_class_bytes(bytes) &&
         block % 256 == 0;
}

class PoolModelChecker {
 public:
  static constexpr std::size_t kCapacity = std::size_t{16} << 20;

  // A device of kCapacity bytes that holds nothing: one may serve many checkers, one at a time
  // (each gives every byte back in finish()). Its memory is reserved up front: the pool never
  // touches device bytes, and a heap block per device allocation cost most of a fuzz run.
  // Its pages (virtual segments) are 64 KiB, so that 16 MiB holds enough of them to fragment.
  static constexpr std::size_t kPageBytes = std::size_t{64} << 10;
  static Device make_device() {
    return *Device::simulated({.capacity = kCapacity, .name = "pool model", .reserved_memory = true,
                               .page_bytes = kPageBytes});
  }

  PoolModelChecker() : PoolModelChecker(make_device()) {}
  // `virtual_segments`: blocks above 4 KiB from virtual segments (PoolConfig::virtual_segments).
  explicit PoolModelChecker(Device device, bool virtual_segments = false)
      : device_(std::move(device)),
        virtual_segments_(virtual_segments),
        arena_threshold_(virtual_segments ? kModelVirtualArenaThreshold : kModelArenaThreshold),
        pool_(PoolConfig{.virtual_segments = virtual_segments}) {}

  // Runs one operation; returns a description of the first broken invariant, if any.
  std::optional<std::string> apply(const PoolOp& op) {
    ++step_;
    switch (op.kind) {
      case PoolOp::Alloc: return allocate_one(op);
      case PoolOp::Free: return free_one(op, /*explicit_release=*/false);
      case PoolOp::Release: return free_one(op, /*explicit_release=*/true);
      case PoolOp::Batch: return allocate_batch(op);
      case PoolOp::Trim: return trim(op);
      case PoolOp::Cleanup: return cleanup();
      case PoolOp::SetLimit: return set_limit(std::size_t{op.a % 64 + 1} << 18);  // 256 KiB .. 16 MiB
      case PoolOp::ClearLimit: return set_limit(std::nullopt);
      case PoolOp::SetCacheCap: return set_cache_cap(op);
      case PoolOp::kKinds: break;
    }
    return std::nullopt;
  }

  // Frees everything, empties the cache and checks the device got every byte back.
  std::optional<std::string> finish() {
    // Each free still checks its buffer's pattern; the figures are checked once, at the end.
    while (!live_.empty()) {
      if (auto failure = free_one(PoolOp{PoolOp::Free, 0, 0}, false, false)) return failure;
    }
    pool_.emergency_cleanup_all();
    if (auto failure = check_invariants("finish")) return failure;
    auto memory = device_.memory_info();
    if (memory->free != memory->total)
      return fmt::format("after emergency_cleanup_all the device still holds {} bytes",
                         memory->total - memory->free);
    if (pool_.stats(device_).reserved_bytes != 0)
      return fmt::format("after emergency_cleanup_all the pool reserves {} bytes",
                         pool_.stats(device_).reserved_bytes);
    return std::nullopt;
  }

 private:
  struct Live {
    ManagedBuffer buffer;
    std::size_t requested;
    std::size_t block;
    std::uint8_t pattern;
  };

  // Sizes spread over 1 B .. 2 MiB on a log scale, so small and large classes both get traffic.
  static std::size_t size_from(std::uint32_t seed) {
    std::uint32_t bits = seed % 22;  // up to 2^21
    std::size_t span = std::size_t{1} << bits;
    return 1 + (seed / 22) % span;
  }
  static Precision precision_from(std::uint32_t seed) {
    constexpr Precision all[] = {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8,
                                 Precision::Bytes};
    return all[seed % 5];
  }

  std::size_t in_use() const { return in_use_; }
 public:
  // The places of a buffer of `bytes` bytes that carry its pattern: its first and last 16 bytes,
  // and one at each third.
  template <class Visit>
  static void for_each_probe(std::size_t bytes, Visit visit) {
    for (std::size_t at = 0; at < std::min<std::size_t>(bytes, 16); ++at) visit(at);
    for (std::size_t at = bytes > 16 ? std::max<std::size_t>(16, bytes - 16) : bytes; at < bytes; ++at)
      visit(at);
    visit(bytes / 3);
    visit(2 * bytes / 3);
  }

 private:
  std::size_t fits_up_to() const { return limit_ ? std::min(*limit_, kCapacity) : kCapacity; }

  std::optional<std::string> allocate_one(const PoolOp& op) {
    Precision precision = precision_from(op.b);
    std::size_t element_bytes = element_size(precision);
    std::size_t elements = std::max<std::size_t>(1, size_from(op.a) / element_bytes);
    std::size_t bytes = elements * element_bytes;
    std::size_t block = model_block_bytes(bytes, arena_threshold_);
    bool should_fit = in_use() + block <= fits_up_to();
    auto buffer = pool_.get_managed_buffer(device_, elements, precision);
    if (!buffer && should_fit && may_fail_for_stranded(block, block > arena_threshold_ ? 1 : 0))
      return check_invariants("failed alloc");
    if (buffer.has_value() != should_fit)
      return fmt::format("alloc of {} bytes (block {}) with {} in use, fit limit {}: expected {}, got {}",
                         bytes, block, in_use(), fits_up_to(), should_fit ? "success" : "failure",
                         buffer ? "success" : buffer.error().message());
    if (!buffer) {
      ErrorKind kind = buffer.error().kind();
      if (kind != ErrorKind::OutOfMemory && kind != ErrorKind::PoolLimitExceeded)
        return fmt::format("alloc failed with an unexpected kind: {}", buffer.error().message());
      return check_invariants("failed alloc");
    }
    if (!model_block_holds(bytes, buffer->capacity_bytes(), arena_threshold_) ||
        buffer->size_bytes() != bytes ||
        buffer->precision() != precision || buffer->element_count() != elements)
      return fmt::format("buffer of {} bytes has block {} (expected {} .. {}), size {}, {} elements",
                         bytes, buffer->capacity_bytes(), block, model_class_bytes(bytes),
                         buffer->size_bytes(), buffer->element_count());
    if (in_use() + buffer->capacity_bytes() > fits_up_to())
      return fmt::format("a cached block of {} bytes for {} took the pool past its limit {}",
                         buffer->capacity_bytes(), bytes, fits_up_to());
    const std::size_t capacity = buffer->capacity_bytes();
    return adopt(std::move(*buffer), bytes, capacity);
  }

  std::optional<std::string> allocate_batch(const PoolOp& op) {
    std::size_t count = op.b % 4 + 1;
    std::vector<BufferRequest> requests;
    std::size_t blocks = 0;
    for (std::size_t i = 0; i < count; ++i) {
      std::size_t bytes = size_from(op.a * 7919u + static_cast<std::uint32_t>(i) * 104729u) % (1u << 20) + 1;
      requests.push_back({bytes, Precision::Bytes});
      blocks += model_block_bytes(bytes, arena_threshold_);
    }
    bool should_fit = in_use() + blocks <= fits_up_to();
    // A carved block may come from a free segment and strand the segment's rest, which a
    // later request of the same batch then lacks: the batch may fail when the whole cache, as
    // well as its blocks, does not fit.
    bool strands_own_segments = false;
    const auto carved = [this](const BufferRequest& r) {
      return model_block_bytes(r.elements, arena_threshold_) > arena_threshold_;
    };
    if (should_fit && std::ranges::any_of(requests, carved))
      strands_own_segments = in_use() + pool_.stats(device_).cached_bytes + blocks > fits_up_to();
    auto batch = pool_.create_buffer_batch(device_, requests);
    const auto large = static_cast<std::size_t>(std::ranges::count_if(requests, carved));
    if (!batch && should_fit && (strands_own_segments || may_fail_for_stranded(blocks, large)))
      return failed_batch();
    if (batch.has_value() != should_fit)
      return fmt::format("batch of {} buffers ({} bytes of blocks) with {} in use, fit limit {}: "
                         "expected {}, got {}", count, blocks, in_use(), fits_up_to(),
                         should_fit ? "success" : "failure", batch ? "success" : batch.error().message());
    if (!batch) return failed_batch();
    if (batch->size() != count) return fmt::format("batch holds {} buffers, expected {}", batch->size(), count);
    // Take the buffers out one by one: the batch hands over ownership without freeing.
    for (std::size_t i = 0; i < count; ++i) {
      auto buffer = batch->remove(0);
      if (!buffer) return fmt::format("batch remove failed: {}", buffer.error().message());
      std::size_t bytes = requests[i].elements;
      const std::size_t capacity = buffer->capacity_bytes();
      if (!model_block_holds(bytes, capacity, arena_threshold_))
        return fmt::format("batch buffer of {} bytes has block {}", bytes, capacity);
      if (auto failure = adopt(std::move(*buffer), bytes, capacity, false)) return failure;
    }
    return check_invariants("batch");
  }

  // The buffers a failed batch got before the failing one went back: frees the model cannot count.
  std::optional<std::string> failed_batch() {
    PoolStats s = pool_.stats(device_);
    frees_ = s.frees;
    return check_invariants("failed batch", s);
  }

  // The live block [address, +bytes) overlaps, if any: live blocks are disjoint, so only the
  // nearest one below and the nearest one above can.
  std::optional<std::pair<const void*, std::size_t>> overlapping_block(const std::byte* begin,
                                                                        std::size_t bytes) const {
    auto above = blocks_by_address_.lower_bound(begin);
    if (above != blocks_by_address_.end() && above->first < begin + bytes) return *above;
    if (above != blocks_by_address_.begin()) {
      auto below = std::prev(above);
      if (static_cast<const std::byte*>(below->first) + below->second > begin) return *below;
    }
    return std::nullopt;
  }

  // Writes a pattern into the new buffer (so overlap or reuse of live memory shows up later) and
  // checks it overlaps no other live buffer.
  std::optional<std::string> adopt(ManagedBuffer buffer, std::size_t bytes, std::size_t block,
                                   bool check = true) {
    auto* begin = static_cast<std::byte*>(buffer.raw_data());
    if (auto overlapped = overlapping_block(begin, block))
      return fmt::format("new block [{}, +{}) overlaps a live block [{}, +{})",
                         static_cast<void*>(begin), block, overlapped->first, overlapped->second);
    auto pattern = static_cast<std::uint8_t>(step_ * 31 + 7);
    // The simulated device's memory is the host's: the pattern goes in directly.
    for_each_probe(bytes, [&](std::size_t at) { begin[at] = std::byte{pattern}; });
    live_.push_back(Live{std::move(buffer), bytes, block, pattern});
    blocks_by_address_.emplace(begin, block);
    in_use_ += block;
    requested_ += bytes;
    return check ? check_invariants("alloc") : std::nullopt;
  }

  std::optional<std::string> free_one(const PoolOp& op, bool explicit_release, bool check = true) {
    if (live_.empty()) return check_invariants("free of nothing");
    std::size_t index = op.a % live_.size();
    Live& victim = live_[index];
    const auto* bytes = static_cast<const std::byte*>(victim.buffer.raw_data());
    bool intact = true;
    for_each_probe(victim.requested,
                   [&](std::size_t at) { intact = intact && bytes[at] == std::byte{victim.pattern}; });
    if (!intact)
      return fmt::format("a live buffer of {} bytes lost its contents (another buffer wrote into it)",
                         victim.requested);
    blocks_by_address_.erase(victim.buffer.raw_data());
    in_use_ -= victim.block;
    requested_ -= victim.requested;
    if (explicit_release) {
      if (auto ok = victim.buffer.release(); !ok) return fmt::format("release failed: {}", ok.error().message());
      if (victim.buffer.valid()) return std::string("a released buffer still holds memory");
      if (victim.buffer.release()) return std::string("a second release succeeded");
    }
    if (&victim != &live_.back()) std::swap(victim, live_.back());  // ops pick buffers by index
    live_.pop_back();
    ++frees_;
    if (!check) return std::nullopt;
    return check_invariants(explicit_release ? "release" : "free");
  }

  // Blocks above the threshold are carved from segments: free space inside a segment that still holds
  // live blocks cannot be given back, so a request that fits the sums may still fail — but only
  // when those stranded bytes are what it lacks.
  // With virtual segments, a new block also takes whole pages: up to a page more at each end.
  bool may_fail_for_stranded(std::size_t blocks, std::size_t large_blocks) const {
    std::size_t stranded = pool_.stats(device_).fragmentation.stranded_bytes;
    std::size_t pages = virtual_segments_ ? 2 * kPageBytes * large_blocks : 0;
    return (stranded > 0 || pages > 0) && in_use() + stranded + blocks + pages > fits_up_to();
  }

  std::optional<std::string> trim(const PoolOp& op) {
    std::size_t keep = std::size_t{op.a % 17} << 18;  // 0 .. 4 MiB
    std::size_t before = pool_.stats(device_).cached_bytes;
    std::size_t released = pool_.trim(device_, keep);
    PoolStats s = pool_.stats(device_);
    std::size_t after = s.cached_bytes;
    if (after > keep && after != before - released)
      return fmt::format("trim({}) left {} cached", keep, after);
    if (before - after != released)
      return fmt::format("trim({}) reported {} released, cache went {} -> {}", keep, released, before, after);
    return check_invariants("trim", s);
  }

  std::optional<std::string> cleanup() {
    std::size_t before = pool_.stats(device_).cached_bytes;
    std::size_t released = pool_.emergency_cleanup(device_);
    PoolStats s = pool_.stats(device_);
    // Everything but the free space inside segments that live blocks still use.
    if (released != before - s.cached_bytes || s.cached_bytes != s.fragmentation.stranded_bytes)
      return fmt::format("emergency_cleanup released {} of {} cached, {} stranded", released, before,
                         s.fragmentation.stranded_bytes);
    return check_invariants("cleanup", s);
  }

  std::optional<std::string> set_limit(std::optional<std::size_t> limit) {
    if (limit) {
      if (auto ok = pool_.set_max_pool_size(device_, *limit); !ok)
        return fmt::format("set_max_pool_size({}) failed: {}", *limit, ok.error().message());
    } else {
      // "No limit" is the device's capacity.
      if (auto ok = pool_.set_max_pool_size(device_, kCapacity); !ok)
        return fmt::format("set_max_pool_size(capacity) failed: {}", ok.error().message());
    }
    limit_ = limit;
    return check_invariants("limit");
  }

  std::optional<std::string> set_cache_cap(const PoolOp& op) {
    std::optional<std::size_t> cap;
    if (op.a % 4) cap = std::size_t{op.a % 33} << 17;  // 0 .. 4 MiB
    if (auto ok = pool_.set_max_cached_bytes(device_, cap); !ok)
      return fmt::format("set_max_cached_bytes failed: {}", ok.error().message());
    PoolStats s = pool_.stats(device_);
    if (cap && s.cached_bytes - s.fragmentation.stranded_bytes > *cap)
      return fmt::format("a cache cap of {} left {} cached", *cap, s.cached_bytes);
    return check_invariants("cache cap", s);
  }

  std::optional<std::string> check_invariants(const char* after) {
    return check_invariants(after, pool_.stats(device_));
  }

  // As above, on a snapshot the operation already took after its work.
  std::optional<std::string> check_invariants(const char* after, const PoolStats& s) {
    auto memory = device_.memory_info();
    std::size_t device_used = memory->total - memory->free;
    auto fail = [&](const std::string& what) {
      return fmt::format("step {} (after {}): {}", step_, after, what);
    };
    if (s.in_use_bytes != in_use())
      return fail(fmt::format("in use {} != model {}", s.in_use_bytes, in_use()));
    if (s.requested_bytes != requested_)
      return fail(fmt::format("requested {} != model {}", s.requested_bytes, requested_));
    if (s.live_buffers != live_.size())
      return fail(fmt::format("live buffers {} != model {}", s.live_buffers, live_.size()));
    if (s.frees != frees_) return fail(fmt::format("frees {} != model {}", s.frees, frees_));
    if (s.reserved_bytes != s.in_use_bytes + s.cached_bytes)
      return fail(fmt::format("reserved {} != in use {} + cached {}", s.reserved_bytes,
                              s.in_use_bytes, s.cached_bytes));
    if (device_used != s.reserved_bytes)
      return fail(fmt::format("the device holds {} bytes but the pool reserves {}", device_used,
                              s.reserved_bytes));
    if (s.peak_in_use_bytes < s.in_use_bytes || s.peak_reserved_bytes < s.reserved_bytes)
      return fail("a peak below its current value");
    double pressure = pool_.memory_pressure(device_);
    if (!(pressure >= 0.0 && pressure <= 1.0)) return fail(fmt::format("pressure {}", pressure));
    return std::nullopt;
  }

  Device device_;
  bool virtual_segments_;
  std::size_t arena_threshold_;  // model_block_bytes' line for this pool
  GpuMemoryPool pool_;
  std::vector<Live> live_;
  std::map<const void*, std::size_t, std::less<>> blocks_by_address_;  // the live blocks' extents
  std::size_t in_use_ = 0;     // the live blocks' bytes
  std::size_t requested_ = 0;  // the live buffers' requested bytes
  std::optional<std::size_t> limit_;
  std::uint64_t frees_ = 0;
  std::uint64_t step_ = 0;
};

}  // namespace gpupool::testing
