// ReadAheadSource (tools/io/read_ahead.hpp) against the source it reads: the same bytes in any
// split of reads, errors from the piece where the source failed on, and never more than its bound
// ahead.
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>
#include "read_ahead.hpp"

namespace {

using gpupool::ErrorKind;
using gpupool::Result;
using gpupool::io::detail::ReadAheadSource;
using gpupool::io::detail::RowSource;

std::byte byte_at(std::size_t row, std::size_t col) {
  return static_cast<std::byte>((row * 131 + col * 7 + 5) & 0xff);
}

// Rows of known bytes, read in order; fails at `failing_row` (after writing the rows before it)
// and records how far it was asked to read.
class ModelSource final : public RowSource {
 public:
  ModelSource(std::size_t row_bytes, std::optional<std::size_t> failing_row,
              std::atomic<std::size_t>& rows_read)
      : row_bytes_(row_bytes), failing_row_(failing_row), rows_read_(rows_read) {}

  Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) override {
    if (first_row != next_) return gpupool::make_error(ErrorKind::InvalidState, "out of order");
    for (std::size_t r = first_row; r < first_row + n; ++r) {
      if (failing_row_ && r == *failing_row_)
        return gpupool::make_error(ErrorKind::InvalidInput, "bad row " + std::to_string(r));
      for (std::size_t c = 0; c < row_bytes_; ++c) *dst++ = byte_at(r, c);
    }
    next_ += n;
    rows_read_.store(next_);
    return {};
  }

 private:
  std::size_t row_bytes_;
  std::optional<std::size_t> failing_row_;
  std::atomic<std::size_t>& rows_read_;
  std::size_t next_ = 0;
};

bool holds_rows(const std::vector<std::byte>& got, std::size_t first_row, std::size_t row_bytes) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != byte_at(first_row + i / row_bytes, i % row_bytes)) return false;
  return true;
}

}  // namespace

TEST_CASE("a source read ahead hands out its rows as they are, within its bound", "[io]") {
  rc::prop("the same rows in any split; the error at its row and after; bounded ahead", [] {
    const auto row_bytes = *rc::gen::inRange<std::size_t>(1, 300);
    const auto rows = *rc::gen::inRange<std::size_t>(1, 2000);
    const auto piece = *rc::gen::inRange<std::size_t>(1, 20000);
    const auto ahead = *rc::gen::inRange<std::size_t>(0, 100000);
    std::optional<std::size_t> failing;
    if (*rc::gen::arbitrary<bool>()) failing = *rc::gen::inRange<std::size_t>(0, rows);
    std::atomic<std::size_t> rows_read{0};
    ReadAheadSource source(std::make_unique<ModelSource>(row_bytes, failing, rows_read), rows,
                           row_bytes, ahead, piece);
    // At most max(ahead, one piece) waiting, plus the piece being read, plus the one handed out.
    const std::size_t piece_rows = source.piece_rows();
    RC_ASSERT(piece_rows == std::max<std::size_t>(piece / row_bytes, 1));
    const std::size_t bound_rows = std::max(ahead / row_bytes, piece_rows) + 2 * piece_rows;
    std::size_t at = 0;
    bool failed = false;
    while (at < rows) {
      const auto n = *rc::gen::inRange<std::size_t>(1, std::min<std::size_t>(rows - at, 500) + 1);
      std::vector<std::byte> got(n * row_bytes);
      auto read = source.read_rows(at, n, got.data());
      RC_ASSERT(rows_read.load() <= at + n + bound_rows);
      // The rows come in pieces: a read fails from the first piece that holds the failing row.
      const bool reaches_failure = failing && *failing / piece_rows * piece_rows < at + n;
      if (reaches_failure) {
        RC_ASSERT(!read);
        RC_ASSERT(read.error().message() == "bad row " + std::to_string(*failing));
        failed = true;
        break;
      }
      RC_ASSERT(read.has_value());
      RC_ASSERT(holds_rows(got, at, row_bytes));
      at += n;
    }
    if (failed) {  // and every read after it
      std::vector<std::byte> more(row_bytes);
      RC_ASSERT(!source.read_rows(at, 1, more.data()));
    }
  });
}

TEST_CASE("a source read ahead refuses reads out of order and stops when dropped", "[io]") {
  std::atomic<std::size_t> rows_read{0};
  const std::size_t row_bytes = 1000, rows = 50000;  // 50 MB: the reading thread waits, full
  {
    ReadAheadSource source(std::make_unique<ModelSource>(row_bytes, std::nullopt, rows_read), rows,
                           row_bytes, 8u << 20);
    std::vector<std::byte> got(10 * row_bytes);
    REQUIRE(source.read_rows(0, 10, got.data()));
    auto skipped = source.read_rows(20, 10, got.data());
    REQUIRE_FALSE(skipped);
    CHECK(skipped.error().kind() == ErrorKind::InvalidState);
    auto past_end = source.read_rows(10, rows, got.data());
    REQUIRE_FALSE(past_end);
    CHECK(past_end.error().kind() == ErrorKind::InvalidState);
    REQUIRE(source.read_rows(10, 10, got.data()));
    CHECK(holds_rows(got, 10, row_bytes));
  }  // dropped with the thread waiting for room: the destructor returns
  CHECK(rows_read.load() < rows);
}
