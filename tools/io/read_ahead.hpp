// A RowSource read ahead on a thread of its own: for sources whose reading is work (inflating
// gzip data) rather than a copy, so that the work runs beside whatever the reader's owner does
// before and between its reads (opening a device, reading another file, searching).
//
// Internal to gpupool::io (see detail.hpp).
#pragma once
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include "detail.hpp"

namespace gpupool::io::detail {

class ReadAheadSource final : public RowSource {
 public:
  // A piece is inflated (or read) at once: large enough that the thread's hand-overs cost
  // nothing beside it, small enough that the first rows come soon.
  static constexpr std::size_t kPieceBytes = std::size_t{4} << 20;

  // Reads `rows` rows of `row_bytes` bytes from `inner` in order, from the first on, in pieces of
  // whole rows of about `piece_bytes` (at least one row), holding at most `ahead_bytes` (and at
  // least one piece) not yet handed out. Reading starts at once; where no thread can be had,
  // read_rows reads `inner` itself.
  ReadAheadSource(std::unique_ptr<RowSource> inner, std::size_t rows, std::size_t row_bytes,
                  std::size_t ahead_bytes, std::size_t piece_bytes = kPieceBytes);
  ReadAheadSource(const ReadAheadSource&) = delete;
  ReadAheadSource& operator=(const ReadAheadSource&) = delete;
  // Stops the thread after the piece it is reading.
  ~ReadAheadSource() override;

  // The next n rows, in order (first_row must be where the last read ended). An error of the
  // reading thread comes out of the first read that reaches the piece it failed in (the rows of
  // that piece before the failure are not handed out), and of every read after it.
  Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) override;

  std::size_t piece_rows() const noexcept { return piece_rows_; }

 private:
  struct Piece {
    std::unique_ptr<std::byte[]> bytes;
    std::size_t size = 0;
  };
  void read_pieces() noexcept;
  Result<void> read_piece(std::size_t first_row, std::size_t n, Piece& piece) noexcept;
  // The next piece: waits for the reading thread; the thread's error once the pieces before it
  // are taken.
  Result<Piece> take_piece();

  std::unique_ptr<RowSource> inner_;
  const std::size_t rows_, row_bytes_, piece_rows_, max_pieces_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Piece> ready_;         // read, not yet taken
  std::optional<GpuError> failed_;  // where the reading thread stopped
  bool stopping_ = false;
  Piece current_;                   // taken; handed out from current_offset_ on
  std::size_t current_offset_ = 0;
  std::size_t next_row_ = 0;        // the caller's position, to check first_row
  std::thread thread_;              // last: starts once the members above exist
};

}  // namespace gpupool::io::detail
