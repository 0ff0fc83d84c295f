// The process group over MPI (see process_group.hpp). Only the command's main thread calls MPI,
// so MPI_Init's default thread level is enough.
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <fmt/format.h>
#include <memory>
#include <mpi.h>
#include <string>
#include <vector>
#include "process_group.hpp"

namespace gpupool::cli {

namespace {

std::size_t environment_number(const char* name, std::size_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  return *end == '\0' ? static_cast<std::size_t>(value) : fallback;
}

class MpiProcessGroup final : public ProcessGroup {
 public:
  MpiProcessGroup(int rank, int size)
      : rank_(static_cast<std::size_t>(rank)), size_(static_cast<std::size_t>(size)),
        local_rank_(environment_number("OMPI_COMM_WORLD_LOCAL_RANK", rank_)),
        local_size_(environment_number("OMPI_COMM_WORLD_LOCAL_SIZE", size_)) {}
  ~MpiProcessGroup() override { MPI_Finalize(); }

  std::size_t rank() const noexcept override { return rank_; }
  std::size_t size() const noexcept override { return size_; }
  std::size_t local_rank() const noexcept override { return local_rank_; }
  std::size_t local_size() const noexcept override { return local_size_; }

  Result<std::vector<std::vector<std::byte>>> gather_to_root(std::span<const std::byte> bytes) override {
    // Every process takes part in both collectives, even one whose bytes are too many: it sends
    // a count of -1 first, so that no process is left waiting in the second.
    const int count = bytes.size() > static_cast<std::size_t>(INT_MAX) ? -1 : static_cast<int>(bytes.size());
    std::vector<int> counts(rank_ == 0 ? size_ : 0);
    MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    int too_large = count < 0 ? 1 : 0;
    if (rank_ == 0)
      for (int c : counts) too_large |= c < 0 ? 1 : 0;
    MPI_Bcast(&too_large, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (too_large)
      return make_error(ErrorKind::Io,
                        "a process's lists pass 2^31 - 1 bytes, more than one MPI message "
                        "carries: use fewer queries per job (split the query file)");
    std::vector<int> offsets(counts.size());
    std::size_t total = 0;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      if (total > static_cast<std::size_t>(INT_MAX) - static_cast<std::size_t>(counts[i]))
        too_large = 1;
      offsets[i] = static_cast<int>(total);
      total += static_cast<std::size_t>(counts[i]);
    }
    MPI_Bcast(&too_large, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (too_large)
      return make_error(ErrorKind::Io,
                        "the processes' lists together pass 2^31 - 1 bytes, more than one MPI "
                        "gather carries: use fewer queries per job (split the query file)");
    std::vector<std::byte> all(total);
    MPI_Gatherv(bytes.data(), count, MPI_BYTE, all.data(), counts.data(), offsets.data(),
                MPI_BYTE, 0, MPI_COMM_WORLD);
    std::vector<std::vector<std::byte>> out;
    for (std::size_t i = 0; i < counts.size(); ++i)
      out.emplace_back(all.begin() + offsets[i], all.begin() + offsets[i] + counts[i]);
    return out;
  }

  int broadcast_from_root(int status) override {
    MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return status;
  }

  [[noreturn]] void abort_all(int status) override {
    MPI_Abort(MPI_COMM_WORLD, status);
    std::_Exit(status);  // MPI_Abort does not return; should it, this process still ends
  }

 private:
  std::size_t rank_, size_, local_rank_, local_size_;
};

}  // namespace

bool built_with_mpi() noexcept { return true; }

Result<std::unique_ptr<ProcessGroup>> ProcessGroup::join() {
  if (MPI_Init(nullptr, nullptr) != MPI_SUCCESS)
    return make_error(ErrorKind::Internal, "MPI_Init failed: MPI could not start this process");
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<ProcessGroup>(new MpiProcessGroup(rank, size));
}

}  // namespace gpupool::cli
