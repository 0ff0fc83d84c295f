// The process group of a build without MPI: a launcher's environment is still recognised, so that
// `mpirun -np N gpupool knn` does not run N copies of the whole job writing the same files.
#include <memory>
#include "process_group.hpp"

namespace gpupool::cli {

bool built_with_mpi() noexcept { return false; }

Result<std::unique_ptr<ProcessGroup>> ProcessGroup::join() {
  return make_error(ErrorKind::DeviceUnavailable,
                    "this gpupool was built without MPI, so it cannot run as one of several MPI "
                    "processes: install an MPI (Debian: libopenmpi-dev openmpi-bin, which "
                    "tools/setup.sh installs) and configure the build again (CMake finds it with "
                    "find_package(MPI)); or run gpupool without mpirun, with --devices for "
                    "several devices of this host");
}

}  // namespace gpupool::cli
