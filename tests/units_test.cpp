#include <catch2/catch.hpp>
#include <optional>
#include <cstdint>
import gpupool;

using namespace gpupool;

TEST_CASE("byte sizes parse in the ways people write them", "[units]") {
  CHECK(parse_byte_size("4096")->bytes == 4096u);
  CHECK(parse_byte_size("2GiB")->bytes == 2 * GiB);
  CHECK(parse_byte_size("2 GiB")->bytes == 2 * GiB);
  CHECK(parse_byte_size("512M")->bytes == 512 * MiB);
  CHECK(parse_byte_size("1.5KiB")->bytes == 1536u);
  CHECK(parse_byte_size("3GB")->bytes == 3000000000u);
  auto share = parse_byte_size("80%");
  REQUIRE(share);
  CHECK_FALSE(share->bytes);
  CHECK(share->resolve(1000) == 800u);
}

TEST_CASE("malformed byte sizes are refused", "[units]") {
  for (const char* text : {"", "-1", "+5", "abc", "12 parsecs", "150%", "1e30", "GiB", "1..2"})
    CHECK_FALSE(parse_byte_size(text));
}

TEST_CASE("byte counts print with scale and exact value", "[units]") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1536) == "1.50 KiB (1536 bytes)");
  CHECK(format_bytes(3 * GiB) == "3.00 GiB (3221225472 bytes)");
}
