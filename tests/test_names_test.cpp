// CTest runs each test case of gpupool_tests by name (catch_discover_tests reads the names back as
// a CMake list). A square bracket in a name opens a CMake bracket group: every name after it up to
// a closing bracket becomes one list element, a "test" that matches no case and so runs nothing.
// This keeps every name discoverable.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

TEST_CASE("every test name reaches CTest intact: no square brackets", "[tests]") {
  const auto& config = *Catch::getCurrentContext().getConfig();
  std::vector<std::string> bad;
  for (const Catch::TestCase& test : Catch::getAllTestCasesSorted(config))
    if (test.name.find_first_of("[]") != std::string::npos) bad.push_back(test.name);
  INFO("first offending name: " << (bad.empty() ? std::string() : bad.front()));
  CHECK(bad.empty());
}
