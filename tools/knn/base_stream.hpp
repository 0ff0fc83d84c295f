// gpupool::exact — the base file as blocks of rows as stored, read ahead on another thread.
//
// BaseBlocks hands out one pass over the base, front to back, a block of `block_rows` rows at a
// time, while the next two blocks are being read, one after the other: the disk (or the page
// cache) and the device work at the same time, and a block is often read before its turn (the
// job uploads its first chunk during the search before). A block of a seekable file is read in `parts` pieces at once, each by a reader
// of its own on a thread of its own (one thread copies a page-cached file at a few GB/s, a
// quarter of what the bus takes). Each piece's thread also scans what it read (scan_values) while
// it is hot, for float files: the job's arithmetic and bounds come from those figures. Rows stay
// as stored (uint8 bvecs rows are 128 bytes, not 512); int32 files are read as fp32. The file
// is never read whole: at most the blocks being used (two, while one's first chunk goes up ahead)
// and the two being read exist, so the job's host memory is about four blocks whatever the
// base's size.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <expected>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <vector>
#include "host_blocks.hpp"
#include "stored_rows.hpp"
#include "vector_io.hpp"
import gpupool;

namespace gpupool::exact {

// Reads the next `rows` rows of `base` as stored (int32 files as fp32) into `into`: all of
// them, or an error naming the file.
Result<void> read_stored_block(io::VectorReader& base, std::size_t rows, std::span<std::byte> into);

// Makes `row` the next row `reader` reads: a seek where the file can, else reading up to it (a
// gzip file is inflated from where it stands). The reader must not be past `row` yet.
Result<void> go_to_row(io::VectorReader& reader, std::size_t row);

// The reader for pass number `pass` (0-based) over `rows` base rows from `first_row` on (all the
// rest of the file by default): pass 0 is the caller's reader as it stands; every later pass
// reopens the file and goes to first_row (seeking where the file can, else reading up to it).
class BasePasses {
 public:
  // The path and row count are copied: the reading thread of a pass may be inside the reader
  // when the job asks for them (for an error message, say). `rows` is clamped to what is left.
  explicit BasePasses(io::VectorReader& reader, std::optional<std::size_t> rows = std::nullopt)
      : reader_(reader), path_(reader.path()), first_row_(reader.rows_read()),
        rows_(std::min(rows.value_or(reader.rows() - reader.rows_read()),
                       reader.rows() - reader.rows_read())) {}
  Result<io::VectorReader*> open_next();
  std::size_t first_row() const noexcept { return first_row_; }
  std::size_t rows() const noexcept { return rows_; }
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  io::VectorReader& reader_;
  std::filesystem::path path_;
  std::size_t first_row_, rows_;
  std::size_t passes_ = 0;
  std::optional<io::VectorReader> reopened_;
};

// One block of a pass: its rows as stored, where they start, what the scan found.
struct BaseBlock {
  std::shared_ptr<const HostBlock> memory;  // given back to the recycler when the last copy goes
  StoredRows rows;                          // a view into memory
  std::size_t first_row = 0;                // in the pass (0: the reader's row when it began)
  ValueStats stats;
};

class BaseBlocks {
 public:
  // `rows` rows of `reader` from where it stands, in blocks of `block_rows` from `recycler`,
  // each in `parts` pieces where the reader can seek (the first by `reader`, the others by
  // readers of the same file opened here); reading starts at once.
  BaseBlocks(io::VectorReader& reader, std::size_t rows, std::size_t block_rows,
             std::shared_ptr<BlockRecycler> recycler, std::size_t parts = 1);
  BaseBlocks(const BaseBlocks&) = delete;
  BaseBlocks& operator=(const BaseBlocks&) = delete;
  ~BaseBlocks();

  // The next block, nullopt after the last; the read's error (naming the file and record) if
  // it failed, after which the pass is over.
  Result<std::optional<BaseBlock>> next();
  // Whether next() would return without waiting for the reading threads.
  bool next_ready() const;
  // How long next() waited for the reading thread (the disk was slower), in seconds.
  double seconds_waiting() const noexcept { return seconds_waiting_; }
  // The reading thread's wall time on the blocks handed out, in seconds.
  double seconds_reading() const noexcept { return seconds_reading_; }
  // Bytes of rows handed out (as stored, headers not counted).
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }

 private:
  struct Read {
    HostBlock block;
    ValueStats stats;
    double seconds = 0;
  };
  void request_block();
  // Rows [first, first + rows) of the pass into `into`, in parts_ pieces where they can be.
  Result<ValueStats> read_rows(std::size_t first, std::size_t rows, std::span<std::byte> into);
  Result<ValueStats> read_piece(io::VectorReader& reader, std::size_t first, std::size_t rows,
                                std::span<std::byte> into, bool seek);

  io::VectorReader& reader_;
  std::size_t rows_, block_rows_, dim_;
  StoredElement element_;
  std::size_t first_row_;  // reader_'s place when the pass began: the file row of row 0
  std::size_t parts_;
  std::vector<io::VectorReader> helpers_;  // the other pieces' readers, opened on first use
  std::shared_ptr<BlockRecycler> recycler_;
  // Blocks asked of the reading threads, oldest first (at most kReadAhead); each read starts
  // when the one before it is done (last_read_done_), since they share the readers.
  static constexpr std::size_t kReadAhead = 2;
  std::deque<std::future<Result<Read>>> pending_;
  std::shared_future<void> last_read_done_;
  std::size_t requested_ = 0;   // rows asked of the reading thread so far
  std::size_t handed_out_ = 0;  // rows handed out so far
  bool failed_ = false;
  double seconds_waiting_ = 0, seconds_reading_ = 0;
  std::uint64_t bytes_read_ = 0;
};

}  // namespace gpupool::exact
