// Virtual memory of the CUDA backend on a real GPU: reserved address ranges, physical pages mapped
// into them and unmapped again. Tagged [gpu]: CTest skips these, tools/gpu-check.sh runs them on
// the GPU machine (`gpupool_tests "[gpu]"`). Without a GPU every one of them fails at once.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>
import gpupool;
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;
using gpupool::testing::random_bytes;

namespace {




// A reserved range, its pages unmapped and released and the range freed at scope exit, so a failed
// REQUIRE leaks nothing into the next test. `mapped` says which pages are mapped now.
struct Reservation {
  Device device;
  std::size_t page = 0;
  std::size_t pages = 0;
  std::byte* base = nullptr;
  std::vector<bool> mapped;
  std::vector<PhysicalPage> created;  // every page made through make_page, released at the end

  Reservation(Device d, std::size_t count)
      : device(std::move(d)), page(device.page_bytes()), pages(count), mapped(count, false) {
    auto reserved = device.reserve_addresses(count * page);
    if (!reserved) FAIL(reserved.error().to_string());
    base = static_cast<std::byte*>(*reserved);
  }
  ~Reservation() {
    (void)device.synchronize();
    for (std::size_t i = 0; i < pages; ++i)
      if (mapped[i]) (void)device.unmap_pages(at(i), 1);
    for (PhysicalPage p : created) device.release_page(p);
    device.release_addresses(base, pages * page);
  }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  std::byte* at(std::size_t index) const { return base + index * page; }
  PhysicalPage make_page() {
    auto p = device.create_page();
    if (!p) FAIL(p.error().to_string());
    created.push_back(*p);
    return *p;
  }
  void map(std::size_t first, std::span<const PhysicalPage> physical) {
    REQUIRE_OK(device.map_pages(at(first), physical));
    for (std::size_t i = 0; i < physical.size(); ++i) mapped[first + i] = true;
  }
  void unmap(std::size_t first, std::size_t count) {
    REQUIRE_OK(device.unmap_pages(at(first), count));
    for (std::size_t i = 0; i < count; ++i) mapped[first + i] = false;
  }
};

}  // namespace

TEST_CASE("cuda virtual memory: the page is a power of two, a range and a page can be made",
          "[gpu][cuda][virtual-memory]") {
  Device device = gpu();
  const std::size_t page = device.page_bytes();
  INFO("page_bytes " << page);
  REQUIRE(page > 0);
  CHECK((page & (page - 1)) == 0);
  CHECK(page % 4096 == 0);

  auto base = device.reserve_addresses(4 * page);
  REQUIRE(base);
  CHECK(*base != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(*base) % page == 0);
  auto physical = device.create_page();
  REQUIRE(physical);
  device.release_page(*physical);
  device.release_addresses(*base, 4 * page);
}

