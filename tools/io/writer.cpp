// Atomic writers: the file is written as "<path>.tmp-<pid>", flushed to disk and renamed over
// path (at once, or with the rest of its FileGroup); on any failure the temporary file is removed,
// so path is either complete or untouched. Temporary files are also removed on SIGINT and SIGTERM
// (temporary_files.hpp).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <csignal>
#include <fcntl.h>
#include <fmt/format.h>
#include <new>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>
#include "detail.hpp"
#include "temporary_files.hpp"

namespace gpupool::io {

namespace {

using detail::quoted;

class AtomicFile {
 public:
  static Result<AtomicFile> create(const std::filesystem::path& target) {
    std::filesystem::path temp = target;
    temp += fmt::format(".tmp-{}", ::getpid());
    int fd;
    do fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      int err = errno;
      return make_error(ErrorKind::Io,
                        fmt::format("{}: cannot create the temporary file {} to write it: {}{}",
                                    quoted(target), quoted(temp), std::strerror(err),
                                    err == ENOENT ? " (does the directory exist?)" : ""));
    }
    const int slot = detail::register_temporary(temp);
    return AtomicFile(target, std::move(temp), fd, slot);
  }

  AtomicFile(AtomicFile&& other) noexcept
      : target_(std::move(other.target_)), temp_(std::move(other.temp_)),
        fd_(std::exchange(other.fd_, -1)), pending_(std::exchange(other.pending_, false)),
        slot_(std::exchange(other.slot_, -1)) {}
  AtomicFile& operator=(AtomicFile&&) = delete;

  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (pending_) ::unlink(temp_.c_str());
    detail::forget_temporary(slot_);
  }

  Result<void> write(const void* data, std::size_t n) {
    const auto* bytes = static_cast<const std::byte*>(data);
    while (n > 0) {
      ssize_t put = ::write(fd_, bytes, std::min<std::size_t>(n, std::size_t{1} << 30));
      if (put < 0) {
        if (errno == EINTR) continue;
        return failure("writing");
      }
      bytes += put;
      n -= static_cast<std::size_t>(put);
    }
    return {};
  }

  // Makes the data durable and moves it into place, or leaves that to `group`'s commit().
  Result<void> commit(FileGroup* group) {
    if (::fsync(fd_) != 0) return failure("flushing to disk");
    int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) return failure("closing");
    if (group) {
      group->adopt(temp_, target_, std::exchange(slot_, -1));
      pending_ = false;
      return {};
    }
    if (::rename(temp_.c_str(), target_.c_str()) != 0) return failure("renaming into place");
    pending_ = false;
    return {};
  }

 private:
  AtomicFile(std::filesystem::path target, std::filesystem::path temp, int fd, int slot) noexcept
      : target_(std::move(target)), temp_(std::move(temp)), fd_(fd), slot_(slot) {}

  std::unexpected<GpuError> failure(std::string_view step) const {
    int err = errno;
    return make_error(ErrorKind::Io,
                      fmt::format("{}: {} failed: {} (nothing was written to {})", quoted(target_),
                                  step, std::strerror(err), quoted(target_)));
  }

  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool pending_ = true;  // the temporary file exists and must go if we do not finish
  int slot_ = -1;        // its place among the temporaries removed on a signal
};

Result<void> check_shape(const std::filesystem::path& path, std::string_view format,
                         std::size_t rows, std::size_t dim, std::size_t values, bool texmex) {
  if (dim == 0 || (texmex && dim > detail::kMaxDim))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: cannot write {} rows of dimension {} as {}: the dimension "
                                  "must be 1 to {}",
                                  quoted(path), rows, dim, format, detail::kMaxDim));
  std::uint64_t expected = 0;
  bool overflow = !detail::checked_mul(rows, dim, expected);
  if (overflow || expected != values)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: cannot write {} rows of dimension {} as {}: that needs {} "
                                  "values, but {} were given",
                                  quoted(path), rows, dim, format,
                                  overflow ? std::string("more than 2^64") : std::to_string(expected),
                                  values));
  return {};
}

