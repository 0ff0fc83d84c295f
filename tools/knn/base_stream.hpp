// gpupool::exact — the base file as an input range of rows, for gpupool:batching.
//
// BaseRows hands out the rows of one pass over the base, front to back, so that
// process_in_batches can buffer exactly the rows of the chunk it is working on (and keep the rows
// of a chunk that ran out of memory for its retry). Underneath, the file is read in blocks of
// `block_rows`, one block ahead on another thread, so that the disk and the device work at the
// same time; a block of a seekable file is read in `parts` pieces at once, each by a reader of
// its own (one thread copied a 10M-row base out of the page cache at about 7 GB/s, and the job
// waited for it: docs/benchmarks.md). A row is a handle into its block (no copy per row: a 10M-row base would pay seconds
// for them); a block lives while the current position or a buffered row is in it, so the blocks
// of the chunk being worked on and the one being read are held. The file is never read whole.
//
// A read error cannot travel through an input range: the row that could not be read comes out
// with no block (the batch function refuses it), the range ends after it, and the error is kept
// in error(), which the caller checks after the batching call.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <expected>
#include <filesystem>
#include <future>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <vector>
#include "host_blocks.hpp"
#include "vector_io.hpp"
import gpupool;

namespace gpupool::exact {

// One base row: `dim` values at block->data() + offset; no block when it could not be read.
struct BaseRow {
  std::shared_ptr<const HostBlock> block;
  std::size_t offset = 0;
  const float* data() const noexcept { return block->data() + offset; }
};

// The rows of `rows` (consecutive rows of one pass) side by side: a view into their block when
// they all lie in one, else copied into `staging`.
std::span<const float> contiguous_rows(std::span<const BaseRow> rows, std::size_t dim,
                                       std::vector<float>& staging);

// Reads the next `rows` rows of `base` into `into` (rows × dim values): all of them, or an error
// naming the file.
Result<void> read_block(io::VectorReader& base, std::size_t rows, std::span<float> into);

// The reader for pass number `pass` (0-based) over the base rows from `first_row` on: pass 0 is
// the caller's reader as it stands; every later pass reopens the file and skips to first_row.
class BasePasses {
 public:
  // The path and row count are copied: the reading thread of a pass may be inside the reader
  // when the job asks for them (for an error message, say).
  explicit BasePasses(io::VectorReader& reader)
      : reader_(reader), path_(reader.path()), first_row_(reader.rows_read()),
        rows_(reader.rows() - reader.rows_read()) {}
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

class BaseRows {
 public:
  class iterator {
   public:
    using value_type = BaseRow;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::input_iterator_tag;
    iterator() = default;
    explicit iterator(BaseRows* owner) : owner_(owner) {}
    BaseRow operator*() const { return owner_->row(); }
    iterator& operator++() {
      owner_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.owner_->at_end(); }

   private:
    BaseRows* owner_ = nullptr;
  };

  // `rows` rows of `reader` from where it stands, in blocks of `block_rows` from `recycler`,
  // each block in `parts` pieces read in parallel where the reader can seek (the first piece by
  // `reader`, the others by readers of the same file that the range opens); reading starts at
  // once.
  BaseRows(io::VectorReader& reader, std::size_t rows, std::size_t block_rows,
           std::shared_ptr<BlockRecycler> recycler = std::make_shared<BlockRecycler>(),
           std::size_t parts = 1);
  BaseRows(const BaseRows&) = delete;
  BaseRows& operator=(const BaseRows&) = delete;
  ~BaseRows();

  iterator begin() { return iterator(this); }
  std::default_sentinel_t end() const noexcept { return {}; }
  // The read error that ended the range early, if one did.
  const std::optional<GpuError>& error() const noexcept { return error_; }
  // How long taking rows waited for the reading thread, in seconds (JobTimes::waiting_for_base).
  double seconds_waiting() const noexcept { return seconds_waiting_; }

 private:
  bool at_end() const noexcept { return error_.has_value() || position_ >= rows_; }
  // Loads the next block when the current one is used up (the only place that waits for the
  // disk): only when a row of it is wanted, so that the next block is requested no earlier.
  BaseRow row();
  void next() noexcept { ++position_; }
  void request_block();
  // Rows [first, first + rows) of the file into `into`: by reader_ alone, or in parts_ pieces
  // (read_parts). Runs on the reading thread; reader_ stands after the rows when it is done.
  Result<void> read_rows(std::size_t first, std::size_t rows, std::span<float> into);
  Result<void> read_parts(std::size_t first, std::size_t rows, std::span<float> into);

  io::VectorReader& reader_;
  std::size_t rows_, block_rows_, dim_;
  std::size_t first_row_;  // reader_'s place when the range began: the file row of row 0
  std::size_t parts_;
  std::vector<io::VectorReader> helpers_;  // the other pieces' readers, opened on first use
  std::shared_ptr<BlockRecycler> recycler_;
  std::future<Result<HostBlock>> pending_;
  std::size_t requested_ = 0;    // rows asked of the reader so far
  std::shared_ptr<const HostBlock> block_;  // rows block_first_ .. + its size / dim - 1
  std::size_t block_first_ = 0;
  std::size_t position_ = 0;     // the row the iterator is on
  std::optional<GpuError> error_;
  double seconds_waiting_ = 0;
};

}  // namespace gpupool::exact
