// The base file as blocks of stored rows (see base_stream.hpp).
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

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs `task` on a thread of its own, or later on the caller's where no thread can be had.
template <class Task>
auto start_async(Task task) {
  try {
    return std::async(std::launch::async, std::move(task));
  } catch (const std::system_error&) {
    return std::async(std::launch::deferred, std::move(task));
  }
}

}  // namespace

Result<void> read_stored_block(io::VectorReader& base, std::size_t rows, std::span<std::byte> into) {
  const std::size_t before = base.rows_read();
  auto got = base.element_type() == io::ElementType::Int32
                 ? base.read(std::span(reinterpret_cast<float*>(into.data()), into.size() / sizeof(float)), rows)
                 : base.read_stored(into, rows);
  if (!got) return std::unexpected(got.error());
  if (*got != rows)
    return make_error(ErrorKind::Io, fmt::format("{}: read {} rows at row {}; expected {}",
                                                 base.path().string(), *got, before, rows));
  return {};
}

Result<void> go_to_row(io::VectorReader& reader, std::size_t row) {
  if (reader.seekable()) return reader.seek(row);
  // Forward-only readers (gzip): skip by reading, a block at a time.
  constexpr std::size_t kSkipRows = 4096;
  const std::size_t row_bytes = reader.dim() * sizeof(float);
  std::vector<std::byte> block(kSkipRows * row_bytes);
  for (std::size_t skipped = reader.rows_read(); skipped < row;) {
    const std::size_t rows = std::min(kSkipRows, row - skipped);
    if (auto ok = read_stored_block(reader, rows, block); !ok) return std::unexpected(ok.error());
    skipped += rows;
  }
  return {};
}

Result<io::VectorReader*> BasePasses::open_next() {
  if (passes_++ == 0) return &reader_;
  auto reader = io::VectorReader::open(path_, reader_.format());
  if (!reader)
    return std::unexpected(reader.error().with_context("reopening the base for another query block"));
  reopened_.emplace(std::move(*reader));
  if (auto at = go_to_row(*reopened_, first_row_); !at) return std::unexpected(at.error());
  return &*reopened_;
}

BaseBlocks::BaseBlocks(io::VectorReader& reader, std::size_t rows, std::size_t block_rows,
                       std::shared_ptr<BlockRecycler> recycler, std::size_t parts)
    : reader_(reader), rows_(rows), block_rows_(std::max<std::size_t>(block_rows, 1)),
      dim_(reader.dim()), element_(stored_element(reader.element_type())),
      first_row_(reader.rows_read()),
      parts_(reader.seekable() ? std::max<std::size_t>(parts, 1) : 1),
      recycler_(std::move(recycler)) {
  while (pending_.size() < kReadAhead && requested_ < rows_) request_block();
}

BaseBlocks::~BaseBlocks() {
  for (auto& read : pending_) read.wait();  // the reading threads use reader_ until they are done
}

// Float rows are read and scanned a stretch at a time, small enough to stay in the core's cache
// between the copy that writes it and the scan that reads it: the scan costs no second pass over
// memory.
constexpr std::size_t kScanStretchBytes = std::size_t{256} << 10;

Result<ValueStats> BaseBlocks::read_piece(io::VectorReader& reader, std::size_t first,
                                          std::size_t rows, std::span<std::byte> into, bool seek) {
  if (seek)
    if (auto at = reader.seek(first_row_ + first); !at) return std::unexpected(at.error());
  if (stats_known_by_type(element_)) {
    if (auto ok = read_stored_block(reader, rows, into); !ok) return std::unexpected(ok.error());
    return known_stats(element_, rows, dim_);
  }
  const std::size_t row_bytes = dim_ * stored_size(element_);
  const std::size_t stretch = std::max<std::size_t>(kScanStretchBytes / row_bytes, 1);
  ValueStats stats;  // no rows: what scan_values gives for none
  for (std::size_t done = 0; done < rows;) {
    const std::size_t count = std::min(stretch, rows - done);
    const std::span<std::byte> part = into.subspan(done * row_bytes, count * row_bytes);
    if (auto ok = read_stored_block(reader, count, part); !ok) return std::unexpected(ok.error());
    const ValueStats scanned = scan_values(StoredRows{part.data(), element_, count, dim_});
    if (done == 0) stats = scanned;
    else stats.append(scanned);
    done += count;
  }
  return stats;
}

