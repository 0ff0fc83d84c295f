// gpupool:precision — element types a buffer can hold and what they cost in bytes.
module;
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
export module gpupool:precision;

export namespace gpupool {

enum class Precision : std::uint8_t { Fp32, Fp16, Bf16, Int8, Bytes };

inline constexpr int kPrecisionCount = 5;
inline constexpr Precision kAllPrecisions[] = {Precision::Fp32, Precision::Fp16, Precision::Bf16,
                                               Precision::Int8, Precision::Bytes};

// False for values outside the enumeration (a cast from an integer): every entry point that
// takes a Precision refuses those.
constexpr bool is_known(Precision p) noexcept {
  return static_cast<int>(p) >= 0 && static_cast<int>(p) < kPrecisionCount;
}

constexpr std::size_t element_size(Precision p) noexcept {
  switch (p) {
    case Precision::Fp32: return 4;
    case Precision::Fp16:
    case Precision::Bf16: return 2;
    case Precision::Int8:
    case Precision::Bytes: return 1;
  }
  return 1;
}

constexpr std::string_view to_string(Precision p) noexcept {
  switch (p) {
    case Precision::Fp32: return "fp32";
    case Precision::Fp16: return "fp16";
    case Precision::Bf16: return "bf16";
    case Precision::Int8: return "int8";
    case Precision::Bytes: return "bytes";
  }
  return "?";
}

constexpr std::optional<Precision> parse_precision(std::string_view text) noexcept {
  for (Precision p : kAllPrecisions)
    if (to_string(p) == text) return p;
  return std::nullopt;
}

// Storage types for the 16-bit formats: the host never does arithmetic on them directly, it
// converts through float (see gpupool:kernels). They exist so data<Half>() can be type-checked.
struct Half {
  std::uint16_t bits;
};
struct BFloat16 {
  std::uint16_t bits;
};

// The precision a C++ element type stands for; data<T>() checks it against the buffer's.
template <class T> struct precision_of;
template <> struct precision_of<float> { static constexpr Precision value = Precision::Fp32; };
template <> struct precision_of<Half> { static constexpr Precision value = Precision::Fp16; };
template <> struct precision_of<BFloat16> { static constexpr Precision value = Precision::Bf16; };
template <> struct precision_of<std::int8_t> { static constexpr Precision value = Precision::Int8; };
template <> struct precision_of<std::byte> { static constexpr Precision value = Precision::Bytes; };

}  // namespace gpupool
