// The base file as an input range of rows (see base_stream.hpp).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <future>
#include <memory>
#include <span>
#include <system_error>
#include <vector>
#include "base_stream.hpp"

namespace gpupool::exact {

Result<void> read_block(io::VectorReader& base, std::size_t rows, std::span<float> into) {
  std::size_t before = base.rows_read();
  auto got = base.read(into, rows);
  if (!got) return std::unexpected(got.error());
  if (*got != rows)
    return make_error(ErrorKind::Io, fmt::format("{}: read {} rows at row {}; expected {}",
                                                 base.path().string(), *got, before, rows));
  return {};
}

Result<io::VectorReader*> BasePasses::open_next() {
  if (passes_++ == 0) return &reader_;
  auto reader = io::VectorReader::open(path_, reader_.format());
  if (!reader)
    return std::unexpected(reader.error().with_context("reopening the base for another query block"));
  reopened_.emplace(std::move(*reader));
  // Forward-only readers (gzip, records of their own length): skip by reading, a block at a time.
  constexpr std::size_t kSkipRows = 4096;
  std::vector<float> block(kSkipRows * reopened_->dim());
  for (std::size_t skipped = 0; skipped < first_row_;) {
    std::size_t rows = std::min(kSkipRows, first_row_ - skipped);
    if (auto ok = read_block(*reopened_, rows, block); !ok) return std::unexpected(ok.error());
    skipped += rows;
  }
  return &*reopened_;
}

BaseRows::BaseRows(io::VectorReader& reader, std::size_t rows, std::size_t block_rows,
                   std::shared_ptr<BlockRecycler> recycler, std::size_t parts)
    : reader_(reader), rows_(rows), block_rows_(std::max<std::size_t>(block_rows, 1)),
      dim_(reader.dim()), first_row_(reader.rows_read()),
      parts_(reader.seekable() ? std::max<std::size_t>(parts, 1) : 1),
      recycler_(std::move(recycler)) {
  if (rows_ > 0) request_block();
}

BaseRows::~BaseRows() {
  if (pending_.valid()) pending_.wait();  // the reading thread uses reader_ until it is done
}

Result<void> BaseRows::read_rows(std::size_t first, std::size_t rows, std::span<float> into) {
  if (parts_ > 1 && rows >= parts_) return read_parts(first, rows, into);
  return read_block(reader_, rows, into);
}

// Piece p: rows [first + rows·p / parts, first + rows·(p + 1) / parts), piece 0 by reader_ on
// this thread, the others by helpers_ on threads of their own; the first error by piece wins.
Result<void> BaseRows::read_parts(std::size_t first, std::size_t rows, std::span<float> into) {
  while (helpers_.size() + 1 < parts_) {
    auto helper = io::VectorReader::open(reader_.path(), reader_.format());
    if (!helper)
      return std::unexpected(helper.error().with_context("opening another reader of the base"));
    helpers_.push_back(std::move(*helper));
  }
  auto piece = [&](std::size_t p) { return first + rows * p / parts_; };
  auto read_piece = [&](io::VectorReader& reader, std::size_t p) -> Result<void> {
    const std::size_t begin = piece(p), count = piece(p + 1) - begin;
    if (auto at = reader.seek(first_row_ + begin); !at) return at;
    return read_block(reader, count, into.subspan((begin - first) * dim_, count * dim_));
  };
  std::vector<std::future<Result<void>>> others;
  for (std::size_t p = 1; p < parts_; ++p) {
    auto task = [&, p] { return read_piece(helpers_[p - 1], p); };
    try {
      others.push_back(std::async(std::launch::async, task));
    } catch (const std::system_error&) {  // no thread to be had: read it after piece 0
      others.push_back(std::async(std::launch::deferred, task));
    }
  }
  Result<void> result = read_piece(reader_, 0);
  for (auto& other : others) {
    Result<void> done = other.get();
    if (result && !done) result = std::move(done);
  }
  if (!result) return result;
  return reader_.seek(first_row_ + first + rows);  // where a reader of the whole block stands
}

void BaseRows::request_block() {
  const std::size_t first = requested_, rows = std::min(block_rows_, rows_ - requested_);
  requested_ += rows;
  auto read = [this, first, rows]() -> Result<HostBlock> {
    auto block = recycler_->take(rows * dim_);
    if (!block) return std::unexpected(block.error().with_context(reader_.path().string()));
    if (auto ok = read_rows(first, rows, {block->data(), block->size()}); !ok)
      return std::unexpected(ok.error());
    return block;
  };
  try {
    pending_ = std::async(std::launch::async, read);
  } catch (const std::system_error&) {  // no thread to be had: read when taken
    pending_ = std::async(std::launch::deferred, read);
  }
}

BaseRow BaseRows::row() {
  bool in_block = block_ && dim_ > 0 && position_ < block_first_ + block_->size() / dim_;
  if (!in_block) {
    const auto start = std::chrono::steady_clock::now();
    auto block = pending_.get();
    seconds_waiting_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!block) {
      error_ = block.error();
      return BaseRow{};
    }
    block_ = BlockRecycler::share(recycler_, std::move(*block));
    block_first_ = position_;
    if (requested_ < rows_) request_block();
  }
  return BaseRow{block_, (position_ - block_first_) * dim_};
}

std::span<const float> contiguous_rows(std::span<const BaseRow> rows, std::size_t dim,
                                       std::vector<float>& staging) {
  if (rows.empty()) return {};
  // Rows come in file order, so first and last in one block means all of them, side by side.
  if (rows.front().block == rows.back().block) return {rows.front().data(), rows.size() * dim};
  staging.resize(rows.size() * dim);
  auto out = staging.begin();
  for (const BaseRow& row : rows) out = std::copy_n(row.data(), dim, out);
  return staging;
}

}  // namespace gpupool::exact
