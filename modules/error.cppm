// gpupool:error — the one error model of the library.
//
// Every public function that can fail returns Result<T> = std::expected<T, GpuError>; no exception
// crosses the public API. Out-of-memory is a kind of its own (never recognised by matching strings),
// and CUDA / cuBLAS statuses are kept next to the mapped kind so nothing is lost.
module;
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
export module gpupool:error;

export namespace gpupool {

enum class ErrorKind : std::uint8_t {
  InvalidInput,       // an argument is wrong: the message names it, its value and what was expected
  OutOfMemory,        // the device (real or simulated) could not provide the bytes
  PoolLimitExceeded,  // the pool's own hard limit for the device would be passed
  DeviceUnavailable,  // no such device, or the library was built without its backend
  Cuda,               // a CUDA runtime error other than out-of-memory
  Cublas,             // a cuBLAS error other than out-of-memory
  Unsupported,        // the operation exists but not for this device, precision or build
  InvalidState,       // the call is valid but not now (foreign or double return, used-up handle)
  Io,                 // reading or writing a file failed
  Internal,           // a broken invariant inside gpupool: a bug, please report it
};

inline constexpr ErrorKind kAllErrorKinds[] = {
    ErrorKind::InvalidInput, ErrorKind::OutOfMemory, ErrorKind::PoolLimitExceeded,
    ErrorKind::DeviceUnavailable, ErrorKind::Cuda, ErrorKind::Cublas, ErrorKind::Unsupported,
    ErrorKind::InvalidState, ErrorKind::Io, ErrorKind::Internal};

constexpr std::string_view to_string(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::InvalidInput: return "invalid input";
    case ErrorKind::OutOfMemory: return "out of memory";
    case ErrorKind::PoolLimitExceeded: return "pool limit exceeded";
    case ErrorKind::DeviceUnavailable: return "device unavailable";
    case ErrorKind::Cuda: return "CUDA error";
    case ErrorKind::Cublas: return "cuBLAS error";
    case ErrorKind::Unsupported: return "unsupported";
    case ErrorKind::InvalidState: return "invalid state";
    case ErrorKind::Io: return "I/O error";
    case ErrorKind::Internal: return "internal error";
  }
  return "unknown error";
}

// Which library a native status code came from: a cudaError_t of the CUDA runtime, a
// cublasStatus_t, or a CUresult of the CUDA driver (its virtual-memory calls).
enum class StatusSource : std::uint8_t { Cuda, Cublas, CudaDriver };

struct NativeStatus {
  StatusSource source;
  int code;
  friend bool operator==(const NativeStatus&, const NativeStatus&) = default;
};

class GpuError {
 public:
  GpuError(ErrorKind kind, std::string message, std::optional<int> device = std::nullopt,
           std::optional<NativeStatus> status = std::nullopt)
      : kind_(kind), message_(std::move(message)), device_(device), status_(status) {}

  ErrorKind kind() const noexcept { return kind_; }
  const std::string& message() const noexcept { return message_; }
  // The device the error happened on (a Device::id()), when it concerns one.
  std::optional<int> device() const noexcept { return device_; }
  // The CUDA runtime, cuBLAS or CUDA driver status behind the error, when there is one.
  std::optional<NativeStatus> native_status() const noexcept { return status_; }

  bool is_out_of_memory() const noexcept {
    return kind_ == ErrorKind::OutOfMemory || kind_ == ErrorKind::PoolLimitExceeded;
  }

  // "out of memory on device 0: requested 1.0 GiB, ..." — kind, device, message and status.
  std::string to_string() const {
    std::string text{gpupool::to_string(kind_)};
    if (device_) text += " on device " + std::to_string(*device_);
    text += ": " + message_;
    if (status_) {
      switch (status_->source) {
        case StatusSource::Cuda: text += " (CUDA status "; break;
        case StatusSource::Cublas: text += " (cuBLAS status "; break;
        case StatusSource::CudaDriver: text += " (CUDA driver status "; break;
      }
      text += std::to_string(status_->code) + ")";
    }
    return text;
  }

  // Prefixes context ("while uploading queries: ...") and keeps everything else.
  GpuError with_context(std::string_view context) const {
    GpuError copy = *this;
    copy.message_ = std::string(context) + ": " + message_;
    return copy;
  }

 private:
  ErrorKind kind_;
  std::string message_;
  std::optional<int> device_;
  std::optional<NativeStatus> status_;
};

template <class T>
using Result = std::expected<T, GpuError>;

inline std::unexpected<GpuError> make_error(ErrorKind kind, std::string message,
                                            std::optional<int> device = std::nullopt) {
  return std::unexpected(GpuError(kind, std::move(message), device));
}

}  // namespace gpupool
