// Leak tracing, the event history, trace files and their replay.
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <unistd.h>
#include <unordered_map>
#include <vector>
import gpupool;

using namespace gpupool;
// These figures are exact per block: every block is its own device allocation (segments off).
const PoolConfig kOwnBlocks{.segments = false};


namespace {
Device sim(std::size_t capacity) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  return *device;
}
std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("gpupool_tracing_" + std::to_string(::getpid()) + "_" + name)).string();
}
bool ends_with(const std::string& text, const std::string& end) {
  return text.size() >= end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
}

// A random workload like the peers' trace (peers.md): alloc/free coin flips, sizes uniform in
// 1 B .. max_bytes, at most max_live buffers. The seed is fresh each run and printed on failure.
struct RandomWorkload {
  std::uint64_t seed = std::random_device{}();
  std::size_t allocations = 0, frees = 0;
  std::size_t peak_in_use = 0;
  void run(GpuMemoryPool& pool, const Device& device, std::size_t operations, std::size_t max_bytes,
           std::size_t max_live) {
    INFO("seed " << seed);
    std::mt19937_64 random(seed);
    std::vector<ManagedBuffer> live;
    for (std::size_t op = 0; op < operations; ++op) {
      const bool allocate = live.empty() || (live.size() < max_live && random() % 2 == 0);
      if (allocate) {
        std::size_t bytes = 1 + random() % max_bytes;
        auto buffer = pool.get_managed_buffer(device, bytes, Precision::Bytes);
        REQUIRE(buffer);
        live.push_back(std::move(*buffer));
        ++allocations;
      } else {
        std::size_t index = random() % live.size();
        std::swap(live[index], live.back());
        live.pop_back();
        ++frees;
      }
      peak_in_use = std::max(peak_in_use, pool.stats(device).in_use_bytes);
    }
    frees += live.size();
  }
};
}  // namespace

TEST_CASE("a deliberately leaked buffer is reported with its label and call site", "[tracing]") {
  Device device = sim(16 * MiB);
  std::vector<LiveAllocation> reported;
  std::optional<ManagedBuffer> leaked;
  int line = 0;
  {
    GpuMemoryPool pool(kOwnBlocks);
    REQUIRE(enable_tracing(pool, {.on_leaks = [&](const auto& live) { reported = live; }}));
    {
      AllocationLabel label("index build");
      line = __LINE__ + 1;
      auto buffer = pool.get_managed_buffer(device, 1000, Precision::Fp32);
      REQUIRE(buffer);
      leaked = std::move(*buffer);
    }
    { auto returned = pool.get_managed_buffer(device, 10, Precision::Int8); REQUIRE(returned); }
    CHECK(current_allocation_label().empty());
    auto live = live_allocations(pool);
    REQUIRE(live.size() == 1);
    CHECK(live[0].label == "index build");
    CHECK(reported.empty());
  }  // the pool's last handle goes: the leak is reported
  REQUIRE(reported.size() == 1);
  const LiveAllocation& leak = reported[0];
  CHECK(leak.id == 1);
  CHECK(leak.device_id == device.id());
  CHECK(leak.ptr == leaked->raw_data());
  CHECK(leak.requested_bytes == 4000);
  CHECK(leak.block_bytes == 4096);
  CHECK(leak.precision == Precision::Fp32);
  CHECK(leak.stream == 0);
  CHECK(leak.label == "index build");
  CHECK(ends_with(leak.file, "tests/tracing_test.cpp"));
  CHECK(leak.line == static_cast<std::uint32_t>(line));
  CHECK(!leak.function.empty());
  CHECK(leak.stack_trace.empty());
  std::string text = format_live_allocations(reported);
  CHECK(text.find("1 live allocation, 3.91 KiB (4000 bytes) requested\n") == 0);
  CHECK(text.find("label \"index build\", allocated at " + leak.file + ":" + std::to_string(line)) != std::string::npos);
  leaked.reset();  // still returns safely after the pool is gone, straight to the device
  CHECK(device.memory_info()->free == 16 * MiB);
}

