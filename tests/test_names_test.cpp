// CTest runs each test case of gpupool_tests by name (catch_discover_tests reads the names back as
// a CMake list). A square bracket in a name opens a CMake bracket group: every name after it up to
// a closing bracket becomes one list element, a "test" that matches no case and so runs nothing;
// a semicolon separates list elements, cutting the name in two pieces that match no case either.
// This keeps every name discoverable (and tests/CMakeLists.txt makes a name that matches no case
// fail rather than pass with nothing run).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

TEST_CASE("every test name reaches CTest intact: no square brackets, no semicolons", "[tests]") {
  const auto& config = *Catch::getCurrentContext().getConfig();
  std::vector<std::string> bad;
  for (const Catch::TestCase& test : Catch::getAllTestCasesSorted(config))
    if (test.name.find_first_of("[];") != std::string::npos) bad.push_back(test.name);
  INFO("first offending name: " << (bad.empty() ? std::string() : bad.front()));
  CHECK(bad.empty());
}