template <class T>
Result<void> write_texmex_impl(const std::filesystem::path& path, std::string_view format,
                               std::size_t rows, std::size_t dim, std::span<const T> data,
                               FileGroup* group) {
  if (auto ok = check_shape(path, format, rows, dim, data.size(), true); !ok) return ok;
  auto file = AtomicFile::create(path);
  if (!file) return std::unexpected(file.error());
  std::size_t record_bytes = 4 + dim * sizeof(T);
  std::size_t per_block = std::max<std::size_t>(1, detail::kBlockBytes / record_bytes);
  std::vector<std::byte> block(std::min(per_block, std::max<std::size_t>(rows, 1)) * record_bytes);
  auto header = static_cast<std::int32_t>(dim);
  for (std::size_t row = 0; row < rows;) {
    std::size_t count = std::min(per_block, rows - row);
    for (std::size_t i = 0; i < count; ++i) {
      std::byte* record = block.data() + i * record_bytes;
      std::memcpy(record, &header, 4);
      std::memcpy(record + 4, data.data() + (row + i) * dim, dim * sizeof(T));
    }
    if (auto ok = file->write(block.data(), count * record_bytes); !ok) return ok;
    row += count;
  }
  return file->commit(group);
}

template <class T>
Result<void> write_npy_impl(const std::filesystem::path& path, std::string_view descr,
                            std::size_t rows, std::size_t dim, std::span<const T> data,
                            FileGroup* group) {
  if (auto ok = check_shape(path, "npy", rows, dim, data.size(), false); !ok) return ok;
  auto file = AtomicFile::create(path);
  if (!file) return std::unexpected(file.error());
  std::string preamble = detail::npy_preamble(descr, rows, dim);
  if (auto ok = file->write(preamble.data(), preamble.size()); !ok) return ok;
  if (auto ok = file->write(data.data(), data.size_bytes()); !ok) return ok;
  return file->commit(group);
}

// Runs a writer with the no-exception guarantee of the API.
template <class F>
Result<void> guarded(const std::filesystem::path& path, F&& write) {
  try {
    return write();
  } catch (const std::bad_alloc&) {
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("{}: out of host memory while writing", quoted(path)));
  } catch (const std::exception& e) {
    return make_error(ErrorKind::Internal, fmt::format("{}: unexpected exception while writing: {}",
                                                       quoted(path), e.what()));
  }
}

}  // namespace

Result<void> check_writable(const std::filesystem::path& path) {
  // Dropped uncommitted, the temporary file is removed.
  return guarded(path, [&]() -> Result<void> {
    auto file = AtomicFile::create(path);
    if (!file) return std::unexpected(file.error());
    return {};
  });
}

Result<void> write_fvecs(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                         std::span<const float> data, FileGroup* group) {
  return guarded(path, [&] { return write_texmex_impl(path, "fvecs", rows, dim, data, group); });
}

Result<void> write_ivecs(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                         std::span<const std::int32_t> data, FileGroup* group) {
  return guarded(path, [&] { return write_texmex_impl(path, "ivecs", rows, dim, data, group); });
}

Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const float> data, FileGroup* group) {
  return guarded(path, [&] { return write_npy_impl(path, "<f4", rows, dim, data, group); });
}

Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const std::int32_t> data, FileGroup* group) {
  return guarded(path, [&] { return write_npy_impl(path, "<i4", rows, dim, data, group); });
}

Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const double> data, FileGroup* group) {
  return guarded(path, [&] { return write_npy_impl(path, "<f8", rows, dim, data, group); });
}

Result<void> write_npy(const std::filesystem::path& path, std::size_t rows, std::size_t dim,
                       std::span<const std::int64_t> data, FileGroup* group) {
  return guarded(path, [&] { return write_npy_impl(path, "<i8", rows, dim, data, group); });
}

FileGroup::~FileGroup() {
  for (const Pending& file : pending_) {
    ::unlink(file.temp.c_str());
    detail::forget_temporary(file.signal_slot);
  }
}

void FileGroup::adopt(std::filesystem::path temp, std::filesystem::path target,
                      int signal_slot) noexcept {
  try {
    pending_.push_back({std::move(temp), std::move(target), signal_slot});
  } catch (...) {  // no room to remember it: the file must not stay behind
    ::unlink(temp.c_str());
    detail::forget_temporary(signal_slot);
  }
}

Result<void> FileGroup::commit() {
  sigset_t held, before;
  sigemptyset(&held);
  sigaddset(&held, SIGINT);
  sigaddset(&held, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &held, &before);
  Result<void> done = {};
  std::size_t renamed = 0;
  for (; renamed < pending_.size(); ++renamed) {
    const Pending& file = pending_[renamed];
    if (::rename(file.temp.c_str(), file.target.c_str()) != 0) {
      const int err = errno;
      done = make_error(ErrorKind::Io, fmt::format("{}: renaming into place failed: {}",
                                                   quoted(file.target), std::strerror(err)));
      // No mixed set: the files already renamed go again (their old versions are gone).
      for (std::size_t before = 0; before < renamed; ++before)
        ::unlink(pending_[before].target.c_str());
      break;
    }
    detail::forget_temporary(file.signal_slot);
  }
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(renamed));
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  return done;
}

}  // namespace gpupool::io
