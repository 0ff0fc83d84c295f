#include <catch2/catch.hpp>
#include <optional>
#include <set>
#include <string>
import gpupool;

using namespace gpupool;

TEST_CASE("every ErrorKind has its own readable name", "[error]") {
  std::set<std::string> names;
  for (ErrorKind kind : kAllErrorKinds) {
    std::string name{to_string(kind)};
    CHECK_FALSE(name.empty());
    CHECK(name != "unknown error");
    names.insert(name);
  }
  CHECK(names.size() == std::size(kAllErrorKinds));
}

TEST_CASE("GpuError keeps kind, message, device and native status", "[error]") {
  for (ErrorKind kind : kAllErrorKinds) {
    GpuError error(kind, "what went wrong", 3, NativeStatus{StatusSource::Cuda, 2});
    CHECK(error.kind() == kind);
    CHECK(error.message() == "what went wrong");
    REQUIRE(error.device());
    CHECK(*error.device() == 3);
    REQUIRE(error.native_status());
    CHECK(error.native_status()->code == 2);
    std::string text = error.to_string();
    CHECK(text.starts_with(std::string(to_string(kind)) + " on device 3: what went wrong"));
    CHECK(text.ends_with("(CUDA status 2)"));
  }
}

TEST_CASE("out-of-memory is recognised by kind, never by text", "[error]") {
  CHECK(GpuError(ErrorKind::OutOfMemory, "x").is_out_of_memory());
  CHECK(GpuError(ErrorKind::PoolLimitExceeded, "x").is_out_of_memory());
  // A message that merely talks about memory is not an out-of-memory error.
  CHECK_FALSE(GpuError(ErrorKind::Cuda, "out of memory").is_out_of_memory());
  CHECK_FALSE(GpuError(ErrorKind::InvalidInput, "CUDA out of memory").is_out_of_memory());
}

TEST_CASE("errors without device or status print without them, context is prefixed", "[error]") {
  GpuError error(ErrorKind::InvalidInput, "k is 0: expected 1..1024");
  CHECK(error.to_string() == "invalid input: k is 0: expected 1..1024");
  CHECK(error.with_context("knn").to_string() == "invalid input: knn: k is 0: expected 1..1024");
  GpuError cublas(ErrorKind::Cublas, "gemm failed", std::nullopt,
                  NativeStatus{StatusSource::Cublas, 13});
  CHECK(cublas.to_string() == "cuBLAS error: gemm failed (cuBLAS status 13)");
}

TEST_CASE("make_error builds an unexpected Result", "[error]") {
  Result<int> result = make_error(ErrorKind::Unsupported, "no int4", 7);
  REQUIRE_FALSE(result);
  CHECK(result.error().kind() == ErrorKind::Unsupported);
  CHECK(result.error().device() == 7);
}
