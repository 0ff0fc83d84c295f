// A RowSource read ahead on a thread of its own (see read_ahead.hpp).
#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <new>
#include <system_error>
#include <utility>
#include "read_ahead.hpp"

namespace gpupool::io::detail {

ReadAheadSource::ReadAheadSource(std::unique_ptr<RowSource> inner, std::size_t rows,
                                 std::size_t row_bytes, std::size_t ahead_bytes,
                                 std::size_t piece_bytes)
    : inner_(std::move(inner)), rows_(rows), row_bytes_(std::max<std::size_t>(row_bytes, 1)),
      piece_rows_(std::max<std::size_t>(piece_bytes / row_bytes_, 1)),
      max_pieces_(std::max<std::size_t>(ahead_bytes / (piece_rows_ * row_bytes_), 1)) {
  if (rows_ == 0) return;
  try {
    thread_ = std::thread([this] { read_pieces(); });
  } catch (const std::system_error&) {  // no thread: read_rows reads inner_ itself
  }
}

ReadAheadSource::~ReadAheadSource() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ReadAheadSource::read_pieces() noexcept {
  for (std::size_t row = 0; row < rows_;) {
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || ready_.size() < max_pieces_; });
      if (stopping_) return;
    }
    const std::size_t n = std::min(piece_rows_, rows_ - row);
    Piece piece;
    Result<void> read = read_piece(row, n, piece);
    {
      std::lock_guard lock(mutex_);
      // An exception here (no memory for the queue) is the same failure as a read's.
      try {
        if (read) ready_.push_back(std::move(piece));
      } catch (...) {
        read = std::unexpected(
            GpuError(ErrorKind::OutOfMemory, "no host memory to queue rows read ahead"));
      }
      if (!read) failed_ = read.error();
    }
    changed_.notify_all();
    if (!read) return;
    row += n;
  }
}

// Nothing thrown leaves the reading thread: what would end the process becomes the read's error.
Result<void> ReadAheadSource::read_piece(std::size_t first_row, std::size_t n,
                                         Piece& piece) noexcept {
  try {
    piece.size = n * row_bytes_;
    piece.bytes.reset(new (std::nothrow) std::byte[piece.size]);
    if (!piece.bytes)
      return make_error(ErrorKind::OutOfMemory,
                        fmt::format("no host memory for {} bytes of rows read ahead", piece.size));
    return inner_->read_rows(first_row, n, piece.bytes.get());
  } catch (const std::bad_alloc&) {
    return std::unexpected(GpuError(ErrorKind::OutOfMemory, "out of host memory reading ahead"));
  } catch (const std::exception& e) {
    return std::unexpected(GpuError(
        ErrorKind::Internal, std::string("unexpected exception reading ahead: ") + e.what()));
  }
}

Result<ReadAheadSource::Piece> ReadAheadSource::take_piece() {
  Piece piece;
  {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !ready_.empty() || failed_; });
    if (ready_.empty()) return std::unexpected(*failed_);
    piece = std::move(ready_.front());
    ready_.pop_front();
  }
  changed_.notify_all();  // room for another piece
  return piece;
}

Result<void> ReadAheadSource::read_rows(std::size_t first_row, std::size_t n, std::byte* dst) {
  if (first_row != next_row_ || n > rows_ - first_row)
    return make_error(ErrorKind::InvalidState,
                      fmt::format("rows {}..{} asked of a source read in order, at row {} of {}",
                                  first_row, first_row + n, next_row_, rows_));
  if (!thread_.joinable()) {
    auto read = inner_->read_rows(first_row, n, dst);
    if (read) next_row_ += n;
    return read;
  }
  std::size_t wanted = n * row_bytes_;
  while (wanted > 0) {
    if (current_offset_ == current_.size) {
      auto next = take_piece();
      if (!next) return std::unexpected(next.error());
      current_ = std::move(*next);
      current_offset_ = 0;
    }
    const std::size_t copy = std::min(wanted, current_.size - current_offset_);
    std::memcpy(dst, current_.bytes.get() + current_offset_, copy);
    dst += copy;
    current_offset_ += copy;
    wanted -= copy;
  }
  next_row_ += n;
  return {};
}

}  // namespace gpupool::io::detail