TEST_CASE("cuda virtual memory: mapped pages are device memory across page boundaries, "
          "a page is replaced without touching its neighbours",
          "[gpu][cuda][virtual-memory]") {
  Device device = gpu();
  REQUIRE(device.page_bytes() > 0);
  auto stream = device.create_stream();
  REQUIRE(stream);
  Reservation range(device, 8);
  const std::size_t page = range.page;

  std::vector<PhysicalPage> first_three{range.make_page(), range.make_page(), range.make_page()};
  range.map(0, first_three);

  // Three pages' worth of data in one copy, so every copy below crosses page boundaries.
  const std::size_t n = 3 * page;
  std::vector<std::uint8_t> data = random_bytes(n);
  REQUIRE_OK(device.copy(range.at(0), data.data(), n, CopyKind::HostToDevice, *stream));
  // A fill straddling the boundary of pages 0 and 1 and another of pages 1 and 2.
  const std::size_t fill_a = page - 1000, fill_a_bytes = 3000;
  const std::size_t fill_b = 2 * page - 7, fill_b_bytes = 14;
  REQUIRE_OK(device.fill(range.at(0) + fill_a, 0x5A, fill_a_bytes, *stream));
  REQUIRE_OK(device.fill(range.at(0) + fill_b, 0xC3, fill_b_bytes, *stream));
  std::vector<std::uint8_t> expected = data;
  std::memset(expected.data() + fill_a, 0x5A, fill_a_bytes);
  std::memset(expected.data() + fill_b, 0xC3, fill_b_bytes);

  std::vector<std::uint8_t> back(n, 0);
  REQUIRE_OK(device.copy(back.data(), range.at(0), n, CopyKind::DeviceToHost, *stream));
  REQUIRE_OK(stream->synchronize());
  CHECK(back == expected);

  // Device to device across the mapping: an ordinary allocation and back, at odd offsets.
  auto plain = device.allocate(n);
  REQUIRE(plain);
  REQUIRE_OK(device.copy(*plain, range.at(0), n, CopyKind::DeviceToDevice, *stream));
  REQUIRE_OK(device.copy(range.at(0) + page / 2 + 1, static_cast<std::byte*>(*plain) + 3, page,
                         CopyKind::DeviceToDevice, *stream));
  std::memmove(expected.data() + page / 2 + 1, expected.data() + 3, page);
  std::vector<std::uint8_t> moved(n, 0);
  REQUIRE_OK(device.copy(moved.data(), range.at(0), n, CopyKind::DeviceToHost, *stream));
  REQUIRE_OK(stream->synchronize());
  REQUIRE_OK(device.deallocate(*plain));
  CHECK(moved == expected);

  // Page 1 out, a new page in: pages 0 and 2 keep their bytes, page 1 takes new ones.
  range.unmap(1, 1);
  PhysicalPage replacement = range.make_page();
  range.map(1, std::span<const PhysicalPage>(&replacement, 1));
  std::vector<std::uint8_t> fresh = random_bytes(page);
  REQUIRE_OK(device.copy(range.at(1), fresh.data(), page, CopyKind::HostToDevice, *stream));
  std::memcpy(expected.data() + page, fresh.data(), page);
  std::vector<std::uint8_t> after(n, 0);
  REQUIRE_OK(device.copy(after.data(), range.at(0), n, CopyKind::DeviceToHost, *stream));
  REQUIRE_OK(stream->synchronize());
  CHECK(std::memcmp(after.data(), expected.data(), page) == 0);                    // page 0
  CHECK(std::memcmp(after.data() + page, fresh.data(), page) == 0);                // page 1
  CHECK(std::memcmp(after.data() + 2 * page, expected.data() + 2 * page, page) == 0);  // page 2

  // Everything back: all three mapped pages in one call, then the pages, then the range.
  range.unmap(0, 3);
}

TEST_CASE("cuda virtual memory: bad arguments are InvalidInput, driver failures keep the "
          "driver status", "[gpu][cuda][virtual-memory]") {
  Device device = gpu();
  const std::size_t page = device.page_bytes();
  REQUIRE(page > 0);

  CHECK(device.reserve_addresses(0).error().kind() == ErrorKind::InvalidInput);
  auto odd = device.reserve_addresses(page + 4096);
  REQUIRE_FALSE(odd);
  CHECK(odd.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(odd.error().message(), Catch::Contains("multiple of the page"));

  Reservation range(device, 4);
  PhysicalPage physical = range.make_page();
  std::span<const PhysicalPage> one(&physical, 1);

  auto misaligned = device.map_pages(range.at(1) + 4096, one);
  REQUIRE_FALSE(misaligned);
  CHECK(misaligned.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(misaligned.error().message(), Catch::Contains("page boundary"));
  CHECK(device.map_pages(nullptr, one).error().kind() == ErrorKind::InvalidInput);
  auto none = device.map_pages(range.at(0), std::span<const PhysicalPage>{});
  REQUIRE_FALSE(none);
  CHECK(none.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(none.error().message(), Catch::Contains("at least one page"));
  CHECK(device.unmap_pages(range.at(0), 0).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.unmap_pages(range.at(0) + 1, 1).error().kind() == ErrorKind::InvalidInput);

  // A page mapped where no range was reserved reaches the driver, whose refusal keeps its
  // CUresult.
  auto* unreserved = static_cast<std::byte*>(range.at(0)) + 1024 * page;
  auto refused = device.map_pages(unreserved, one);
  REQUIRE_FALSE(refused);
  INFO(refused.error().to_string());
  CHECK_FALSE(refused.error().is_out_of_memory());
  REQUIRE(refused.error().native_status());
  CHECK(refused.error().native_status()->source == StatusSource::CudaDriver);
  CHECK_THAT(refused.error().message(), Catch::Contains("CUDA_ERROR_"));
  CHECK_THAT(refused.error().to_string(), Catch::Contains("CUDA driver status"));

  // The device goes on working.
  range.map(0, one);
  std::vector<std::uint8_t> data = random_bytes(4096), back(4096, 0);
  REQUIRE_OK(device.copy(range.at(0), data.data(), 4096, CopyKind::HostToDevice,
                         device.default_stream()));
  REQUIRE_OK(device.copy(back.data(), range.at(0), 4096, CopyKind::DeviceToHost,
                         device.default_stream()));
  REQUIRE_OK(device.synchronize());
  CHECK(back == data);
}
