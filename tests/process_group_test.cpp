// The process group of a build without MPI (tools/cli/process_group_absent.cpp, linked into the
// tests whatever the build): it refuses to join an MPI job, saying how to get one, and a
// launcher's environment is recognised without any MPI library.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <string>
#include "process_group.hpp"

using namespace gpupool;
using Catch::Matchers::Contains;

TEST_CASE("a build without MPI refuses to join an MPI job, saying how to build with it", "[cli][mpi-absent]") {
  CHECK_FALSE(cli::built_with_mpi());
  auto joined = cli::ProcessGroup::join();
  REQUIRE_FALSE(joined);
  CHECK(joined.error().kind() == ErrorKind::DeviceUnavailable);
  CHECK_THAT(joined.error().to_string(),
             Contains("built without MPI") && Contains("libopenmpi-dev") && Contains("--devices"));
}

TEST_CASE("a launcher's environment is recognised without MPI", "[cli][mpi-absent]") {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    CAPTURE(name);
    const char* before = std::getenv(name);
    const std::string kept = before ? before : "";
    ::unsetenv(name);
    const bool others_set = cli::launched_by_mpi();  // another of the variables, if CTest runs under a launcher
    ::setenv(name, "2", 1);
    CHECK(cli::launched_by_mpi());
    if (before) ::setenv(name, kept.c_str(), 1);
    else ::unsetenv(name);
    if (!others_set && !before) CHECK_FALSE(cli::launched_by_mpi());
  }
}