// Piece p: rows [first + rows·p / parts, first + rows·(p + 1) / parts), piece 0 by reader_ on
// this thread, the others by helpers_ on threads of their own; the first error by piece wins.
Result<ValueStats> BaseBlocks::read_rows(std::size_t first, std::size_t rows, std::span<std::byte> into) {
  const std::size_t parts = rows >= parts_ ? parts_ : 1;
  const std::size_t row_bytes = dim_ * stored_size(element_);
  while (parts > 1 && helpers_.size() + 1 < parts) {
    auto helper = io::VectorReader::open(reader_.path(), reader_.format());
    if (!helper)
      return std::unexpected(helper.error().with_context("opening another reader of the base"));
    helpers_.push_back(std::move(*helper));
  }
  auto piece = [&](std::size_t p) { return first + rows * p / parts; };
  auto read = [&](io::VectorReader& reader, std::size_t p) {
    const std::size_t begin = piece(p), count = piece(p + 1) - begin;
    return read_piece(reader, begin, count,
                      into.subspan((begin - first) * row_bytes, count * row_bytes), parts > 1);
  };
  std::vector<std::future<Result<ValueStats>>> others;
  for (std::size_t p = 1; p < parts; ++p)
    others.push_back(start_async([&, p] { return read(helpers_[p - 1], p); }));
  Result<ValueStats> result = read(reader_, 0);
  for (auto& other : others) {
    Result<ValueStats> done = other.get();
    if (result && done) result->append(*done);
    else if (result) result = std::move(done);
  }
  if (!result || parts == 1) return result;
  if (auto at = reader_.seek(first_row_ + first + rows); !at) return std::unexpected(at.error());
  return result;
}

void BaseBlocks::request_block() {
  const std::size_t first = requested_, rows = std::min(block_rows_, rows_ - requested_);
  requested_ += rows;
  const std::size_t bytes = rows * dim_ * stored_size(element_);
  std::shared_future<void> before = last_read_done_;
  auto done = std::make_shared<std::promise<void>>();
  last_read_done_ = done->get_future().share();
  pending_.push_back(start_async([this, first, rows, bytes, before, done]() -> Result<Read> {
    // Reads take turns on the readers, in the order they were asked for.
    struct Done {
      std::shared_ptr<std::promise<void>> promise;
      ~Done() { promise->set_value(); }
    } finished{done};
    if (before.valid()) before.wait();
    const auto start = std::chrono::steady_clock::now();
    auto block = recycler_->take(bytes);
    if (!block) return std::unexpected(block.error().with_context(reader_.path().string()));
    auto stats = read_rows(first, rows, {block->data(), bytes});
    if (!stats) return std::unexpected(stats.error());
    return Read{std::move(*block), *stats, seconds_since(start)};
  }));
}

bool BaseBlocks::next_ready() const {
  return !pending_.empty() &&
         pending_.front().wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Result<std::optional<BaseBlock>> BaseBlocks::next() {
  if (failed_ || handed_out_ >= rows_ || pending_.empty()) return std::optional<BaseBlock>{};
  const auto start = std::chrono::steady_clock::now();
  auto read = pending_.front().get();
  pending_.pop_front();
  seconds_waiting_ += seconds_since(start);
  if (!read) {
    failed_ = true;
    return std::unexpected(read.error());
  }
  const std::size_t rows = read->stats.rows;
  BaseBlock block;
  block.first_row = handed_out_;
  block.stats = read->stats;
  seconds_reading_ += read->seconds;
  bytes_read_ += read->block.size();
  block.memory = BlockRecycler::share(recycler_, std::move(read->block));
  block.rows = StoredRows{block.memory->data(), element_, rows, dim_};
  handed_out_ += rows;
  while (pending_.size() < kReadAhead && requested_ < rows_) request_block();
  return std::optional<BaseBlock>(std::move(block));
}

}  // namespace gpupool::exact
