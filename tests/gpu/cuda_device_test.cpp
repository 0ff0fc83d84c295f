// The CUDA backend on a real GPU. Tagged [gpu]: CTest skips these, tools/gpu-check.sh runs them on
// the GPU machine (`gpupool_tests "[gpu]"`). Without a GPU every one of them fails at once.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>
import gpupool;
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;
using gpupool::testing::random_bytes;
using namespace std::chrono_literals;

namespace {

// The CUDA statuses the backend must keep (cudaError_t values; the tests do not see the CUDA
// headers, which gpupool uses privately).
constexpr int kCudaErrorInvalidValue = 1;
constexpr int kCudaErrorMemoryAllocation = 2;



// Device memory freed at scope exit (so a failed REQUIRE leaks nothing into the next test).
struct DeviceBlock {
  Device device;
  void* ptr = nullptr;
  DeviceBlock(Device d, std::size_t bytes) : device(std::move(d)) {
    auto p = device.allocate(bytes);
    if (!p) FAIL(p.error().to_string());
    ptr = *p;
  }
  ~DeviceBlock() { if (ptr) (void)device.deallocate(ptr); }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;
  std::uint8_t* bytes() const { return static_cast<std::uint8_t*>(ptr); }
};

struct PinnedBlock {
  Device device;
  void* ptr = nullptr;
  PinnedBlock(Device d, std::size_t bytes) : device(std::move(d)) {
    auto p = device.allocate_pinned(bytes);
    if (!p) FAIL(p.error().to_string());
    ptr = *p;
  }
  ~PinnedBlock() { if (ptr) (void)device.deallocate_pinned(ptr); }
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  std::uint8_t* bytes() const { return static_cast<std::uint8_t*>(ptr); }
};

// Blocks a stream (through host work) until open() is called, at most 30 s so a broken test
// cannot hang the suite. The work shares the gate's state, and a gate left closed by a failed
// REQUIRE opens as it goes out of scope. Cases that watch such a stream from the host are tagged
// [blocking]: under compute-sanitizer's initcheck an event query waits for its event.
struct Gate {
  std::promise<void> promise;
  std::shared_future<void> future = promise.get_future().share();
  std::shared_ptr<std::atomic<bool>> timed_out_flag = std::make_shared<std::atomic<bool>>(false);
  bool opened = false;
  std::function<void()> work() const {
    return [future = future, flag = timed_out_flag] {
      if (future.wait_for(30s) != std::future_status::ready) *flag = true;
    };
  }
  void open() {
    if (!opened) promise.set_value();
    opened = true;
  }
  bool timed_out() const { return *timed_out_flag; }
  ~Gate() { open(); }
};


}  // namespace

TEST_CASE("cuda: the GPU is enumerated with its real properties", "[gpu][cuda]") {
  int count = Device::cuda_device_count();
  REQUIRE(count > 0);
  Device device = gpu();
  const DeviceProperties& p = device.properties();
  WARN(device.describe());
  CHECK(device.kind() == DeviceKind::Cuda);
  CHECK(p.kind == DeviceKind::Cuda);
  CHECK(device.id() == 0);
  CHECK(p.ordinal == 0);
  CHECK_FALSE(p.name.empty());
  CHECK(p.name != "gpupool simulated device");
  CHECK(p.multiprocessor_count > 0);
  CHECK(p.compute_capability_major >= 5);  // anything CUDA 13 still runs on
  CHECK(p.compute_capability_minor >= 0);
  CHECK(p.total_memory >= 1 * GiB);

  auto info = device.memory_info();
  REQUIRE(info);
  CHECK(info->total == p.total_memory);
  CHECK(info->free > 0);
  CHECK(info->free <= info->total);

  // One backend per ordinal, and every way of naming the GPU reaches it.
  CHECK(*Device::cuda(0) == device);
  CHECK(*Device::from_string("cuda:0") == device);
  CHECK(*Device::from_string("cuda") == device);
  CHECK(Device::from_string("auto")->kind() == DeviceKind::Cuda);
  CHECK_THAT(device.describe(), Catch::Contains("cuda:0") && Catch::Contains(p.name));

  auto missing = Device::cuda(count);
  REQUIRE_FALSE(missing);
  CHECK(missing.error().kind() == ErrorKind::DeviceUnavailable);
  CHECK_THAT(missing.error().message(), Catch::Contains(std::to_string(count) + " CUDA device"));
}

