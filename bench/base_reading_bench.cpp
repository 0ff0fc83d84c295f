// base_reading_bench: how fast `gpupool knn` reads its base file — one pass of the job's reader
// (BaseBlocks: blocks of the job's size, each read in parallel pieces, float rows scanned for the
// job's arithmetic) — beside plain parallel reads of the same file: into a reused 8 MiB buffer a
// thread (the pace of the page cache, or the disk, with the bytes landing in the core's cache),
// and into memory as large as the job's blocks (the same reads, with every byte written to
// memory as the job's blocks must be: the floor the job's reading is measured against).
//
//   base_reading_bench --base FILE [--parts 1,4,16] [--reps 3] [--device cuda:0] [--json FILE]
//   base_reading_bench --rows N [--dim 128] [--base FILE] ...
//       (writes a .fvecs of N random rows first: to FILE, kept, or to a temporary file)
//
// With --device the blocks are pinned by that device, as the job's are; without, they are
// ordinary memory. Each figure is the median of --reps passes after one pass that warms the page
// cache and the blocks.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "base_stream.hpp"
#include "parallel.hpp"
#include "job_sizing.hpp"
#include "vector_io.hpp"
import gpupool;

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// `parts` threads, each reading its 1/parts of the file in 8 MiB reads: into one 8 MiB buffer of
// its own when `memory` is empty, else into its 1/parts of `memory`, from its start again when
// the reads reach its end.
std::optional<double> plain_read_seconds(const fs::path& file, std::uintmax_t size, std::size_t parts,
                                         std::span<char> memory = {}) {
  constexpr std::size_t kRead = std::size_t{8} << 20;
  std::vector<std::thread> threads;
  std::vector<char> failed(parts, 0);
  const auto start = Clock::now();
  for (std::size_t p = 0; p < parts; ++p)
    threads.emplace_back([&, p] {
      const int fd = ::open(file.c_str(), O_RDONLY);
      if (fd < 0) return void(failed[p] = 1);
      std::vector<char> buffer(memory.empty() ? kRead : 0);
      const std::span<char> mine =
          memory.empty() ? std::span<char>(buffer)
                         : memory.subspan(memory.size() * p / parts,
                                          memory.size() * (p + 1) / parts - memory.size() * p / parts);
      std::uintmax_t at = size * p / parts;
      const std::uintmax_t end = size * (p + 1) / parts;
      std::size_t into = 0;
      while (at < end) {
        if (mine.size() - into < kRead) into = 0;
        const std::size_t want = std::min<std::uintmax_t>({kRead, end - at, mine.size()});
        const ssize_t got = ::pread(fd, mine.data() + into, want, static_cast<off_t>(at));
        if (got <= 0) {
          failed[p] = 1;
          break;
        }
        at += static_cast<std::uintmax_t>(got);
        into += static_cast<std::size_t>(got);
      }
      ::close(fd);
    });
  for (auto& t : threads) t.join();
  if (std::ranges::any_of(failed, [](char f) { return f != 0; })) return std::nullopt;
  return seconds_since(start);
}

struct PassFigures {
  double seconds = 0;
  std::uint64_t bytes = 0;
};

// Bytes a row of `reader`'s file takes in the job's blocks, and the rows of one block (the job's
// chunk cap when nothing else caps it).
std::uint64_t block_row_bytes(const gpupool::io::VectorReader& reader) {
  return reader.dim() * gpupool::stored_size(gpupool::exact::stored_element(reader.element_type()));
}
std::size_t job_block_rows(const gpupool::io::VectorReader& reader) {
  return gpupool::exact::chunk_cap(reader.rows(), std::numeric_limits<std::size_t>::max());
}

