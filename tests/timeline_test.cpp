// The memory timeline: SVG text with the expected marks, rendered to PNG by a real renderer.
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <expected>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>
import gpupool;

using namespace gpupool;
// These figures are exact per block: every block is its own device allocation (segments off).
const PoolConfig kOwnBlocks{.segments = false};


namespace {
std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}
std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("gpupool_timeline_" + std::to_string(::getpid()) + "_" + name)).string();
}
std::uint32_t big_endian(const std::string& bytes, std::size_t at) {
  std::uint32_t value = 0;
  for (std::size_t i = 0; i < 4; ++i) value = value << 8 | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

// A recorded trace with growth, a trim, a limit and an out-of-memory error.
Trace recorded_trace() {
  auto device = Device::simulated({.capacity = 32 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 24 * MiB, .segments = false});
  REQUIRE(enable_tracing(pool, {.history_capacity = 1000}));
  std::vector<ManagedBuffer> live;
  for (std::size_t i = 1; i <= 6; ++i) {
    auto buffer = pool.get_managed_buffer(*device, i * MiB, Precision::Bytes);
    REQUIRE(buffer);
    live.push_back(std::move(*buffer));
  }
  live.erase(live.begin(), live.begin() + 3);
  pool.trim(*device, MiB);
  CHECK(!pool.get_managed_buffer(*device, 20 * MiB, Precision::Bytes));
  live.clear();
  return history(pool);
}
}  // namespace

TEST_CASE("the timeline SVG draws in use, cached, the limit, trims and OOMs", "[timeline]") {
  Trace trace = recorded_trace();
  std::size_t trims = 0, ooms = 0;
  for (const TraceEvent& e : trace.events) {
    trims += e.kind == TraceEventKind::Trim;
    ooms += e.kind == TraceEventKind::Oom;
  }
  REQUIRE(ooms == 1);
  REQUIRE(trims >= 1);
  auto svg = timeline_svg(trace, {.width = 640, .height = 320, .title = "pool <test> & co"});
  REQUIRE(svg);
  CHECK(svg->find("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"320\"") == 0);
  CHECK(count(*svg, "class=\"oom\"") == ooms);
  CHECK(count(*svg, "class=\"trim\"") == trims);
  CHECK(count(*svg, "<polygon") == 2);                   // in use and cached
  CHECK(count(*svg, "stroke-dasharray=\"6 4\"") == 1);   // the limit
  CHECK(svg->find("pool &lt;test&gt; &amp; co (device ") != std::string::npos);
  // The limit (24 MiB) sets the scale: 25.2 MiB with a margin, ticks of 10 MiB up to 30 MiB.
  CHECK(svg->find(">30 MiB</text>") != std::string::npos);
  CHECK(svg->find(">10 MiB</text>") != std::string::npos);
  CHECK(svg->find(">40 MiB</text>") == std::string::npos);
  CHECK(svg->find("time (ms)") != std::string::npos);
  auto by_event = timeline_svg(trace, {.by_event = true});
  REQUIRE(by_event);
  CHECK(by_event->find(">event</text>") != std::string::npos);
}

TEST_CASE("the timeline renders to a PNG of its size with rsvg-convert", "[timeline]") {
  Trace trace = recorded_trace();
  const std::string svg_path = temp_path("timeline.svg"), png_path = temp_path("timeline.png");
  REQUIRE(write_timeline_svg(trace, svg_path, {.width = 640, .height = 320}));
  const std::string command = "rsvg-convert -o '" + png_path + "' '" + svg_path + "'";
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream file(png_path, std::ios::binary);
  std::string png((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::filesystem::remove(svg_path);
  std::filesystem::remove(png_path);
  REQUIRE(png.size() > 1000);  // a real picture, not an empty canvas
  CHECK(png.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);
  CHECK(png.compare(12, 4, "IHDR") == 0);
  CHECK(big_endian(png, 16) == 640);
  CHECK(big_endian(png, 20) == 320);
}

TEST_CASE("the timeline refuses what it cannot draw", "[timeline]") {
  auto empty = timeline_svg(Trace{});
  REQUIRE(!empty);
  CHECK(empty.error().kind() == ErrorKind::InvalidInput);
  CHECK(empty.error().message() == "timeline of an empty trace: expected at least one event");
  Trace trace = recorded_trace();
  auto tiny = timeline_svg(trace, {.width = 100, .height = 50});
  REQUIRE(!tiny);
  CHECK(tiny.error().message() == "timeline of 100x50 pixels: expected at least 200x120");
  auto other = timeline_svg(trace, {.device_id = 99999});
  REQUIRE(!other);
  CHECK(other.error().message().find("no events of device 99999") != std::string::npos);
  auto unwritable = write_timeline_svg(trace, "/nonexistent-dir/timeline.svg");
  REQUIRE(!unwritable);
  CHECK(unwritable.error().kind() == ErrorKind::Io);
}