TEST_CASE("cuda: allocations are real device memory and come back", "[gpu][cuda]") {
  Device device = gpu();
  auto before = device.memory_info();
  REQUIRE(before);

  constexpr std::size_t big = 256 * MiB;
  auto a = device.allocate(big);
  REQUIRE(a);
  CHECK(*a != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(*a) % 256 == 0);
  auto during = device.memory_info();
  REQUIRE(during);
  CHECK(before->free - during->free >= big);  // the driver really handed the bytes out

  std::vector<void*> small;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{255}, std::size_t{4097}, 3 * MiB + 1}) {
    auto p = device.allocate(bytes);
    REQUIRE(p);
    CHECK(reinterpret_cast<std::uintptr_t>(*p) % 256 == 0);
    for (void* q : small) CHECK(q != *p);
    small.push_back(*p);
  }
  for (void* p : small) REQUIRE_OK(device.deallocate(p));
  REQUIRE_OK(device.deallocate(*a));
  auto after = device.memory_info();
  REQUIRE(after);
  CHECK(after->free >= during->free + big);

  auto zero = device.allocate(0);
  REQUIRE_FALSE(zero);
  CHECK(zero.error().kind() == ErrorKind::InvalidInput);
  CHECK(zero.error().device() == 0);
  auto null_free = device.deallocate(nullptr);
  REQUIRE_FALSE(null_free);
  CHECK(null_free.error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("cuda: host-to-device, device-to-device and device-to-host copies round-trip",
          "[gpu][cuda]") {
  Device device = gpu();
  auto stream = device.create_stream();
  REQUIRE(stream);
  CHECK_FALSE(stream->is_default());
  CHECK(stream->native() != nullptr);

  for (std::size_t n : {std::size_t{1}, std::size_t{4093}, 3 * MiB + 17, 64 * MiB}) {
    CAPTURE(n);
    std::vector<std::uint8_t> data = random_bytes(n);
    std::vector<std::uint8_t> back(n);
    for (std::size_t i = 0; i < n; ++i) back[i] = static_cast<std::uint8_t>(~data[i]);
    DeviceBlock a(device, n), b(device, n);
    REQUIRE_OK(device.copy(a.ptr, data.data(), n, CopyKind::HostToDevice, *stream));
    REQUIRE_OK(device.copy(b.ptr, a.ptr, n, CopyKind::DeviceToDevice, *stream));
    REQUIRE_OK(device.copy(back.data(), b.ptr, n, CopyKind::DeviceToHost, *stream));
    REQUIRE_OK(stream->synchronize());
    CHECK(back == data);
  }

  // Offsets inside allocations are honoured: b[3 .. 3+m) = a[5 .. 5+m).
  constexpr std::size_t n = 1 * MiB, m = n - 8;
  std::vector<std::uint8_t> data = random_bytes(n);
  std::vector<std::uint8_t> zeros(n, 0), back(n, 0xEE);
  DeviceBlock a(device, n), b(device, n);
  REQUIRE_OK(device.copy(a.ptr, data.data(), n, CopyKind::HostToDevice, *stream));
  REQUIRE_OK(device.copy(b.ptr, zeros.data(), n, CopyKind::HostToDevice, *stream));
  REQUIRE_OK(device.copy(b.bytes() + 3, a.bytes() + 5, m, CopyKind::DeviceToDevice, *stream));
  REQUIRE_OK(device.copy(back.data(), b.ptr, n, CopyKind::DeviceToHost, *stream));
  REQUIRE_OK(stream->synchronize());
  std::vector<std::uint8_t> expected(n, 0);
  std::memcpy(expected.data() + 3, data.data() + 5, m);
  CHECK(back == expected);

  // The default stream works too (and Device::synchronize waits for it).
  std::vector<std::uint8_t> again(n, 0);
  REQUIRE_OK(device.copy(a.ptr, data.data(), n, CopyKind::HostToDevice, device.default_stream()));
  REQUIRE_OK(device.copy(again.data(), a.ptr, n, CopyKind::DeviceToHost, device.default_stream()));
  REQUIRE_OK(device.synchronize());
  CHECK(again == data);
}

TEST_CASE("cuda: fill sets exactly the bytes it is given", "[gpu][cuda]") {
  Device device = gpu();
  auto stream = device.create_stream();
  REQUIRE(stream);
  constexpr std::size_t n = 8 * MiB + 3;
  DeviceBlock block(device, n);
  std::vector<std::uint8_t> back = random_bytes(n);
  REQUIRE_OK(device.fill(block.ptr, 0xAB, n, *stream));
  REQUIRE_OK(device.fill(block.bytes() + 1000, 0x11, 3001, *stream));
  REQUIRE_OK(device.copy(back.data(), block.ptr, n, CopyKind::DeviceToHost, *stream));
  REQUIRE_OK(stream->synchronize());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint8_t want = (i >= 1000 && i < 4001) ? 0x11 : 0xAB;
    if (back[i] != want) ++wrong;
  }
  CHECK(wrong == 0);
  CHECK(back[999] == 0xAB);
  CHECK(back[1000] == 0x11);
  CHECK(back[4000] == 0x11);
  CHECK(back[4001] == 0xAB);
  CHECK(back[n - 1] == 0xAB);
}