// One pass of the job's reader over the whole file.
gpupool::Result<PassFigures> job_read(const fs::path& file, std::size_t parts,
                                      const std::shared_ptr<gpupool::exact::BlockRecycler>& recycler) {
  auto reader = gpupool::io::VectorReader::open(file);
  if (!reader) return std::unexpected(reader.error());
  const std::size_t rows = reader->rows();
  const std::size_t block_rows = job_block_rows(*reader);
  const std::uint64_t expected = rows * block_row_bytes(*reader);
  const auto start = Clock::now();
  gpupool::exact::BaseBlocks blocks(*reader, rows, block_rows, recycler, parts);
  std::size_t rows_seen = 0;
  for (;;) {
    auto block = blocks.next();
    if (!block) return std::unexpected(block.error());
    if (!*block) break;
    rows_seen += (*block)->rows.rows;
  }
  const double seconds = seconds_since(start);
  if (rows_seen != rows || blocks.bytes_read() != expected)
    return gpupool::make_error(gpupool::ErrorKind::Internal,
                               fmt::format("{}: the job's reader handed out {} of {} rows ({} of {} "
                                           "bytes)", file.string(), rows_seen, rows,
                                           blocks.bytes_read(), expected));
  return PassFigures{seconds, blocks.bytes_read()};
}

double median(std::vector<double> v) {
  std::ranges::sort(v);
  return v[v.size() / 2];
}

