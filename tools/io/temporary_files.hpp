// Temporary files removed on SIGINT and SIGTERM (see FileGroup in vector_io.hpp): the writers
// register each temporary file while it exists; a handler, installed with the first, unlinks the
// registered ones and lets the signal do what it would have done.
//
// Internal to gpupool::io.
#pragma once
#include <filesystem>

namespace gpupool::io::detail {

// The slot `path` now holds, or -1 where none is free (or the path is too long to keep).
int register_temporary(const std::filesystem::path& path) noexcept;
// Forgets the slot (the file was renamed or removed); -1 is ignored.
void forget_temporary(int slot) noexcept;
// What the signal handler does before the signal goes on: unlinks every registered file.
void remove_registered_temporaries() noexcept;

}  // namespace gpupool::io::detail