TEST_CASE("cuda: host work and events follow stream order", "[gpu][cuda]") {
  Device device = gpu();
  auto stream = device.create_stream();
  REQUIRE(stream);

  SECTION("host work after a copy sees the copied data") {
    constexpr std::size_t n = 64 * MiB;  // large enough that running early would be seen
    PinnedBlock src(device, n), dst(device, n);
    std::vector<std::uint8_t> data = random_bytes(n);
    std::memcpy(src.ptr, data.data(), n);
    std::memset(dst.ptr, 0, n);
    std::atomic<int> ran{0};
    std::atomic<bool> saw_data{false};
    DeviceBlock block(device, n);  // last: its cudaFree waits for the work above on failure paths
    REQUIRE_OK(device.copy(block.ptr, src.ptr, n, CopyKind::HostToDevice, *stream));
    REQUIRE_OK(device.copy(dst.ptr, block.ptr, n, CopyKind::DeviceToHost, *stream));
    REQUIRE_OK(device.enqueue_host_work(*stream, [&] {
      saw_data = std::memcmp(dst.ptr, data.data(), n) == 0;
      ++ran;
    }));
    auto event = device.create_event();
    REQUIRE(event);
    REQUIRE_OK(event->record(*stream));
    REQUIRE_OK(event->synchronize());
    CHECK(ran == 1);  // the event comes after the host work, so it has run
    CHECK(saw_data);
    auto done = event->completed();
    REQUIRE(done);
    CHECK(*done);
  }

  SECTION("an event is pending until the work before it is done") {
    auto event = device.create_event();
    REQUIRE(event);
    auto fresh = event->completed();  // never recorded: nothing to wait for
    REQUIRE(fresh);
    CHECK(*fresh);

    struct Seen {
      std::atomic<int> order{0};
      int first = -1, second = -1;
    };
    auto seen = std::make_shared<Seen>();  // shared with the work, which may outlive a failure
    Gate gate;
    REQUIRE_OK(device.enqueue_host_work(*stream, gate.work()));
    REQUIRE_OK(device.enqueue_host_work(*stream, [seen] { seen->first = seen->order++; }));
    REQUIRE_OK(device.enqueue_host_work(*stream, [seen] { seen->second = seen->order++; }));
    REQUIRE_OK(event->record(*stream));
    std::this_thread::sleep_for(50ms);
    for (int i = 0; i < 3; ++i) {
      auto pending = event->completed();
      REQUIRE(pending);  // cudaErrorNotReady is an answer, not an error
      CHECK_FALSE(*pending);
    }
    CHECK(seen->order == 0);
    gate.open();
    REQUIRE_OK(event->synchronize());
    CHECK_FALSE(gate.timed_out());
    auto done = event->completed();
    REQUIRE(done);
    CHECK(*done);
    CHECK(seen->first == 0);
    CHECK(seen->second == 1);
    // The thread's last error holds nothing from the pending queries: later calls still work.
    DeviceBlock block(device, 4096);
    REQUIRE_OK(device.fill(block.ptr, 1, 4096, *stream));
    REQUIRE_OK(stream->synchronize());
  }
}

