// Internals of gpupool::io: gzip data inflated from an InputFile with zlib's inflate, so that the
// reader knows where the compressed data ends. Every member must end cleanly (its CRC and length
// checked by zlib), members may follow one another, and anything else after the last is refused —
// gzread would skip it as "trailing garbage".
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>
#include "detail.hpp"

struct z_stream_s;

namespace gpupool::io::detail {

class GzipReader {
 public:
  // Reads `file` from where it stands (its start).
  static Result<GzipReader> open(InputFile file);
  GzipReader(GzipReader&&) noexcept;
  GzipReader& operator=(GzipReader&&) noexcept;
  ~GzipReader();

  // Inflates up to n bytes into dst; fewer only where the data ends. `where` says what was being
  // read, for messages. Corrupt, cut-short and trailing data are InvalidInput errors.
  Result<std::size_t> read(void* dst, std::size_t n, std::string_view where);
  const std::filesystem::path& path() const noexcept { return file_.path(); }

 private:
  struct StreamEnd {
    void operator()(z_stream_s* stream) const noexcept;
  };
  explicit GzipReader(InputFile file);
  // More compressed bytes into the input buffer (kept: the unread ones); false at the file's end.
  Result<bool> refill();
  // Between members: another member starts here, or the data has ended.
  Result<void> next_member(std::string_view where);
  GpuError inflate_error(int code, std::string_view where) const;

  InputFile file_;
  std::unique_ptr<z_stream_s, StreamEnd> stream_;
  std::vector<unsigned char> input_;
  std::uint64_t consumed_before_ = 0;  // file bytes before the input buffer's start
  bool member_ended_ = false;
  bool ended_ = false;
};

}  // namespace gpupool::io::detail
