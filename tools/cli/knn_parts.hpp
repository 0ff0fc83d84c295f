// `gpupool knn` over several devices (and MPI processes): each device's part of the job as the
// summary shows it, carried between processes as JSON, and the job's totals over the parts.
//
// This header imports gpupool (through sharded_knn.hpp): include it after your other headers.
#pragma once
#include <cstddef>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include "sharded_knn.hpp"

namespace gpupool::cli {

// A device's part, and the process (MPI rank; 0 without MPI) it ran in.
struct DeviceReport {
  std::size_t rank = 0;
  exact::DevicePart part;
};

nlohmann::json pool_json(const PoolStats& stats);
nlohmann::json device_report_json(const DeviceReport& report);
// The inverse of device_report_json; InvalidInput for JSON it did not write.
Result<DeviceReport> device_report_from_json(const nlohmann::json& json);

// The job over every part: counts, chunks and retries summed; the stages' times summed over the
// devices (device-seconds); the pool's figures summed (each device's peaks, added); largest sizes
// the largest; `seconds` the job's wall time; non-finite distances counted in `merged`.
exact::JobSummary total_summary(std::span<const DeviceReport> reports, const exact::Neighbours& merged,
                                double seconds);

// One line per device: its rows, time, chunks, retries and pool figures.
void print_device_reports(std::span<const DeviceReport> reports, bool with_ranks);

}  // namespace gpupool::cli
