// gpupool::exact — the exact-kNN job over several devices at once, and the merge of lists that
// makes their result the one-device result bit for bit.
//
// The base's rows are split into contiguous shares, one per device (split_rows); each device runs
// the one-device job (run_exact_knn) over its share on a thread of its own, with its own reader,
// pinned blocks and pool, and folds its own running lists. The lists are then merged by the value
// they were ranked by, then the smaller row (merge_neighbours) — the order of the one-device lists,
// which hold the k best rows of the whole base by that order. So the merge gives the same ids and
// distances when every row's value is the same in both runs:
//   * exact mode: a row's value is its fp64 distance, whatever chunk or device computed it;
//   * fast mode: a row's device distance is computed in its base block's arithmetic (the scaling
//     is chosen per block from the block's largest value), so shares are cut at the one-device
//     job's block boundaries and every device reads blocks of the one-device job's size. What is
//     left is the chunk a row is computed in: the simulated device's distance of a row does not
//     depend on it; a CUDA kernel may choose another method for another chunk width (as it may
//     for another memory limit on one device), and then the fast mode's last bits may differ.
// A device that fails stops the others at their next chunk; the job returns the first error.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <vector>
#include "exact_knn.hpp"
import gpupool;

namespace gpupool::exact {

// Rows [first_row, first_row + rows) of the base file.
struct RowShare {
  std::size_t first_row = 0;
  std::size_t rows = 0;
};

// `range` in `parts` contiguous shares in order (some empty where there are too few rows), as
// even as `alignment` allows: every cut inside the range lies on a multiple of `alignment`
// counted from row 0 of the file. A share of fewer than `min_rows` rows is joined to its
// neighbour (each device's list then holds min_rows = k rows), unless the range itself is smaller.
std::vector<RowShare> split_rows(RowShare range, std::size_t parts, std::size_t alignment,
                                 std::size_t min_rows);

// The rows every device's job reads as one block (the one-device job's block over the whole
// file), and the alignment shares need: that block in the fast mode, 1 in the exact mode.
std::size_t job_block_rows(std::size_t file_rows, const JobOptions& options) noexcept;
std::size_t share_alignment(std::size_t file_rows, const JobOptions& options) noexcept;

// One share's lists: ids counted from `first_row` (its share's first row).
struct ShareLists {
  const Neighbours* lists = nullptr;
  std::size_t first_row = 0;
};

// The shares' lists merged per query by (ranking value, base row): distances_fp64 in the exact
// mode, ranked_distances in the fast mode; ids become base rows of the file. Every share's lists
// must have the same queries and k (InvalidInput otherwise). integer_distances holds when it
// holds for every share; beyond_fp32 names the merged result's first entry beyond fp32's range.
Result<Neighbours> merge_neighbours(std::span<const ShareLists> shares, bool fast);

// A device of the job and the pool it allocates from.
struct DeviceSlot {
  GpuMemoryPool pool;  // a handle: copies share the pool
  Device device;
};

// One device's part of a job.
struct DevicePart {
  std::string device;   // as Device::describe() names it
  RowShare share;       // rows of the file (empty: the device had none)
  JobSummary summary;   // its own job's summary (defaults where the share was empty)
};

struct ShardedResult {
  Neighbours neighbours;           // ids are rows of the file
  std::vector<DevicePart> parts;   // one per slot, in order
  double seconds = 0;              // wall time, from the start to the merged lists
  double merging_seconds = 0;      // the merge of the devices' lists
};

// Runs the job over `range` (default: the whole file) of the base file at `base`, split over
// `slots`: slot i takes share i of split_rows(range, slots, share_alignment, k). `on_progress`
// gets (slot, that slot's job progress), from the slots' threads (one call at a time per slot).
// A share that does not start at row 0 of a gzip file is reached by inflating the rows before
// it. Errors name the device and its share; the first failure stops the other devices.
Result<ShardedResult> run_sharded_knn(
    std::span<const DeviceSlot> slots, const VectorSet& queries, const std::filesystem::path& base,
    const JobOptions& options, std::optional<RowShare> range = std::nullopt,
    std::function<void(std::size_t slot, const Progress&)> on_progress = {});

}  // namespace gpupool::exact
