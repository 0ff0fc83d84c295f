// The C ABI (include/gpupool/gpupool.h, libgpupool_c) on simulated devices: every entry point's
// success path against the pool's own figures, and its refusals with the status and message.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpupool/gpupool.h"

namespace {

int open_device(const char* spec = "sim:64MiB") {
  int device = -1;
  REQUIRE(gpupool_device_open(spec, &device) == GPUPOOL_OK);
  return device;
}

gpupool_pool* make_pool(size_t limit = GPUPOOL_NO_LIMIT) {
  gpupool_config config;
  gpupool_config_init(&config);
  config.max_pool_size = limit;
  gpupool_pool* pool = nullptr;
  REQUIRE(gpupool_pool_create(&config, &pool) == GPUPOOL_OK);
  REQUIRE(pool);
  return pool;
}

gpupool_stats stats_of(gpupool_pool* pool, int device) {
  gpupool_stats stats{};
  stats.struct_size = sizeof stats;
  REQUIRE(gpupool_get_stats(pool, device, &stats) == GPUPOOL_OK);
  return stats;
}

std::string last_error() { return gpupool_last_error(); }

}  // namespace

TEST_CASE("C ABI: allocate, free and the figures on a simulated device", "[c-abi]") {
  int device = open_device();
  CHECK(device >= 100);
  gpupool_pool* pool = make_pool();

  void* a = nullptr;
  void* b = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 1000, nullptr, &a) == GPUPOOL_OK);
  REQUIRE(gpupool_allocate(pool, device, 3 << 20, nullptr, &b) == GPUPOOL_OK);
  CHECK(last_error().empty());
  CHECK(a != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % GPUPOOL_ALIGNMENT == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % GPUPOOL_ALIGNMENT == 0);
  std::memset(a, 0x5a, 1000);  // a simulated device's memory is the host's

  size_t bytes = 0;
  int owner = -1;
  REQUIRE(gpupool_allocation_info(pool, a, &bytes, &owner) == GPUPOOL_OK);
  CHECK(bytes == 1000);
  CHECK(owner == device);

  gpupool_stats s = stats_of(pool, device);
  CHECK(s.live_allocations == 2);
  CHECK(s.requested_bytes == 1000 + (3 << 20));
  CHECK(s.in_use_bytes >= s.requested_bytes);
  CHECK(s.reserved_bytes == s.in_use_bytes + s.cached_bytes);

  REQUIRE(gpupool_deallocate(pool, a, nullptr) == GPUPOOL_OK);
  REQUIRE(gpupool_deallocate(pool, b, nullptr) == GPUPOOL_OK);
  s = stats_of(pool, device);
  CHECK(s.live_allocations == 0);
  CHECK(s.frees == 2);
  CHECK(s.cached_bytes > 0);

  void* again = nullptr;  // the cache serves the same size
  REQUIRE(gpupool_allocate(pool, device, 1000, nullptr, &again) == GPUPOOL_OK);
  CHECK(stats_of(pool, device).cache_hits >= 1);
  REQUIRE(gpupool_deallocate(pool, again, nullptr) == GPUPOOL_OK);

  size_t released = 0;
  REQUIRE(gpupool_cleanup(pool, device, &released) == GPUPOOL_OK);
  CHECK(released > 0);
  CHECK(stats_of(pool, device).reserved_bytes == 0);
  size_t free_bytes = 0, total = 0;
  REQUIRE(gpupool_device_memory(device, &free_bytes, &total) == GPUPOOL_OK);
  CHECK(free_bytes == total);
  CHECK(total == 64u << 20);
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: every refusal has a status and a message naming the problem", "[c-abi]") {
  int device = open_device();
  gpupool_pool* pool = make_pool();
  void* ptr = reinterpret_cast<void*>(0x1);

  CHECK(gpupool_allocate(pool, device, 0, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK(ptr == nullptr);
  CHECK_THAT(last_error(), Catch::Contains("bytes is 0"));
  CHECK(gpupool_allocate(nullptr, device, 8, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("pool is NULL"));
  CHECK(gpupool_allocate(pool, device, 8, nullptr, nullptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_allocate(pool, 3, 8, nullptr, &ptr) == GPUPOOL_DEVICE_UNAVAILABLE);  // no CUDA here
  CHECK_THAT(last_error(), Catch::Contains("cuda:3"));
  CHECK(gpupool_allocate(pool, 99, 8, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("CUDA ordinal 99 is out of range"));
  CHECK(gpupool_allocate(pool, 12345, 8, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("device 12345 is not open"));
  CHECK(gpupool_allocate(pool, -7, 8, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  int foreign_stream = 0;
  CHECK(gpupool_allocate(pool, device, 8, &foreign_stream, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("not a live stream"));
  CHECK(gpupool_allocate(pool, device, size_t{1} << 62, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_allocate(pool, device, 128u << 20, nullptr, &ptr) == GPUPOOL_OUT_OF_MEMORY);
  CHECK_THAT(last_error(), Catch::Contains("requested 128.00 MiB"));

  CHECK(gpupool_allocate_aligned(pool, device, 64, 4096, nullptr, &ptr) == GPUPOOL_UNSUPPORTED);
  CHECK_THAT(last_error(), Catch::Contains("alignment 4096 is above"));
  CHECK(gpupool_allocate_aligned(pool, device, 64, 48, nullptr, &ptr) == GPUPOOL_INVALID_INPUT);
  REQUIRE(gpupool_allocate_aligned(pool, device, 64, 128, nullptr, &ptr) == GPUPOOL_OK);
  CHECK(reinterpret_cast<std::uintptr_t>(ptr) % 128 == 0);

  REQUIRE(gpupool_deallocate(pool, ptr, nullptr) == GPUPOOL_OK);
  CHECK(gpupool_deallocate(pool, ptr, nullptr) == GPUPOOL_INVALID_STATE);  // a double free
  CHECK_THAT(last_error(), Catch::Contains("not a live allocation of this pool"));
  int on_the_host = 0;
  CHECK(gpupool_deallocate(pool, &on_the_host, nullptr) == GPUPOOL_INVALID_STATE);
  CHECK(gpupool_deallocate(pool, nullptr, nullptr) == GPUPOOL_OK);
  CHECK(last_error().empty());  // a success clears it

  gpupool_stats stats{};
  CHECK(gpupool_get_stats(pool, device, &stats) == GPUPOOL_INVALID_INPUT);  // struct_size unset
  CHECK(gpupool_get_stats(pool, 4242, &stats) != GPUPOOL_OK);

  gpupool_config config;
  gpupool_config_init(&config);
  config.critical_pressure = 1.5;
  gpupool_pool* bad = nullptr;
  CHECK(gpupool_pool_create(&config, &bad) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("critical_pressure is 1.5"));
  CHECK(bad == nullptr);
  config = gpupool_config{};
  CHECK(gpupool_pool_create(&config, &bad) == GPUPOOL_INVALID_INPUT);  // struct_size 0
  CHECK_THAT(last_error(), Catch::Contains("gpupool_config_init"));
  gpupool_config_init(&config);
  config.max_pool_size = 0;
  CHECK(gpupool_pool_create(&config, &bad) == GPUPOOL_INVALID_INPUT);
  gpupool_config_init(&config);
  config.segments = 3;
  CHECK(gpupool_pool_create(&config, &bad) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("segments is 3"));

  int unused = 0;
  CHECK(gpupool_device_open("tpu:0", &unused) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("tpu:0"));
  CHECK(std::string(gpupool_status_name(GPUPOOL_POOL_LIMIT_EXCEEDED)) == "pool limit exceeded");
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: a pool of virtual segments gives pages back from between live blocks", "[c-abi]") {
  int device = open_device("sim:256MiB");
  gpupool_config config;
  gpupool_config_init(&config);
  CHECK(config.segments == GPUPOOL_SEGMENTS_DEVICE);
  config.segments = GPUPOOL_SEGMENTS_VIRTUAL;
  gpupool_pool* pool = nullptr;
  REQUIRE(gpupool_pool_create(&config, &pool) == GPUPOOL_OK);
  void* middle = nullptr;
  void* end = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 16 << 20, nullptr, &middle) == GPUPOOL_OK);
  REQUIRE(gpupool_allocate(pool, device, 1 << 20, nullptr, &end) == GPUPOOL_OK);
  REQUIRE(gpupool_deallocate(pool, middle, nullptr) == GPUPOOL_OK);
  size_t released = 0;
  REQUIRE(gpupool_cleanup(pool, device, &released) == GPUPOOL_OK);
  CHECK(released == std::size_t{16} << 20);
  gpupool_stats stats{};
  stats.struct_size = sizeof stats;
  REQUIRE(gpupool_get_stats(pool, device, &stats) == GPUPOOL_OK);
  CHECK(stats.reserved_bytes == std::size_t{2} << 20);  // the page the live block touches
  REQUIRE(gpupool_deallocate(pool, end, nullptr) == GPUPOOL_OK);
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: limits, trim, pressure and its observers", "[c-abi]") {
  int device = open_device();
  gpupool_pool* pool = make_pool();
  REQUIRE(gpupool_set_limit(pool, device, 4u << 20) == GPUPOOL_OK);
  size_t limit = 0;
  REQUIRE(gpupool_get_limit(pool, device, &limit) == GPUPOOL_OK);
  CHECK(limit == 4u << 20);

  struct Seen {
    int calls = 0;
    int device = -1;
    double pressure = 0;
  } seen;
  uint64_t observer = 0;
  auto record = [](int d, double p, void* user) {
    auto* s = static_cast<Seen*>(user);
    ++s->calls;
    s->device = d;
    s->pressure = p;
  };
  REQUIRE(gpupool_add_pressure_observer(pool, 0.5, record, &seen, &observer) == GPUPOOL_OK);
  CHECK(gpupool_add_pressure_observer(pool, 2.0, record, &seen, &observer) == GPUPOOL_INVALID_INPUT);

  void* big = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 3u << 20, nullptr, &big) == GPUPOOL_OK);
  CHECK(seen.calls >= 1);
  CHECK(seen.device == device);
  CHECK(seen.pressure >= 0.5);
  double pressure = 0;
  REQUIRE(gpupool_pressure(pool, device, &pressure) == GPUPOOL_OK);
  CHECK(pressure >= 0.75);

  void* over = nullptr;
  CHECK(gpupool_allocate(pool, device, 2u << 20, nullptr, &over) == GPUPOOL_POOL_LIMIT_EXCEEDED);
  CHECK_THAT(last_error(), Catch::Contains("pool limit of 4.00 MiB"));

  REQUIRE(gpupool_deallocate(pool, big, nullptr) == GPUPOOL_OK);
  size_t released = 0;
  REQUIRE(gpupool_trim(pool, device, 0, &released) == GPUPOOL_OK);
  CHECK(released >= 3u << 20);
  REQUIRE(gpupool_remove_pressure_observer(pool, observer) == GPUPOOL_OK);
  REQUIRE(gpupool_set_cache_limit(pool, device, 0) == GPUPOOL_OK);
  REQUIRE(gpupool_set_limit(pool, device, GPUPOOL_NO_LIMIT) == GPUPOOL_OK);
  REQUIRE(gpupool_get_limit(pool, device, &limit) == GPUPOOL_OK);
  CHECK(limit == 64u << 20);
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: a free on another stream waits for that stream's work", "[c-abi]") {
  int device = open_device("sim:16MiB");
  gpupool_pool* pool = make_pool();
  void* first = nullptr;
  void* second = nullptr;
  REQUIRE(gpupool_stream_create(device, &first) == GPUPOOL_OK);
  REQUIRE(gpupool_stream_create(device, &second) == GPUPOOL_OK);

  void* ptr = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 4096, first, &ptr) == GPUPOOL_OK);
  REQUIRE(gpupool_record_stream(pool, ptr, second) == GPUPOOL_OK);
  REQUIRE(gpupool_deallocate(pool, ptr, second) == GPUPOOL_OK);
  // Reuse on the allocation's stream is stream-ordered; other streams get it once the work of
  // both streams up to the free is done (here it is: immediate streams), never while pending.
  void* next = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 4096, first, &next) == GPUPOOL_OK);
  REQUIRE(gpupool_deallocate(pool, next, first) == GPUPOOL_OK);
  REQUIRE(gpupool_stream_synchronize(device, first) == GPUPOOL_OK);
  REQUIRE(gpupool_stream_synchronize(device, nullptr) == GPUPOOL_OK);

  CHECK(gpupool_record_stream(pool, ptr, second) == GPUPOOL_INVALID_STATE);  // freed already

  // A free on a stream the device does not know frees nothing: the memory is still the caller's.
  void* kept = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 4096, first, &kept) == GPUPOOL_OK);
  int not_a_stream = 0;
  CHECK(gpupool_deallocate(pool, kept, &not_a_stream) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("not a live stream"));
  CHECK(stats_of(pool, device).live_allocations == 1);
  REQUIRE(gpupool_deallocate(pool, kept, first) == GPUPOOL_OK);
  REQUIRE(gpupool_stream_destroy(device, first) == GPUPOOL_OK);
  CHECK(gpupool_stream_destroy(device, first) == GPUPOOL_INVALID_INPUT);
  REQUIRE(gpupool_stream_destroy(device, second) == GPUPOOL_OK);
  size_t released = 0;
  REQUIRE(gpupool_cleanup(pool, GPUPOOL_ALL_DEVICES, &released) == GPUPOOL_OK);
  CHECK(stats_of(pool, GPUPOOL_ALL_DEVICES).reserved_bytes == 0);
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: threads allocate and free through one pool", "[c-abi]") {
  // Each thread keeps up to 1,333 allocations of 50 KB on average live: ~270 MB together at the
  // peak, so the device has room to spare (this case is about threads, not about running out).
  int device = open_device("sim:1GiB");
  gpupool_pool* pool = make_pool();
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::vector<void*> mine;
      for (int i = 0; i < 2000; ++i) {
        void* ptr = nullptr;
        if (gpupool_allocate(pool, device, static_cast<size_t>(256 + (i * 97 + t * 31) % 100000),
                             nullptr, &ptr) != GPUPOOL_OK) {
          ++failures[t];
          continue;
        }
        mine.push_back(ptr);
        if (i % 3 == 2) {
          failures[t] += gpupool_deallocate(pool, mine.front(), nullptr) != GPUPOOL_OK;
          mine.erase(mine.begin());
        }
      }
      for (void* ptr : mine) failures[t] += gpupool_deallocate(pool, ptr, nullptr) != GPUPOOL_OK;
    });
  for (auto& thread : threads) thread.join();
  CHECK(failures == std::vector<int>(4, 0));
  gpupool_stats s = stats_of(pool, device);
  CHECK(s.live_allocations == 0);
  CHECK(s.allocations == 8000);
  CHECK(s.frees == 8000);
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: pool handles are shared, memory outlives the last one", "[c-abi]") {
  int device = open_device("sim:16MiB");
  gpupool_pool* pool = make_pool();
  CHECK(gpupool_pool_retain(pool) == pool);
  void* ptr = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 1 << 20, nullptr, &ptr) == GPUPOOL_OK);
  gpupool_pool_release(pool);  // one owner left
  CHECK(stats_of(pool, device).live_allocations == 1);
  size_t free_bytes = 0, total = 0;
  gpupool_pool_release(pool);  // the last: its live allocation returns to the device
  REQUIRE(gpupool_device_memory(device, &free_bytes, &total) == GPUPOOL_OK);
  CHECK(free_bytes == total);
  gpupool_pool_release(nullptr);
  CHECK(gpupool_pool_retain(nullptr) == nullptr);
}

