// gpupool:units — byte counts as people write and read them ("2GiB", "512 MiB", "80%").
module;
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
export module gpupool:units;

export namespace gpupool {

inline constexpr std::uint64_t KiB = 1ull << 10;
inline constexpr std::uint64_t MiB = 1ull << 20;
inline constexpr std::uint64_t GiB = 1ull << 30;

// "1.50 MiB (1572864 bytes)": the scale for a person and the exact value for a bug report.
inline std::string format_bytes(std::uint64_t bytes) {
  constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char text[64];
  if (unit == 0)
    std::snprintf(text, sizeof text, "%llu B", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(text, sizeof text, "%.2f %s (%llu bytes)", value, units[unit],
                  static_cast<unsigned long long>(bytes));
  return text;
}

// A byte size or a share of a whole: "4096", "2GiB", "1.5 GB", "80%".
struct ByteSize {
  std::optional<std::uint64_t> bytes;   // set for absolute sizes
  std::optional<double> fraction;       // set for percentages, in [0, 1]
  std::uint64_t resolve(std::uint64_t whole) const {
    return bytes ? *bytes : static_cast<std::uint64_t>(*fraction * static_cast<double>(whole));
  }
};

// Parses "123", "64KiB", "2 GiB", "1.5GB", "512M", "80%". Binary and decimal suffixes are both
// accepted (K/KB = 1000, KiB = 1024; a bare K/M/G is taken as binary as nvidia-smi users expect).
// Returns nullopt for anything else, including negative values, overflow and percentages over 100.
inline std::optional<ByteSize> parse_byte_size(std::string_view text) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  if (text.empty() || text.front() == '-' || text.front() == '+') return std::nullopt;
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || !(value >= 0)) return std::nullopt;
  std::string_view suffix(end, static_cast<std::size_t>(text.data() + text.size() - end));
  while (!suffix.empty() && suffix.front() == ' ') suffix.remove_prefix(1);
  if (suffix == "%") {
    if (value > 100) return std::nullopt;
    return ByteSize{std::nullopt, value / 100.0};
  }
  struct Unit { std::string_view name; double factor; };
  constexpr Unit units[] = {{"", 1},          {"B", 1},           {"K", 1024.0},
                            {"KiB", 1024.0},  {"KB", 1e3},        {"M", 1048576.0},
                            {"MiB", 1048576.0}, {"MB", 1e6},      {"G", 1073741824.0},
                            {"GiB", 1073741824.0}, {"GB", 1e9},   {"T", 1099511627776.0},
                            {"TiB", 1099511627776.0}, {"TB", 1e12}};
  for (const Unit& unit : units) {
    if (suffix != unit.name) continue;
    double bytes = value * unit.factor;
    if (bytes > 1.8e19) return std::nullopt;
    return ByteSize{static_cast<std::uint64_t>(bytes), std::nullopt};
  }
  return std::nullopt;
}

}  // namespace gpupool