TEST_CASE("leak tracing: labels nest, frees leave, stack traces on request", "[tracing]") {
  Device device = sim(16 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  auto bad = enable_tracing(pool, {.track_allocations = false, .capture_stack_traces = true});
  REQUIRE(!bad);
  CHECK(bad.error().kind() == ErrorKind::InvalidInput);
  CHECK(bad.error().message().find("capture_stack_traces is true but track_allocations is false") == 0);

  REQUIRE(enable_tracing(pool, {.capture_stack_traces = true, .on_leaks = [](const auto&) {}}));
  AllocationLabel outer("outer");
  auto a = pool.get_managed_buffer(device, 256, Precision::Bytes);
  std::optional<Result<ManagedBuffer>> b;
  {
    AllocationLabel inner("inner");
    b = pool.get_managed_buffer(device, 512, Precision::Bytes);
  }
  auto c = pool.get_managed_buffer(device, 768, Precision::Bytes);
  REQUIRE((a && *b && c));
  (*b)->release().value();
  auto live = live_allocations(pool);
  REQUIRE(live.size() == 2);
  CHECK(live[0].label == "outer");
  CHECK(live[0].requested_bytes == 256);
  CHECK(live[1].label == "outer");
  CHECK(live[1].requested_bytes == 768);
  CHECK(live[1].id == 3);
  CHECK(!live[0].stack_trace.empty());

  disable_tracing(pool);
  auto untracked = pool.get_managed_buffer(device, 1024, Precision::Bytes);
  REQUIRE(untracked);
  CHECK(live_allocations(pool).size() == 2);
}

TEST_CASE("the history records alloc, free, trim and OOM with the pool's figures", "[tracing]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  REQUIRE(enable_tracing(pool, {.track_allocations = false, .history_capacity = 100}));
  { auto a = pool.get_managed_buffer(device, 1000, Precision::Fp32); REQUIRE(a); }
  CHECK(pool.trim(device) == 4096);
  auto too_big = pool.get_managed_buffer(device, 16 * MiB, Precision::Bytes);
  REQUIRE(!too_big);
  Trace trace = history(pool);
  CHECK(trace.dropped == 0);
  REQUIRE(trace.events.size() == 4);
  const std::size_t cap = 8 * MiB;
  const int id = device.id();
  auto expect = [&](const TraceEvent& e, std::uint64_t seq, TraceEventKind kind, std::uint64_t alloc_id,
                    std::size_t bytes, std::size_t block, Precision precision, std::size_t in_use,
                    std::size_t reserved) {
    CHECK(e.seq == seq);
    CHECK(e.kind == kind);
    CHECK(e.device_id == id);
    CHECK(e.id == alloc_id);
    CHECK(e.bytes == bytes);
    CHECK(e.block_bytes == block);
    CHECK(e.precision == precision);
    CHECK(e.stream == 0);
    CHECK(e.in_use_bytes == in_use);
    CHECK(e.reserved_bytes == reserved);
    CHECK(e.limit_bytes == cap);
  };
  expect(trace.events[0], 0, TraceEventKind::Alloc, 1, 4000, 4096, Precision::Fp32, 4096, 4096);
  expect(trace.events[1], 1, TraceEventKind::Free, 1, 4096, 4096, Precision::Fp32, 0, 4096);
  expect(trace.events[2], 2, TraceEventKind::Trim, 0, 4096, 0, Precision::Bytes, 0, 0);
  expect(trace.events[3], 3, TraceEventKind::Oom, 0, 16 * MiB, 0, Precision::Bytes, 0, 0);
  for (std::size_t i = 1; i < trace.events.size(); ++i)
    CHECK(trace.events[i].time_ns >= trace.events[i - 1].time_ns);
  CHECK(trace.peak_reserved_bytes() == 4096);
  CHECK(to_string(TraceEventKind::Oom) == "oom");
}

TEST_CASE("the history is a ring: the oldest events go first", "[tracing]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  REQUIRE(enable_tracing(pool, {.history_capacity = 3, .on_leaks = [](const auto&) {}}));
  for (int i = 0; i < 2; ++i) { auto b = pool.get_managed_buffer(device, 100, Precision::Bytes); REQUIRE(b); }
  auto kept = pool.get_managed_buffer(device, 100, Precision::Bytes);  // events 0..4
  REQUIRE(kept);
  Trace trace = history(pool);
  CHECK(trace.dropped == 2);
  REQUIRE(trace.events.size() == 3);
  CHECK(trace.events[0].seq == 2);
  CHECK(trace.events[2].seq == 4);
  CHECK(trace.events[2].kind == TraceEventKind::Alloc);
  CHECK(trace.events[2].id == 3);
  disable_tracing(pool);
  { auto more = pool.get_managed_buffer(device, 100, Precision::Bytes); REQUIRE(more); }
  CHECK(history(pool).events.back().seq == 4);  // off: nothing new, the old still readable
  GpuMemoryPool untraced;
  CHECK(history(untraced).events.empty());
}

TEST_CASE("trace files round-trip through CSV and JSON", "[tracing]") {
  Trace trace;
  trace.dropped = 7;
  trace.events = {
      {7, 1500, TraceEventKind::Alloc, 101, 1, 4000, 4096, Precision::Fp16, 0, 4096, 4096, 8 * MiB},
      {8, 2500, TraceEventKind::Free, 101, 1, 4096, 4096, Precision::Fp16, 0x55aa, 0, 4096, 8 * MiB},
      {9, 3500, TraceEventKind::Oom, 102, 0, 9 * MiB, 0, Precision::Bytes, 0, 0, 4096, 8 * MiB}};
  CHECK(to_csv(trace) ==
        "# dropped 7\n"
        "seq,time_ns,event,device,id,bytes,block_bytes,precision,stream,in_use_bytes,reserved_bytes,limit_bytes\n"
        "7,1500,alloc,101,1,4000,4096,fp16,0,4096,4096,8388608\n"
        "8,2500,free,101,1,4096,4096,fp16,21930,0,4096,8388608\n"
        "9,3500,oom,102,0,9437184,0,bytes,0,0,4096,8388608\n");
  for (TraceFormat format : {TraceFormat::Csv, TraceFormat::Json}) {
    std::string text = format == TraceFormat::Csv ? to_csv(trace) : to_json(trace);
    auto parsed = parse_trace(text);
    REQUIRE(parsed);
    CHECK(parsed->dropped == 7);
    CHECK(parsed->events == trace.events);
    std::string path = temp_path(format == TraceFormat::Csv ? "trace.csv" : "trace.json");
    REQUIRE(write_trace(trace, path, format));
    auto read = read_trace(path);
    REQUIRE(read);
    CHECK(read->events == trace.events);
    std::filesystem::remove(path);
  }
}

TEST_CASE("bad trace files are refused with the line or field named", "[tracing]") {
  auto fields = parse_trace("1,2,alloc\n");
  REQUIRE(!fields);
  CHECK(fields.error().kind() == ErrorKind::InvalidInput);
  CHECK(fields.error().message().find("trace: line 1 has 3 fields: expected 12") == 0);
  auto kind = parse_trace("1,2,grow,0,1,4,256,bytes,0,0,0,0\n");
  REQUIRE(!kind);
  CHECK(kind.error().message().find("line 1: event \"grow\"") != std::string::npos);
  auto number = parse_trace("x,2,alloc,0,1,4,256,bytes,0,0,0,0\n");
  REQUIRE(!number);
  CHECK(number.error().message().find("line 1 field 1 is \"x\": expected an unsigned integer") != std::string::npos);
  auto json = parse_trace("{\"format\": \"gpupool-trace\", \"events\": [{\"seq\": 1}]}");
  REQUIRE(!json);
  CHECK(json.error().message().find("event 0: \"time_ns\" is missing") != std::string::npos);
  CHECK(!parse_trace("{not json"));
  auto missing = read_trace(temp_path("does-not-exist.csv"));
  REQUIRE(!missing);
  CHECK(missing.error().kind() == ErrorKind::Io);
  CHECK(parse_trace("")->events.empty());
}

// The device is large enough that no critical-pressure trim happens: those run inside an
// allocation, and a replay re-does them itself (docs/diagnostics.md).
TEST_CASE("replaying a recorded trace reproduces the recorded peak", "[tracing][replay]") {
  Device device = sim(GiB);
  GpuMemoryPool pool;
  REQUIRE(enable_tracing(pool, {.track_allocations = false, .history_capacity = 10000}));
  RandomWorkload workload;
  workload.run(pool, device, 3000, MiB, 50);
  INFO("seed " << workload.seed);
  Trace trace = history(pool);
  REQUIRE(trace.dropped == 0);
  REQUIRE(trace.events.size() == workload.allocations + workload.frees);
  const PoolStats recorded = pool.stats(device);
  CHECK(trace.peak_reserved_bytes() == recorded.peak_reserved_bytes);

  Device fresh = sim(GiB);
  auto replay = replay_trace(trace, fresh);
  REQUIRE(replay);
  CHECK(replay->events == trace.events.size());
  CHECK(replay->allocations == workload.allocations);
  CHECK(replay->frees == workload.frees);
  CHECK(replay->skipped_frees == 0);
  CHECK(replay->replay_ooms == 0);
  CHECK(replay->recorded_peak_reserved == recorded.peak_reserved_bytes);
  CHECK(replay->peak_reserved == recorded.peak_reserved_bytes);
  CHECK(replay->peak_reserved_within_events == recorded.peak_reserved_bytes);
  CHECK(replay->peak_in_use == workload.peak_in_use);
  CHECK(replay->peak_requested == recorded.peak_requested_bytes);
  CHECK(replay->fragmentation == Approx(static_cast<double>(recorded.peak_reserved_bytes) /
                                        static_cast<double>(recorded.peak_requested_bytes)));
  CHECK(replay->to_string().find("replay on " + fresh.describe()) == 0);

  SECTION("from a file, on a simulated device of the trace's size") {
    std::string path = temp_path("replay.csv");
    REQUIRE(write_trace(trace, path, TraceFormat::Csv));
    auto from_file = replay_trace_file(path);
    std::filesystem::remove(path);
    REQUIRE(from_file);
    CHECK(from_file->peak_reserved == recorded.peak_reserved_bytes);
    CHECK(from_file->device.find("1.00 GiB") != std::string::npos);
  }
  SECTION("another configuration: no cache holds nothing beyond what is in use") {
    auto uncached = replay_trace(trace, sim(GiB), PoolConfig{.caching = false});
    REQUIRE(uncached);
    CHECK(uncached->peak_reserved == uncached->peak_in_use);
    CHECK(uncached->peak_reserved <= recorded.peak_reserved_bytes);
    // Without segments every block holds its size class's bytes, where a block carved from a
    // segment holds its request rounded to 256 bytes: in use is at least the recording's, and
    // above it by at most the classes' rounding (1/16).
    CHECK(uncached->peak_in_use >= workload.peak_in_use);
    CHECK(uncached->peak_in_use <= workload.peak_in_use + workload.peak_in_use / 16);
  }
  SECTION("a device too small: the replay counts its OOMs") {
    auto small = replay_trace(trace, sim(workload.peak_in_use / 2));
    REQUIRE(small);
    CHECK(small->replay_ooms > 0);
    CHECK(small->allocations + small->replay_ooms == workload.allocations);
    CHECK(small->skipped_frees == small->replay_ooms);
  }
}

// Under a limit the pool trims at critical pressure inside allocations; the replay's pool does
// the same, so the peak after each event is reproduced exactly.
TEST_CASE("replay reproduces the recorded peak under pressure trims", "[tracing][replay]") {
  Device device = sim(GiB);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 48 * MiB, .segments = false});
  REQUIRE(enable_tracing(pool, {.track_allocations = false, .history_capacity = 10000}));
  RandomWorkload workload;
  workload.run(pool, device, 3000, MiB, 30);
  INFO("seed " << workload.seed);
  Trace trace = history(pool);
  std::size_t trims = 0;
  for (const TraceEvent& e : trace.events) trims += e.kind == TraceEventKind::Trim;
  CHECK(trims > 0);
  auto replay = replay_trace(trace, sim(GiB), PoolConfig{.max_pool_size = 48 * MiB, .segments = false});
  REQUIRE(replay);
  CHECK(replay->replay_ooms == 0);
  CHECK(replay->peak_reserved == trace.peak_reserved_bytes());
  CHECK(replay->peak_reserved_within_events >= replay->peak_reserved);
  CHECK(replay->peak_reserved_within_events <= pool.stats(device).peak_reserved_bytes);
  CHECK(replay->peak_in_use == workload.peak_in_use);
}

