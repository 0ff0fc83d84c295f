// Checks of option values before CLI11 converts them, so that a bad value is a usage error naming
// the option (exit 2) rather than a wrapped integer or a NaN that slips through comparisons.
#pragma once
#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <system_error>

namespace gpupool::cli {

// A whole number from `low` to `high`, written in decimal digits only ("-1" and "1e3" are refused
// rather than wrapped or rounded).
inline CLI::Validator whole_number(std::uint64_t low, std::uint64_t high) {
  const std::string range =
      "a whole number from " + std::to_string(low) + " to " + std::to_string(high);
  return CLI::Validator(
      [low, high, range](std::string& text) -> std::string {
        std::uint64_t value = 0;
        const char* end = text.data() + text.size();
        auto [at, error] = std::from_chars(text.data(), end, value);
        if (text.empty() || error != std::errc{} || at != end || value < low || value > high)
          return "got " + text + "; expected " + range;
        return {};
      },
      range);
}

// A finite number from `low` to `high` (NaN and the infinities are refused).
inline CLI::Validator finite_number(double low, double high) {
  const std::string range = "a number from " + std::to_string(low) + " to " + std::to_string(high);
  return CLI::Validator(
      [low, high, range](std::string& text) -> std::string {
        double value = 0;
        const char* end = text.data() + text.size();
        auto [at, error] = std::from_chars(text.data(), end, value);
        if (text.empty() || error != std::errc{} || at != end || !std::isfinite(value) ||
            value < low || value > high)
          return "got " + text + "; expected " + range;
        return {};
      },
      range);
}

}  // namespace gpupool::cli