// A .fvecs of `rows` random rows in ±[0.05, 1] (never zeros), written in pieces.
gpupool::Result<void> write_random_base(const fs::path& file, std::size_t rows, std::size_t dim) {
  std::ofstream out(file, std::ios::binary);
  std::mt19937_64 random(20261128);
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::vector<char> record(4 + dim * sizeof(float));
  const auto dim32 = static_cast<std::int32_t>(dim);
  std::memcpy(record.data(), &dim32, 4);
  for (std::size_t r = 0; r < rows && out; ++r) {
    for (std::size_t c = 0; c < dim; ++c) {
      const float v = (random() & 1 ? 1.0f : -1.0f) * magnitude(random);
      std::memcpy(record.data() + 4 + c * sizeof(float), &v, sizeof v);
    }
    out.write(record.data(), static_cast<std::streamsize>(record.size()));
  }
  if (!out)
    return gpupool::make_error(gpupool::ErrorKind::Io, fmt::format("could not write {}", file.string()));
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"base_reading_bench: the knn job's reading of a base file beside plain parallel reads"};
  std::string base, json_path, device_spec;
  std::size_t rows = 0, dim = 128, reps = 3;
  std::vector<std::size_t> parts_list;
  app.add_option("--base", base, "a vector file (.fvecs, .bvecs, .npy, ...)");
  app.add_option("--rows", rows, "write a .fvecs of this many random rows first (to --base, or a temporary file)");
  app.add_option("--dim", dim, "its dimension")->check(CLI::Range(1, 4096));
  app.add_option("--parts", parts_list, "pieces read at once (comma-separated)")->delimiter(',');
  app.add_option("--reps", reps, "passes per figure (the median)")->check(CLI::Range(1, 100));
  app.add_option("--device", device_spec, "pin the blocks with this device (cuda:N, sim)");
  app.add_option("--json", json_path, "the figures as JSON too");
  CLI11_PARSE(app, argc, argv);
  if (base.empty() && rows == 0) {
    fmt::print(stderr, "base_reading_bench: give --base FILE, --rows N or both\n");
    return 2;
  }
  std::optional<fs::path> temporary;
  if (rows > 0) {
    if (base.empty()) {
      temporary = fs::temp_directory_path() / fmt::format("base_reading_bench_{}.fvecs", ::getpid());
      base = temporary->string();
    }
    if (auto ok = write_random_base(base, rows, dim); !ok) {
      fmt::print(stderr, "base_reading_bench: {}\n", ok.error().to_string());
      if (temporary) fs::remove(*temporary);
      return 1;
    }
  }
  std::error_code missing;
  const std::uintmax_t file_bytes = fs::file_size(base, missing);
  if (missing) {
    fmt::print(stderr, "base_reading_bench: {}: {}\n", base, missing.message());
    return 1;
  }
  const std::size_t cores = gpupool::exact::usable_cores();
  if (parts_list.empty()) parts_list = {1, std::min<std::size_t>(cores, 16)};
  std::optional<gpupool::Device> device;
  if (!device_spec.empty()) {
    auto opened = gpupool::Device::from_string(device_spec);
    if (!opened) {
      fmt::print(stderr, "base_reading_bench: {}\n", opened.error().to_string());
      return 1;
    }
    device = *opened;
  }

  // The memory the "pread to memory" rows write: two of the job's blocks (the job reads one while
  // the search holds another), or the whole file where it is smaller; zeroed here, so that its
  // pages are there before any pass.
  std::vector<char> memory;
  {
    auto reader = gpupool::io::VectorReader::open(base);
    if (!reader) {
      fmt::print(stderr, "base_reading_bench: {}\n", reader.error().to_string());
      if (temporary) fs::remove(*temporary);
      return 1;
    }
    const std::uint64_t block_bytes = job_block_rows(*reader) * block_row_bytes(*reader);
    memory.resize(static_cast<std::size_t>(std::min<std::uint64_t>(file_bytes, 2 * block_bytes)));
  }

  const double file_gb = static_cast<double>(file_bytes) / 1e9;
  fmt::print("base_reading_bench: {} ({:.2f} GB), {} usable cores, blocks {}\n", base, file_gb,
             cores, device ? "pinned by " + device->describe() : std::string("in ordinary memory"));
  fmt::print("{:<15} {:>6} {:>10} {:>10}\n", "reader", "parts", "GB/s", "seconds");
  nlohmann::json figures = nlohmann::json::array();
  int status = 0;
  for (std::size_t parts : parts_list) {
    if (parts == 0) continue;
    auto recycler = std::make_shared<gpupool::exact::BlockRecycler>(device);
    std::vector<double> plain, to_memory, job;
    std::uint64_t job_bytes = 0;
    for (std::size_t r = 0; r <= reps; ++r) {  // pass 0 warms the page cache and the blocks
      auto p = plain_read_seconds(base, file_bytes, parts);
      auto m = plain_read_seconds(base, file_bytes, parts, memory);
      auto j = job_read(base, parts, recycler);
      if (!p || !m || !j) {
        fmt::print(stderr, "base_reading_bench: {}\n",
                   j ? fmt::format("reading {} failed", base) : j.error().to_string());
        status = 1;
        break;
      }
      if (r == 0) continue;
      plain.push_back(*p);
      to_memory.push_back(*m);
      job.push_back(j->seconds);
      job_bytes = j->bytes;
    }
    if (status != 0) break;
    const double plain_s = median(plain), memory_s = median(to_memory), job_s = median(job);
    fmt::print("{:<15} {:>6} {:>10.2f} {:>10.3f}\n", "plain pread", parts, file_gb / plain_s, plain_s);
    fmt::print("{:<15} {:>6} {:>10.2f} {:>10.3f}\n", "pread to memory", parts, file_gb / memory_s,
               memory_s);
    fmt::print("{:<15} {:>6} {:>10.2f} {:>10.3f}\n", "knn job", parts,
               static_cast<double>(job_bytes) / 1e9 / job_s, job_s);
    figures.push_back({{"parts", parts}, {"plain_read_gbps", file_gb / plain_s},
                       {"read_to_memory_gbps", file_gb / memory_s}, {"read_to_memory_seconds", memory_s},
                       {"job_read_gbps", static_cast<double>(job_bytes) / 1e9 / job_s},
                       {"plain_read_seconds", plain_s}, {"job_read_seconds", job_s}});
  }
  if (!json_path.empty() && status == 0) {
    std::ofstream out(json_path);
    out << nlohmann::json{{"bench", "base_reading"}, {"file", base}, {"file_gb", file_gb},
                          {"pinned", device.has_value()}, {"figures", figures}}.dump(1)
        << "\n";
  }
  if (temporary) fs::remove(*temporary);
  return status;
}
