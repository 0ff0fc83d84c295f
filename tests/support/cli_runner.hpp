// Test support: runs shell commands and the built `gpupool` command (GPUPOOL_CLI_PATH), capturing
// their output and exit status. Include after <catch2/catch.hpp>, where GPUPOOL_CLI_PATH is defined.
#pragma once
#include <array>
#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace gpupool::testing {

struct Outcome {
  int status = -1;
  std::string output;  // stdout, and stderr where asked for
};

// Runs `command` through the shell.
inline Outcome shell(const std::string& command, bool with_stderr = true) {
  Outcome outcome;
  FILE* pipe = ::popen((command + (with_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buffer{};
  while (std::size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe))
    outcome.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  outcome.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return outcome;
}

// Runs `gpupool ARGS`; `environment` ("NAME=value ...") is set for the command only.
inline Outcome gpupool_cli(const std::string& args, bool with_stderr = true,
                           const std::string& environment = "") {
  return shell(environment + " " + std::string(GPUPOOL_CLI_PATH) + " " + args, with_stderr);
}

}  // namespace gpupool::testing
