#include <catch2/catch.hpp>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>
#include <optional>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <sched.h>
#endif
import gpupool;

using namespace gpupool;

namespace {
Device make_sim(std::size_t capacity = 1 * MiB, bool deferred = false) {
  auto device = Device::simulated({.capacity = capacity, .deferred_streams = deferred});
  REQUIRE(device);
  return *device;
}
}  // namespace

TEST_CASE("a simulated device accounts its capacity exactly", "[device][sim]") {
  Device device = make_sim(1 * MiB);
  CHECK(device.kind() == DeviceKind::Simulated);
  CHECK(device.id() >= 100);
  CHECK(device.memory_info()->total == 1 * MiB);
  CHECK(device.memory_info()->free == 1 * MiB);

  auto a = device.allocate(300 * KiB);
  auto b = device.allocate(700 * KiB);
  REQUIRE(a);
  REQUIRE(b);
  CHECK(reinterpret_cast<std::uintptr_t>(*a) % 256 == 0);
  CHECK(device.memory_info()->free == 24 * KiB);

  auto too_much = device.allocate(25 * KiB);
  REQUIRE_FALSE(too_much);
  CHECK(too_much.error().kind() == ErrorKind::OutOfMemory);
  CHECK(too_much.error().device() == device.id());
  CHECK_THAT(too_much.error().message(), Catch::Contains("requested 25.00 KiB"));

  REQUIRE(device.deallocate(*a));
  CHECK(device.memory_info()->free == 324 * KiB);
  REQUIRE(device.deallocate(*b));
  CHECK(device.memory_info()->free == 1 * MiB);
}

TEST_CASE("simulated devices are distinct and chosen by name", "[device][sim]") {
  Device a = make_sim(), b = make_sim();
  CHECK(a.id() != b.id());
  CHECK_FALSE(a == b);
  auto named = Device::from_string("sim:2GiB");
  REQUIRE(named);
  CHECK(named->memory_info()->total == 2 * GiB);
  CHECK(Device::from_string("sim")->kind() == DeviceKind::Simulated);
  for (const char* bad : {"", "gpu", "cuda:x", "cuda:-1", "sim:lots", "sim:0x10", "cuda:1:2"}) {
    auto device = Device::from_string(bad);
    REQUIRE_FALSE(device);
    CHECK(device.error().kind() == ErrorKind::InvalidInput);
  }
  auto zero = Device::simulated({.capacity = 0});
  REQUIRE_FALSE(zero);
  CHECK_THAT(zero.error().message(), Catch::Contains("capacity is 0 bytes"));
}