TEST_CASE("replay repeats trims and recorded OOMs", "[tracing][replay]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  REQUIRE(enable_tracing(pool, {.history_capacity = 100}));
  { auto a = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes); REQUIRE(a); }
  pool.trim(device);
  { auto b = pool.get_managed_buffer(device, MiB, Precision::Bytes); REQUIRE(b); }
  CHECK(!pool.get_managed_buffer(device, 9 * MiB, Precision::Bytes));
  Trace trace = history(pool);
  auto bigger = replay_trace(trace, sim(16 * MiB));
  REQUIRE(bigger);
  CHECK(bigger->trims == 2);  // pool.trim, and the OOM ladder's trim before the OOM
  CHECK(bigger->recorded_ooms == 1);
  CHECK(bigger->replay_ooms == 0);  // 9 MiB fits on 16 MiB
  CHECK(bigger->peak_reserved == 9 * MiB);
  auto same = replay_trace(trace, sim(8 * MiB));
  REQUIRE(same);
  CHECK(same->replay_ooms == 1);
  CHECK(same->peak_reserved == trace.peak_reserved_bytes());

  Trace broken;
  broken.events.push_back({0, 0, TraceEventKind::Alloc, 0, 0, 0, 0, Precision::Bytes, 0, 0, 0, 0});
  auto refused = replay_trace(broken, device);
  REQUIRE(!refused);
  CHECK(refused.error().message().find("allocates 0 bytes with id 0") != std::string::npos);
}