TEST_CASE("cuda: a stream waits for an event of another stream", "[gpu][cuda][blocking]") {
  Device device = gpu();
  auto producer = device.create_stream();
  auto consumer = device.create_stream();
  REQUIRE(producer);
  REQUIRE(consumer);
  CHECK(producer->native() != consumer->native());

  constexpr std::size_t n = 16 * MiB;
  PinnedBlock src(device, n), dst(device, n);
  std::vector<std::uint8_t> data = random_bytes(n);
  std::memcpy(src.ptr, data.data(), n);
  std::memset(dst.ptr, 0x5A, n);
  DeviceBlock block(device, n);
  REQUIRE_OK(device.fill(block.ptr, 0, n, device.default_stream()));
  REQUIRE_OK(device.synchronize());

  Gate gate;
  auto produced = device.create_event();
  auto consumed = device.create_event();
  REQUIRE(produced);
  REQUIRE(consumed);
  // producer: (blocked) -> upload;  consumer: wait(produced) -> download
  REQUIRE_OK(device.enqueue_host_work(*producer, gate.work()));
  REQUIRE_OK(device.copy(block.ptr, src.ptr, n, CopyKind::HostToDevice, *producer));
  REQUIRE_OK(produced->record(*producer));
  REQUIRE_OK(produced->make_wait(*consumer));
  REQUIRE_OK(device.copy(dst.ptr, block.ptr, n, CopyKind::DeviceToHost, *consumer));
  REQUIRE_OK(consumed->record(*consumer));

  std::this_thread::sleep_for(100ms);
  auto early = consumed->completed();
  REQUIRE(early);
  CHECK_FALSE(*early);  // the consumer is held back by the producer's event
  gate.open();
  REQUIRE_OK(consumer->synchronize());
  CHECK_FALSE(gate.timed_out());
  CHECK(std::memcmp(dst.ptr, data.data(), n) == 0);  // it downloaded what the producer uploaded
  auto produced_done = produced->completed();
  REQUIRE(produced_done);
  CHECK(*produced_done);
}

TEST_CASE("cuda: out-of-memory is its own kind and keeps the CUDA status", "[gpu][cuda]") {
  Device device = gpu();
  std::size_t total = device.properties().total_memory;
  auto huge = device.allocate(2 * total);
  REQUIRE_FALSE(huge);
  const GpuError& error = huge.error();
  CHECK(error.kind() == ErrorKind::OutOfMemory);
  CHECK(error.is_out_of_memory());
  CHECK(error.device() == 0);
  REQUIRE(error.native_status());
  CHECK(*error.native_status() == NativeStatus{StatusSource::Cuda, kCudaErrorMemoryAllocation});
  CHECK_THAT(error.message(), Catch::Contains("requested " + format_bytes(2 * total)));
  CHECK_THAT(error.message(), Catch::Contains("of " + format_bytes(total)));
  CHECK_THAT(error.message(), Catch::Contains("cudaErrorMemoryAllocation"));
  WARN(error.to_string());

  // Not sticky: the device goes on working.
  std::vector<std::uint8_t> data = random_bytes(4096), back(4096, 0);
  DeviceBlock block(device, 4096);
  auto stream = device.default_stream();
  REQUIRE_OK(device.copy(block.ptr, data.data(), 4096, CopyKind::HostToDevice, stream));
  REQUIRE_OK(device.copy(back.data(), block.ptr, 4096, CopyKind::DeviceToHost, stream));
  REQUIRE_OK(stream.synchronize());
  CHECK(back == data);
}