TEST_CASE("C ABI: the memory report as JSON", "[c-abi]") {
  int device = open_device("sim:16MiB");
  gpupool_pool* pool = make_pool();
  void* ptr = nullptr;
  REQUIRE(gpupool_allocate(pool, device, 5000, nullptr, &ptr) == GPUPOOL_OK);
  size_t needed = 0;
  REQUIRE(gpupool_report_json(pool, device, nullptr, 0, &needed) == GPUPOOL_OK);
  CHECK(needed > 10);
  std::vector<char> small(needed - 1);
  CHECK(gpupool_report_json(pool, device, small.data(), small.size(), &needed) == GPUPOOL_INVALID_INPUT);
  std::vector<char> json(needed);
  REQUIRE(gpupool_report_json(pool, device, json.data(), json.size(), &needed) == GPUPOOL_OK);
  CHECK_THAT(std::string(json.data()), Catch::Contains("\"devices\": [") && Catch::Contains("\"used_bytes\": 5120"));
  CHECK(std::strlen(json.data()) + 1 == needed);
  REQUIRE(gpupool_deallocate(pool, ptr, nullptr) == GPUPOOL_OK);
  gpupool_pool_release(pool);
}

TEST_CASE("C ABI: PyTorch's allocator pair over the process pool", "[c-abi]") {
  int device = open_device("sim:32MiB");
  CHECK(gpupool_torch_malloc(0, device, nullptr) == nullptr);  // empty tensors hold no memory
  void* ptr = gpupool_torch_malloc(1 << 20, device, nullptr);
  REQUIRE(ptr != nullptr);
  gpupool_pool* process = nullptr;
  REQUIRE(gpupool_process_pool(&process) == GPUPOOL_OK);
  CHECK(stats_of(process, device).live_allocations == 1);
  gpupool_torch_free(ptr, 1 << 20, device, nullptr);
  CHECK(stats_of(process, device).live_allocations == 0);
  try {  // past the device: PyTorch checks no pointer, so the failure is an exception
    gpupool_torch_malloc(1u << 30, device, nullptr);
    FAIL("1 GiB was given on a 32 MiB device");
  } catch (const std::bad_alloc& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("requested 1.00 GiB"));
  }
  gpupool_torch_free(nullptr, 0, device, nullptr);
}

