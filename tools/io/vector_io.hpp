// gpupool::io — vector files for the gpupool command: TEXMEX (fvecs, bvecs, ivecs), IDX (MNIST,
// plain or gzip) and NumPy .npy.
//
// Reading streams: VectorReader knows rows() and dim() as soon as it is open and hands out rows in
// chunks of the caller's choosing, so files larger than memory work; uncompressed files can also
// jump to a row (seek). Writing is atomic: a file is
// written as "<path>.tmp-<pid>" and renamed into place, so a failed write leaves nothing behind.
// Nothing here throws; every failure is a GpuError naming the file and, for bad content, the record
// (row) or byte offset, the value found and what was expected.
//
// This header imports gpupool: include it after your other headers (it stands in for your own
// `import gpupool;`).
#pragma once
#include <cstddef>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>
#include <vector>
import gpupool;

namespace gpupool::io {

enum class VectorFormat : std::uint8_t {
  Fvecs,  // records of int32 dim + dim float32 (TEXMEX/SIFT)
  Bvecs,  // records of int32 dim + dim uint8
  Ivecs,  // records of int32 dim + dim int32 (ground truth ids)
  Idx,    // MNIST IDX, unsigned bytes, plain or gzip: N x d1 x ... -> N vectors of d1*...*dk
  Npy,    // NumPy 2-D array, C order, <f4 <f2 |u1 |i1 <i4
};

// What a file stores per value; read() converts each to float32, read_ints() to int32.
enum class ElementType : std::uint8_t { Float32, Float16, UInt8, Int8, Int32 };
// Bytes per stored value.
std::size_t element_bytes(ElementType type) noexcept;

std::string_view to_string(VectorFormat format) noexcept;
std::string_view to_string(ElementType type) noexcept;

// By file name: .fvecs .bvecs .ivecs .npy; .idx, *-idx3-ubyte (any idxN-ubyte), and either of these
// with .gz. Anything else (including .fvecs.gz) is InvalidInput with the list of known extensions.
Result<VectorFormat> detect_format(const std::filesystem::path& path);

// A stream of rows over one vector file. Move-only; reads go forwards from the first row (or from
// where seek put them).
class VectorReader {
 public:
  // Opens the file and checks its header (and, where the format allows, its size) up front.
  static Result<VectorReader> open(const std::filesystem::path& path);
  // Same, with the format given instead of taken from the name.
  static Result<VectorReader> open(const std::filesystem::path& path, VectorFormat format);

  VectorReader(VectorReader&&) noexcept;
  VectorReader& operator=(VectorReader&&) noexcept;
  VectorReader(const VectorReader&) = delete;
  VectorReader& operator=(const VectorReader&) = delete;
  ~VectorReader();

  const std::filesystem::path& path() const noexcept;
  VectorFormat format() const noexcept;
  ElementType element_type() const noexcept;
  std::size_t rows() const noexcept;       // every row of the file, known from the start
  std::size_t dim() const noexcept;        // values per row; 0 only for a TEXMEX file of no records
  std::size_t rows_read() const noexcept;  // rows handed out so far

  // Reads up to max_rows (> 0) next rows as float32, row-major, into out, which must hold
  // min(max_rows, rows() - rows_read()) * dim() values. Returns the rows read, 0 at the end.
  // int32 values beyond +-2^24 (not exact in float32) are an error: use read_ints for them.
  // After an error the reader is spent: later reads return InvalidState with the first error.
  Result<std::size_t> read(std::span<float> out, std::size_t max_rows);
  // The same as int32, for integer files (ivecs, bvecs, IDX, npy |u1 |i1 <i4); float files are
  // Unsupported.
  Result<std::size_t> read_ints(std::span<std::int32_t> out, std::size_t max_rows);
  // Reads up to max_rows (> 0) next rows as the file stores them (element_type(): uint8, int8,
  // fp16 or fp32 values, packed, no headers) into out, which must hold that many rows of
  // dim() * element size bytes. Int32 files are Unsupported (read or read_ints them). Returns the
  // rows read, 0 at the end; errors as read.
  Result<std::size_t> read_stored(std::span<std::byte> out, std::size_t max_rows);
  // Whether seek works: every format but gzip IDX, whose rows come in order only.
  bool seekable() const noexcept;
  // Makes `row` (0 .. rows()) the next row read; rows_read() becomes `row`. Unsupported where
  // seekable() is false, InvalidInput past rows(), InvalidState after a failed read. Several
  // readers of one file, each seeking to its own rows, read a file in parallel.
  Result<void> seek(std::size_t row);

  struct Impl;

 private:
  explicit VectorReader(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

// Files written together. A writer given a group writes its temporary file in full and leaves it
// there; commit() renames them all into place with SIGINT and SIGTERM held back, so the files
// change as a set or not at all. A group dropped before commit() removes its temporaries. Every
// writer's temporary file is also removed if the process gets SIGINT or SIGTERM while it exists
// (the signal then does what it would have done; up to 16 temporaries at once are covered).
class FileGroup {
 public:
  FileGroup() = default;
  FileGroup(const FileGroup&) = delete;
  FileGroup& operator=(const FileGroup&) = delete;
  ~FileGroup();
  // Io error naming the file if a rename fails; the files renamed before it are then removed, so
  // that no mix of old and new files remains.
  Result<void> commit();
  // The writers' side: `temp` is complete and goes to `target` on commit(); `signal_slot` is its
  // place among the temporaries removed on a signal (-1: none).
  void adopt(std::filesystem::path temp, std::filesystem::path target, int signal_slot) noexcept;

 private:
  struct Pending {
    std::filesystem::path temp, target;
    int signal_slot = -1;
  };
  std::vector<Pending> pending_;
};

// Atomic writers: data holds rows * dim values row-major (exactly that many). rows may be 0; dim
// must be positive and, for the TEXMEX formats, fit an int32. The parent directory must exist.
Result<void> write_fvecs(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                         std::span<const float> data, FileGroup* group = nullptr);
Result<void> write_ivecs(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                         std::span<const std::int32_t> data, FileGroup* group = nullptr);
// Whether `path` can be written as the writers write it: creates its temporary file and removes it
// again, so that an unwritable folder or a name too long is found before any work is done.
Result<void> check_writable(const std::filesystem::path& path);

// .npy version 1.0, C order, dtype <f4, <i4, <f8 resp. <i8.
Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const float> data, FileGroup* group = nullptr);
Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const std::int32_t> data, FileGroup* group = nullptr);
Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const double> data, FileGroup* group = nullptr);
Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const std::int64_t> data, FileGroup* group = nullptr);

}  // namespace gpupool::io