TEST_CASE("cuda: foreign and double frees are errors, not crashes", "[gpu][cuda]") {
  Device device = gpu();

  std::vector<std::uint8_t> host(4096);
  auto foreign = device.deallocate(host.data());
  REQUIRE_FALSE(foreign);
  CHECK(foreign.error().device() == 0);
  REQUIRE(foreign.error().native_status());
  CHECK(foreign.error().native_status()->source == StatusSource::Cuda);
  CHECK(foreign.error().kind() != ErrorKind::OutOfMemory);
  INFO(foreign.error().to_string());
  CHECK_THAT(foreign.error().message(), Catch::Contains("cudaFree"));

  auto p = device.allocate(1 * MiB);
  REQUIRE(p);
  REQUIRE_OK(device.deallocate(*p));
  auto twice = device.deallocate(*p);
  REQUIRE_FALSE(twice);
  REQUIRE(twice.error().native_status());
  CHECK(twice.error().kind() != ErrorKind::OutOfMemory);
  INFO(twice.error().to_string());
  WARN("double free: " << twice.error().to_string());

  auto not_pinned = device.deallocate_pinned(host.data());
  REQUIRE_FALSE(not_pinned);
  REQUIRE(not_pinned.error().native_status());
  CHECK(not_pinned.error().native_status()->code == kCudaErrorInvalidValue);
  CHECK(not_pinned.error().kind() == ErrorKind::InvalidInput);

  // Nothing above broke the device.
  std::vector<std::uint8_t> data = random_bytes(8192), back(8192, 0);
  DeviceBlock block(device, 8192);
  REQUIRE_OK(device.copy(block.ptr, data.data(), 8192, CopyKind::HostToDevice, device.default_stream()));
  REQUIRE_OK(device.copy(back.data(), block.ptr, 8192, CopyKind::DeviceToHost, device.default_stream()));
  REQUIRE_OK(device.synchronize());
  CHECK(back == data);
}

TEST_CASE("cuda: pinned host memory round-trips", "[gpu][cuda]") {
  Device device = gpu();
  auto stream = device.create_stream();
  REQUIRE(stream);
  constexpr std::size_t n = 32 * MiB + 5;
  PinnedBlock up(device, n), down(device, n);
  std::vector<std::uint8_t> data = random_bytes(n);
  std::memcpy(up.ptr, data.data(), n);
  std::memset(down.ptr, 0, n);
  DeviceBlock block(device, n);
  REQUIRE_OK(device.copy(block.ptr, up.ptr, n, CopyKind::HostToDevice, *stream));
  REQUIRE_OK(device.copy(down.ptr, block.ptr, n, CopyKind::DeviceToHost, *stream));
  REQUIRE_OK(stream->synchronize());
  CHECK(std::memcmp(down.ptr, data.data(), n) == 0);

  CHECK(device.allocate_pinned(0).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.deallocate_pinned(nullptr).error().kind() == ErrorKind::InvalidInput);
  // Below 2 MiB from cudaMallocHost, above it mapped and registered: both freed once only.
  for (std::size_t bytes : {std::size_t{4096}, 3 * MiB + 1}) {
    CAPTURE(bytes);
    auto extra = device.allocate_pinned(bytes);
    REQUIRE(extra);
    REQUIRE_OK(device.deallocate_pinned(*extra));
    auto again = device.deallocate_pinned(*extra);
    REQUIRE_FALSE(again);
    CHECK(again.error().native_status().has_value());
  }
}

TEST_CASE("cuda: works from any thread, simulated-only operations are Unsupported",
          "[gpu][cuda]") {
  Device device = gpu();
  std::vector<std::uint8_t> data = random_bytes(1 * MiB);
  std::vector<std::uint8_t> back(1 * MiB, 0);
  std::optional<std::string> failure;
  std::thread worker([&] {
    auto p = device.allocate(1 * MiB);
    if (!p) { failure = p.error().to_string(); return; }
    auto s = device.create_stream();
    if (!s) { failure = s.error().to_string(); return; }
    if (auto ok = device.copy(*p, data.data(), 1 * MiB, CopyKind::HostToDevice, *s); !ok)
      failure = ok.error().to_string();
    else if (auto ok2 = device.copy(back.data(), *p, 1 * MiB, CopyKind::DeviceToHost, *s); !ok2)
      failure = ok2.error().to_string();
    else if (auto ok3 = s->synchronize(); !ok3)
      failure = ok3.error().to_string();
    if (auto ok4 = device.deallocate(*p); !ok4 && !failure) failure = ok4.error().to_string();
  });
  worker.join();
  CHECK(failure == std::nullopt);
  CHECK(back == data);

  auto capacity = device.set_simulated_capacity(1 * GiB);
  REQUIRE_FALSE(capacity);
  CHECK(capacity.error().kind() == ErrorKind::Unsupported);
  CHECK_THAT(capacity.error().message(), Catch::Contains("simulated"));
  auto faults = device.inject_faults({.fail_nth_allocation = 1});
  REQUIRE_FALSE(faults);
  CHECK(faults.error().kind() == ErrorKind::Unsupported);
  // And the "fault" was not applied anyway.
  DeviceBlock block(device, 4096);
  CHECK(block.ptr != nullptr);
}