TEST_CASE("C ABI: every entry point refuses a NULL pool and NULL outputs", "[c-abi]") {
  int device = open_device("sim:16MiB");
  gpupool_pool* pool = make_pool();
  void* ptr = nullptr;
  size_t size = 0;
  double pressure = 0;
  uint64_t id = 0;
  int owner = 0;
  gpupool_stats stats{};
  stats.struct_size = sizeof stats;
  char text[16];
  auto observer = [](int, double, void*) {};
  const std::vector<std::pair<const char*, gpupool_status>> null_pool = {
      {"allocate", gpupool_allocate(nullptr, device, 8, nullptr, &ptr)},
      {"allocate_aligned", gpupool_allocate_aligned(nullptr, device, 8, 64, nullptr, &ptr)},
      {"deallocate", gpupool_deallocate(nullptr, &size, nullptr)},
      {"record_stream", gpupool_record_stream(nullptr, &size, nullptr)},
      {"allocation_info", gpupool_allocation_info(nullptr, &size, &size, &owner)},
      {"get_stats", gpupool_get_stats(nullptr, device, &stats)},
      {"reset_peaks", gpupool_reset_peaks(nullptr, device)},
      {"report_json", gpupool_report_json(nullptr, device, text, sizeof text, &size)},
      {"trim", gpupool_trim(nullptr, device, 0, &size)},
      {"cleanup", gpupool_cleanup(nullptr, device, &size)},
      {"set_limit", gpupool_set_limit(nullptr, device, 1 << 20)},
      {"get_limit", gpupool_get_limit(nullptr, device, &size)},
      {"set_cache_limit", gpupool_set_cache_limit(nullptr, device, 0)},
      {"pressure", gpupool_pressure(nullptr, device, &pressure)},
      {"add_pressure_observer", gpupool_add_pressure_observer(nullptr, 0.5, observer, nullptr, &id)},
      {"remove_pressure_observer", gpupool_remove_pressure_observer(nullptr, id)},
  };
  for (const auto& [name, status] : null_pool) {
    INFO(name);
    CHECK(status == GPUPOOL_INVALID_INPUT);
  }
  const std::vector<std::pair<const char*, gpupool_status>> null_output = {
      {"device_open", gpupool_device_open("sim", nullptr)},
      {"device_memory", gpupool_device_memory(device, nullptr, &size)},
      {"stream_create", gpupool_stream_create(device, nullptr)},
      {"pool_create", gpupool_pool_create(nullptr, nullptr)},
      {"pool_create_from_environment", gpupool_pool_create_from_environment(nullptr)},
      {"process_pool", gpupool_process_pool(nullptr)},
      {"allocation_info", gpupool_allocation_info(pool, &size, nullptr, &owner)},
      {"get_stats", gpupool_get_stats(pool, device, nullptr)},
      {"report_json", gpupool_report_json(pool, device, text, sizeof text, nullptr)},
      {"get_limit", gpupool_get_limit(pool, device, nullptr)},
      {"pressure", gpupool_pressure(pool, device, nullptr)},
      {"add_pressure_observer", gpupool_add_pressure_observer(pool, 0.5, nullptr, nullptr, &id)},
      {"record_stream of NULL", gpupool_record_stream(pool, nullptr, nullptr)},
  };
  for (const auto& [name, status] : null_output) {
    INFO(name);
    CHECK(status == GPUPOOL_INVALID_INPUT);
    CHECK_FALSE(last_error().empty());
  }
  // Devices that are not open, for every call that takes one.
  const int closed = 4242;
  CHECK(gpupool_device_memory(closed, &size, &size) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_stream_create(closed, &ptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_stream_destroy(closed, nullptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_stream_synchronize(closed, nullptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_reset_peaks(pool, closed) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_trim(pool, closed, 0, nullptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_cleanup(pool, closed, nullptr) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_set_limit(pool, closed, 1) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_set_cache_limit(pool, closed, 1) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_pressure(pool, closed, &pressure) == GPUPOOL_INVALID_INPUT);
  CHECK(gpupool_report_json(pool, closed, nullptr, 0, &size) == GPUPOOL_INVALID_INPUT);
  CHECK_THAT(last_error(), Catch::Contains("device 4242 is not open"));
  gpupool_pool_release(pool);
}
