// Size classes: how a request is rounded before it meets the free lists.
//
//   up to 4 KiB      steps of 256 bytes (the alignment cudaMalloc gives): 16 classes
//   (2^k, 2^(k+1)]   16 classes of 2^(k-4) bytes each, for k = 12 .. 45
// So a request above 4 KiB wastes at most 1/16 of itself (the brief allows 1/8), and one below
// wastes less than 256 bytes. Requests above 64 TiB are refused as absurd.
module;
#include <bit>
#include <cstddef>
#include <cstdint>
module gpupool:size_classes;

namespace gpupool::size_classes {

inline constexpr std::size_t kAlignment = 256;
inline constexpr std::size_t kSmallLimit = 4096;
inline constexpr int kClassesPerDoubling = 16;
inline constexpr int kSmallClasses = static_cast<int>(kSmallLimit / kAlignment);  // 16
inline constexpr int kFirstLargeExponent = 12;                                    // 4 KiB
inline constexpr int kLastExponent = 46;
inline constexpr std::size_t kMaxRequest = std::size_t{1} << kLastExponent;  // 64 TiB
inline constexpr int kClassCount =
    kSmallClasses + (kLastExponent - kFirstLargeExponent) * kClassesPerDoubling;

// Blocks above this (64 KiB) come from SegmentArena (pool/segment_arena.cppm), carved from device segments;
// blocks up to it are one device allocation each, cached per class. A small block carved from a
// plain segment would keep the whole segment from going back to the device while it lives.
inline constexpr std::size_t kArenaThreshold = std::size_t{64} << 10;
// The same line for virtual segments (PoolConfig::virtual_segments), where a live block keeps
// only the pages it touches: blocks above 4 KiB are carved, so that free space left by one size
// serves every other instead of waiting in its class (docs/pool.md, "Why segments").
inline constexpr std::size_t kVirtualArenaThreshold = std::size_t{4} << 10;

// The class index of a request of 1 .. kMaxRequest bytes.
constexpr std::uint32_t class_of(std::size_t bytes) noexcept {
  if (bytes <= kSmallLimit) return static_cast<std::uint32_t>((bytes + kAlignment - 1) / kAlignment - 1);
  int k = std::bit_width(bytes - 1) - 1;  // bytes in (2^k, 2^(k+1)]
  std::size_t step = std::size_t{1} << (k - 4);
  std::size_t sub = ((bytes - (std::size_t{1} << k)) + step - 1) / step;  // 1 .. 16
  return static_cast<std::uint32_t>(kSmallClasses + (k - kFirstLargeExponent) * kClassesPerDoubling +
                                    static_cast<int>(sub) - 1);
}

// The bytes every block of a class holds.
constexpr std::size_t class_bytes(std::uint32_t index) noexcept {
  if (index < static_cast<std::uint32_t>(kSmallClasses)) return (index + 1) * kAlignment;
  std::uint32_t large = index - kSmallClasses;
  int k = kFirstLargeExponent + static_cast<int>(large / kClassesPerDoubling);
  std::size_t sub = large % kClassesPerDoubling + 1;
  return (std::size_t{1} << k) + sub * (std::size_t{1} << (k - 4));
}

// The largest class whose bytes are at most `bytes`, a multiple of kAlignment from kAlignment to
// kMaxRequest (where a free span of that size is filed): below 4 KiB the step of 256 below; above,
// the power of two and how many of its sixteenths lie below.
constexpr std::uint32_t floor_class_of(std::size_t bytes) noexcept {
  if (bytes < kSmallLimit) return static_cast<std::uint32_t>(bytes / kAlignment - 1);
  const int k = std::bit_width(bytes) - 1;  // bytes in [2^k, 2^(k+1))
  const auto sixteenths = static_cast<int>((bytes >> (k - 4)) & 15);
  return static_cast<std::uint32_t>(kSmallClasses - 1 +
                                    (k - kFirstLargeExponent) * kClassesPerDoubling + sixteenths);
}

// floor_class_of against its definition: at every step up to 64 KiB and around every class
// boundary above.
constexpr bool floor_class_is_the_largest_below() {
  auto agrees = [](std::size_t bytes) {
    const std::uint32_t c = floor_class_of(bytes);
    return class_bytes(c) <= bytes && (c + 1 == kClassCount || class_bytes(c + 1) > bytes);
  };
  for (std::size_t bytes = kAlignment; bytes <= (std::size_t{64} << 10); bytes += kAlignment)
    if (!agrees(bytes)) return false;
  for (std::uint32_t c = 0; c < static_cast<std::uint32_t>(kClassCount); ++c) {
    const std::size_t at = class_bytes(c);
    if (!agrees(at) || (at > kAlignment && !agrees(at - kAlignment)) ||
        (at < kMaxRequest && !agrees(at + kAlignment)))
      return false;
  }
  return true;
}

static_assert(class_bytes(class_of(1)) == 256);
static_assert(floor_class_is_the_largest_below());
static_assert(class_bytes(class_of(4096)) == 4096);
static_assert(class_bytes(class_of(4097)) == 4096 + 256);
static_assert(class_bytes(class_of(std::size_t{1} << 20)) == std::size_t{1} << 20);
static_assert(class_bytes(class_of((std::size_t{1} << 20) + 1)) == (std::size_t{1} << 20) + (std::size_t{1} << 16));
static_assert(class_of(kMaxRequest) == kClassCount - 1);

}  // namespace gpupool::size_classes