TEST_CASE("without a GPU, CUDA devices are unavailable with a way out", "[device]") {
  if (Device::cuda_device_count() > 0) return;  // [gpu] tests cover this machine
  auto device = Device::cuda(0);
  REQUIRE_FALSE(device);
  CHECK(device.error().kind() == ErrorKind::DeviceUnavailable);
  CHECK_THAT(device.error().message(), Catch::Contains("GPUPOOL_DEVICE=sim"));
  CHECK(Device::from_string("auto")->kind() == DeviceKind::Simulated);
  CHECK(Device::cuda(99).error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("bad allocations and frees are errors, never crashes", "[device][sim]") {
  Device device = make_sim(1 * MiB);
  CHECK(device.allocate(0).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.allocate(SIZE_MAX).error().kind() == ErrorKind::OutOfMemory);
  CHECK(device.allocate(SIZE_MAX / 2).error().kind() == ErrorKind::OutOfMemory);

  int on_stack = 0;
  auto foreign = device.deallocate(&on_stack);
  REQUIRE_FALSE(foreign);
  CHECK(foreign.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(foreign.error().message(), Catch::Contains("not a live allocation"));

  auto ptr = device.allocate(1024);
  REQUIRE(ptr);
  CHECK(device.deallocate(static_cast<char*>(*ptr) + 256).error().kind() == ErrorKind::InvalidInput);
  REQUIRE(device.deallocate(*ptr));
  CHECK(device.deallocate(*ptr).error().kind() == ErrorKind::InvalidInput);  // double free
  CHECK(device.memory_info()->free == 1 * MiB);

  Device other = make_sim();
  auto theirs = other.allocate(512);
  REQUIRE(theirs);
  CHECK(device.deallocate(*theirs).error().kind() == ErrorKind::InvalidInput);
  REQUIRE(other.deallocate(*theirs));
}

TEST_CASE("copies round-trip and are bounds-checked", "[device][sim]") {
  Device device = make_sim();
  Stream stream = device.default_stream();
  std::vector<float> host(1000), back(1000, -1.0f);
  std::iota(host.begin(), host.end(), 0.5f);
  auto dev = device.allocate(host.size() * sizeof(float));
  auto dev2 = device.allocate(host.size() * sizeof(float));
  REQUIRE(dev);
  REQUIRE(dev2);
  REQUIRE(device.copy(*dev, host.data(), 4000, CopyKind::HostToDevice, stream));
  REQUIRE(device.copy(*dev2, *dev, 4000, CopyKind::DeviceToDevice, stream));
  REQUIRE(device.copy(back.data(), *dev2, 4000, CopyKind::DeviceToHost, stream));
  REQUIRE(stream.synchronize());
  CHECK(back == host);

  auto past_end = device.copy(*dev, host.data(), 4001, CopyKind::HostToDevice, stream);
  REQUIRE_FALSE(past_end);
  CHECK(past_end.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(past_end.error().message(), Catch::Contains("runs past the end"));
  auto offset = static_cast<char*>(*dev) + 3000;
  CHECK(device.copy(offset, host.data(), 1001, CopyKind::HostToDevice, stream).error().kind() ==
        ErrorKind::InvalidInput);
  CHECK(device.copy(back.data(), host.data(), 4, CopyKind::DeviceToHost, stream).error().kind() ==
        ErrorKind::InvalidInput);
  CHECK(device.copy(nullptr, host.data(), 4, CopyKind::HostToDevice, stream).error().kind() ==
        ErrorKind::InvalidInput);
  CHECK(device.fill(*dev, 0, 4001, stream).error().kind() == ErrorKind::InvalidInput);

  Device other = make_sim();
  auto wrong_stream = device.copy(*dev, host.data(), 4, CopyKind::HostToDevice, other.default_stream());
  REQUIRE_FALSE(wrong_stream);
  CHECK_THAT(wrong_stream.error().message(), Catch::Contains("stream of device"));
  REQUIRE(device.deallocate(*dev));
  REQUIRE(device.deallocate(*dev2));
}

TEST_CASE("deferred streams run in order and events see pending work", "[device][sim]") {
  Device device = make_sim(1 * MiB, /*deferred=*/true);
  auto stream = device.create_stream();
  auto other = device.create_stream();
  REQUIRE(stream);
  REQUIRE(other);
  std::vector<int> order;
  REQUIRE(device.enqueue_host_work(*stream, [&] { order.push_back(1); }));
  REQUIRE(device.enqueue_host_work(*stream, [&] { order.push_back(2); }));
  auto event = device.create_event();
  REQUIRE(event);
  REQUIRE(event->record(*stream));
  REQUIRE(device.enqueue_host_work(*stream, [&] { order.push_back(3); }));
  CHECK(order.empty());
  CHECK(*event->completed() == false);

  // Work on `other` that waits for the event runs after 1 and 2, before 3.
  REQUIRE(event->make_wait(*other));
  REQUIRE(device.enqueue_host_work(*other, [&] { order.push_back(10); }));
  REQUIRE(other->synchronize());
  CHECK(order == std::vector<int>{1, 2, 10});
  CHECK(*event->completed());
  REQUIRE(stream->synchronize());
  CHECK(order == std::vector<int>{1, 2, 10, 3});
}

TEST_CASE("a stream waiting for an event of its own keeps its order", "[device][sim]") {
  // As cudaStreamWaitEvent allows: the wait is already satisfied by the stream's order.
  for (bool deferred : {false, true}) {
    CAPTURE(deferred);
    Device device = make_sim(1 * MiB, deferred);
    for (const Stream& stream : {device.default_stream(), *device.create_stream()}) {
      std::vector<int> order;
      REQUIRE(device.enqueue_host_work(stream, [&] { order.push_back(1); }));
      auto event = device.create_event();
      REQUIRE(event);
      REQUIRE(event->record(stream));
      REQUIRE(event->make_wait(stream));
      REQUIRE(device.enqueue_host_work(stream, [&] { order.push_back(2); }));
      REQUIRE(stream.synchronize());
      CHECK(order == std::vector<int>{1, 2});
    }
  }
}

TEST_CASE("deferred streams that wait on each other's events in turn keep their order",
          "[device][sim]") {
  // A copy stream waits for the pool's stream, which later waits for the copy (the knn job's
  // uploads ahead): draining one drains the other from inside its own queued work.
  Device device = make_sim(1 * MiB, /*deferred=*/true);
  auto copies = device.create_stream();
  REQUIRE(copies);
  const Stream main = device.default_stream();
  std::vector<int> order;
  REQUIRE(device.enqueue_host_work(main, [&] { order.push_back(1); }));
  auto main_before = device.create_event();
  REQUIRE(main_before);
  REQUIRE(main_before->record(main));
  REQUIRE(main_before->make_wait(*copies));
  REQUIRE(device.enqueue_host_work(*copies, [&] { order.push_back(2); }));
  auto copied = device.create_event();
  REQUIRE(copied);
  REQUIRE(copied->record(*copies));
  REQUIRE(device.enqueue_host_work(main, [&] { order.push_back(3); }));
  REQUIRE(copied->make_wait(main));
  REQUIRE(device.enqueue_host_work(main, [&] { order.push_back(4); }));
  REQUIRE(main.synchronize());  // hung before: the copy stream drained main from main's own work
  CHECK(order == std::vector<int>{1, 3, 2, 4});
  REQUIRE(copies->synchronize());
}

TEST_CASE("an immediate stream runs work at once, an unrecorded event is complete", "[device][sim]") {
  Device device = make_sim();
  int ran = 0;
  REQUIRE(device.enqueue_host_work(device.default_stream(), [&] { ++ran; }));
  CHECK(ran == 1);
  auto event = device.create_event();
  REQUIRE(event);
  CHECK(*event->completed());
  REQUIRE(event->synchronize());
  Event empty;
  CHECK(empty.completed().error().kind() == ErrorKind::InvalidState);
  Stream none;
  CHECK(none.synchronize().error().kind() == ErrorKind::InvalidState);
}

TEST_CASE("fault injection: the Nth allocation fails once", "[device][sim][faults]") {
  Device device = make_sim(1 * MiB);
  REQUIRE(device.inject_faults({.fail_nth_allocation = 3}));
  std::vector<void*> held;
  for (int i = 1; i <= 5; ++i) {
    auto ptr = device.allocate(1024);
    if (i == 3) {
      REQUIRE_FALSE(ptr);
      CHECK(ptr.error().kind() == ErrorKind::OutOfMemory);
      CHECK_THAT(ptr.error().message(), Catch::Contains("injected fault"));
    } else {
      REQUIRE(ptr);
      held.push_back(*ptr);
    }
  }
  CHECK(device.memory_info()->free == 1 * MiB - 4 * 1024);
  for (void* p : held) REQUIRE(device.deallocate(p));
  CHECK(device.inject_faults({.fail_nth_allocation = 0}).error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("fault injection: allocations above a size fail", "[device][sim][faults]") {
  Device device = make_sim(1 * MiB);
  REQUIRE(device.inject_faults({.fail_above_bytes = 4096}));
  auto small = device.allocate(4096);
  REQUIRE(small);
  auto big = device.allocate(4097);
  REQUIRE_FALSE(big);
  CHECK(big.error().kind() == ErrorKind::OutOfMemory);
  REQUIRE(device.inject_faults({}));
  auto again = device.allocate(4097);
  REQUIRE(again);
  REQUIRE(device.deallocate(*small));
  REQUIRE(device.deallocate(*again));
}

TEST_CASE("capacity changes at run time", "[device][sim][faults]") {
  Device device = make_sim(1 * MiB);
  auto ptr = device.allocate(512 * KiB);
  REQUIRE(ptr);
  REQUIRE(device.set_simulated_capacity(256 * KiB));  // below what is in use
  CHECK(device.memory_info()->free == 0);
  CHECK(device.allocate(1).error().kind() == ErrorKind::OutOfMemory);
  REQUIRE(device.deallocate(*ptr));
  CHECK(device.memory_info()->free == 256 * KiB);
  CHECK(device.set_simulated_capacity(0).error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("pinned host memory round-trips and rejects foreign frees", "[device][sim]") {
  Device device = make_sim();
  auto pinned = device.allocate_pinned(4096);
  REQUIRE(pinned);
  std::memset(*pinned, 7, 4096);
  REQUIRE(device.deallocate_pinned(*pinned));
  CHECK(device.deallocate_pinned(*pinned).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.allocate_pinned(0).error().kind() == ErrorKind::InvalidInput);
}

namespace {
// Random allocations and frees (by index) on a device, each block filled with its own byte.
struct SimulatedAllocations {
  Device device;
  struct Block {
    void* ptr;
    std::size_t bytes;
    unsigned char fill;
  };
  std::vector<Block> live;

  // Allocates and fills; returns whether the device gave the memory.
  bool allocate(std::size_t bytes, unsigned char fill) {
    auto ptr = device.allocate(bytes);
    if (!ptr) {
      RC_ASSERT(ptr.error().kind() == ErrorKind::OutOfMemory);
      return false;
    }
    RC_ASSERT(reinterpret_cast<std::uintptr_t>(*ptr) % 256 == 0);
    for (const Block& other : live) {
      auto* a = static_cast<char*>(*ptr);
      auto* b = static_cast<char*>(other.ptr);
      RC_ASSERT(!(a < b + other.bytes && b < a + bytes));
    }
    std::memset(*ptr, fill, bytes);
    live.push_back({*ptr, bytes, fill});
    return true;
  }
  // Frees live[index] after checking its bytes are still its own.
  void free(std::size_t index) {
    Block block = live[index];
    const auto* bytes = static_cast<const unsigned char*>(block.ptr);
    for (std::size_t i = 0; i < block.bytes; ++i) RC_ASSERT(bytes[i] == block.fill);
    RC_ASSERT(device.deallocate(block.ptr).has_value());
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
  }
};
}  // namespace

TEST_CASE("a device with reserved memory allocates exactly as one on the heap", "[device][sim]") {
  rc::prop("same successes and figures, disjoint aligned blocks that keep their bytes", [] {
    constexpr std::size_t capacity = 64 * KiB;
    SimulatedAllocations heap{*Device::simulated({.capacity = capacity}), {}};
    SimulatedAllocations reserved{*Device::simulated({.capacity = capacity, .reserved_memory = true}), {}};
    auto steps = *rc::gen::container<std::vector<std::pair<bool, std::size_t>>>(
        rc::gen::pair(rc::gen::arbitrary<bool>(), rc::gen::inRange<std::size_t>(1, 24 * KiB)));
    unsigned char fill = 1;
    for (auto [allocate, operand] : steps) {
      if (allocate || heap.live.empty()) {
        ++fill;
        RC_ASSERT(heap.allocate(operand, fill) == reserved.allocate(operand, fill));
      } else {
        std::size_t index = operand % heap.live.size();
        heap.free(index);
        reserved.free(index);
      }
      RC_ASSERT(heap.device.memory_info()->free == reserved.device.memory_info()->free);
    }
    while (!reserved.live.empty()) reserved.free(0);
    RC_ASSERT(reserved.device.memory_info()->free == capacity);
  });
}

TEST_CASE("reserved memory falls back to the heap where its range has no room", "[device][sim]") {
  // The range is reserved for the capacity at creation: a capacity raised later goes past it.
  Device device = *Device::simulated({.capacity = 4 * KiB, .reserved_memory = true});
  REQUIRE(device.set_simulated_capacity(1 * MiB));
  auto large = device.allocate(512 * KiB);
  auto small = device.allocate(1 * KiB);
  REQUIRE(large);
  REQUIRE(small);
  std::vector<std::uint8_t> host(512 * KiB), back(512 * KiB);
  std::iota(host.begin(), host.end(), std::uint8_t{3});
  Stream stream = device.default_stream();
  REQUIRE(device.copy(*large, host.data(), host.size(), CopyKind::HostToDevice, stream));
  REQUIRE(device.copy(back.data(), *large, back.size(), CopyKind::DeviceToHost, stream));
  CHECK(back == host);
  CHECK(device.memory_info()->free == 1 * MiB - 513 * KiB);
  REQUIRE(device.deallocate(*large));
  CHECK(device.deallocate(*large).error().kind() == ErrorKind::InvalidInput);  // a double free
  REQUIRE(device.deallocate(*small));
  CHECK(device.memory_info()->free == 1 * MiB);
}

#if defined(__linux__)
TEST_CASE("a simulated device's kernels use the cores the process may run on, not the host's",
          "[device][sim]") {
  // An MPI launcher binds a process to one core: the device made under that mask must not start
  // a thread for every core of the host. The mask is a thread's own, so a thread bound to one
  // core stands for the bound process.
  int threads_under_one_core = 0;
  bool bound = false;
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
    bound = sched_setaffinity(0, sizeof one, &one) == 0;
    auto device = Device::simulated({.capacity = std::size_t{1} << 20});
    if (device) threads_under_one_core = device->properties().multiprocessor_count;
  }).join();
  REQUIRE(bound);
  CHECK(threads_under_one_core == 1);
  auto configured = Device::simulated({.capacity = std::size_t{1} << 20, .worker_threads = 3});
  REQUIRE(configured);
  CHECK(configured->properties().multiprocessor_count == 3);
}
#endif
