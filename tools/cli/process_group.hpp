// The processes of an MPI job (`mpirun -np N gpupool knn ...`), behind an interface that the
// build without MPI implements too: process_group_mpi.cpp over Open MPI where CMake found MPI,
// process_group_absent.cpp (which refuses to join, saying why) otherwise.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>
import gpupool;

namespace gpupool::cli {

// Whether an MPI launcher started this process (mpirun / srun set these variables for every
// process they start); needs no MPI library.
inline bool launched_by_mpi() noexcept {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}
// Whether this build has MPI.
bool built_with_mpi() noexcept;

class ProcessGroup {
 public:
  // Joins the job's processes (MPI_Init). DeviceUnavailable where this build has no MPI, saying
  // how to build with it; Internal where MPI fails to start. Call once per process.
  static Result<std::unique_ptr<ProcessGroup>> join();
  virtual ~ProcessGroup() = default;

  virtual std::size_t rank() const noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
  // This process's place among the job's processes on its host, and how many there are
  // (OMPI_COMM_WORLD_LOCAL_RANK / _SIZE; rank and size where the launcher does not say).
  virtual std::size_t local_rank() const noexcept = 0;
  virtual std::size_t local_size() const noexcept = 0;

  // Every process sends `bytes`; rank 0 gets every process's, in rank order (the others get
  // nothing). Collective. Io when a process's bytes pass 2^31 - 1 (MPI's counts are int).
  virtual Result<std::vector<std::vector<std::byte>>> gather_to_root(std::span<const std::byte> bytes) = 0;
  // Rank 0's `status` on every process. Collective.
  virtual int broadcast_from_root(int status) = 0;
  // Ends every process of the job with `status` (MPI_Abort): the way out of an error on one
  // process that the others would otherwise wait for in a collective.
  [[noreturn]] virtual void abort_all(int status) = 0;

 protected:
  ProcessGroup() = default;
};

}  // namespace gpupool::cli
