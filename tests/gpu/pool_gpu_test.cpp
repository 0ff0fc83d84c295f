// The pool on a real GPU: stream-ordered reuse, segments (device and virtual), the OOM ladder's
// typed error and the pinned staging pool. Tagged [gpu]: tools/gpu-check.sh runs them on the GPU machine.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>
import gpupool;
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;

namespace {
std::vector<std::byte> random_bytes(std::size_t n) {
  static std::mt19937_64 engine{std::random_device{}()};
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = std::byte{static_cast<unsigned char>(engine() % 255 + 1)};  // never 0
  return bytes;
}
}  // namespace

TEST_CASE("GPU pool: a block freed on a stream is reused at once only on that stream", "[gpu][pool]") {
  Device device = gpu();
  GpuMemoryPool pool;
  auto s1 = device.create_stream();
  auto s2 = device.create_stream();
  REQUIRE(s1);
  REQUIRE(s2);
  for (std::size_t bytes : {std::size_t{4096}, std::size_t{3} << 20}) {  // a class block, a segment block
    void* first = nullptr;
    {
      auto a = pool.get_managed_buffer(device, bytes, Precision::Bytes, *s1);
      REQUIRE(a);
      first = a->raw_data();
    }
    auto on_s2 = pool.get_managed_buffer(device, bytes, Precision::Bytes, *s2);
    REQUIRE(on_s2);
    CHECK(on_s2->raw_data() != first);
    auto on_s1 = pool.get_managed_buffer(device, bytes, Precision::Bytes, *s1);
    REQUIRE(on_s1);
    CHECK(on_s1->raw_data() == first);
  }
}

TEST_CASE("GPU pool: record_stream keeps a block aside until the other stream is done", "[gpu][pool]") {
  Device device = gpu();
  GpuMemoryPool pool;
  auto s1 = device.create_stream();
  auto s2 = device.create_stream();
  REQUIRE(s1);
  REQUIRE(s2);
  auto data = random_bytes(8 << 20);
  auto buffer = pool.get_managed_buffer(device, data.size(), Precision::Bytes, *s1);
  REQUIRE(buffer);
  REQUIRE(buffer->upload(data));
  std::vector<std::byte> back(data.size(), std::byte{0});
  // s2 reads the buffer asynchronously; the buffer is released before that read is waited for.
  REQUIRE(device.copy(back.data(), buffer->raw_data(), back.size(), CopyKind::DeviceToHost, *s2));
  REQUIRE(buffer->record_stream(*s2));
  REQUIRE(buffer->release());
  auto overwrite = pool.get_managed_buffer(device, data.size(), Precision::Bytes, *s1);
  REQUIRE(overwrite);
  REQUIRE(overwrite->fill_zero());
  REQUIRE(s2->synchronize());
  CHECK(back == data);  // the read on s2 saw the data, not the zeros of a reused block
  overwrite = ManagedBuffer();
  pool.emergency_cleanup_all();
  CHECK(pool.stats(device).reserved_bytes == 0);
}

TEST_CASE("GPU pool: an impossible request is a typed OutOfMemory with the figures", "[gpu][pool]") {
  Device device = gpu();
  GpuMemoryPool pool;
  auto memory = device.memory_info();
  REQUIRE(memory);
  auto huge = pool.get_managed_buffer(device, 2 * memory->total, Precision::Bytes);
  REQUIRE_FALSE(huge);
  CHECK(huge.error().kind() == ErrorKind::OutOfMemory);
  CHECK(huge.error().device().value_or(-1) == device.id());
  CHECK_THAT(huge.error().message(), Catch::Contains("device free") && Catch::Contains("largest cached block"));
  auto fine = pool.get_managed_buffer(device, 1 << 20, Precision::Fp32);
  CHECK(fine);
}

TEST_CASE("GPU pool: staged uploads and downloads through pinned memory round-trip", "[gpu][staging]") {
  Device device = gpu();
  GpuMemoryPool pool;
  auto staging = PinnedStagingPool::create(device, 1 << 20);
  REQUIRE(staging);
  auto data = random_bytes((48 << 20) + 777);
  auto buffer = pool.get_managed_buffer(device, data.size() + 64, Precision::Bytes);
  REQUIRE(buffer);
  REQUIRE(upload_staged(*staging, *buffer, data, 64));
  std::vector<std::byte> back(data.size(), std::byte{0});
  REQUIRE(download_staged(*staging, *buffer, back, 64, 4 << 20));
  CHECK(back == data);
  CHECK(staging->reserved_bytes() >= (4 << 20));
  CHECK(staging->release_unused());
}

TEST_CASE("GPU pool: virtual segments back blocks with pages and give back the pages between them",
          "[gpu][pool][virtual]") {
  Device device = gpu();
  const std::size_t page = device.page_bytes();
  REQUIRE(page > 0);
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true, .thread_caches = false});
  auto stream = device.create_stream();
  REQUIRE(stream);
  // Sizes that are no multiple of the page, so blocks share pages at their ends.
  const std::size_t sizes[] = {5 * page + 4096, 3 * page + 12288, 2 * page + 65536 + 256};
  std::vector<ManagedBuffer> buffers;
  std::vector<std::vector<std::byte>> data;
  for (std::size_t bytes : sizes) {
    auto buffer = pool.get_managed_buffer(device, bytes, Precision::Bytes, *stream);
    REQUIRE(buffer);
    data.push_back(random_bytes(bytes));
    REQUIRE_OK(buffer->upload(std::span<const std::byte>(data.back())));
    buffers.push_back(std::move(*buffer));
  }
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes % page == 0);
  CHECK(s.reserved_bytes >= s.in_use_bytes);
  CHECK(s.reserved_bytes <= s.in_use_bytes + 2 * page);  // at most the blocks' partial pages
  // The middle block goes; a cleanup unmaps its whole pages while its neighbours live on.
  buffers[1] = ManagedBuffer{};
  const std::size_t released = pool.emergency_cleanup(device);
  CHECK(released >= 2 * page);
  CHECK(pool.stats(device).reserved_bytes == s.reserved_bytes - released);
  for (std::size_t i : {std::size_t{0}, std::size_t{2}}) {
    auto back = buffers[i].to_host<std::byte>();
    REQUIRE(back);
    CHECK(*back == data[i]);  // the neighbours' bytes, on pages next to the unmapped ones
  }
  // A block larger than the hole takes new pages; its data round-trips.
  auto big = pool.get_managed_buffer(device, 7 * page, Precision::Bytes, *stream);
  REQUIRE(big);
  auto big_data = random_bytes(7 * page);
  REQUIRE_OK(big->upload(std::span<const std::byte>(big_data)));
  auto big_back = big->to_host<std::byte>();
  REQUIRE(big_back);
  CHECK(*big_back == big_data);
  buffers.clear();
  *big = ManagedBuffer{};
  pool.emergency_cleanup(device);
  CHECK(pool.stats(device).reserved_bytes == 0);
}
