// The host-simulated device: "device" memory is host memory under a configured capacity.
//
// It is a full backend, not a mock: allocations are real (256-byte aligned host memory), its
// free/total accounting is its own, every pointer it is given is checked against its live
// allocations (so foreign frees, double frees and copies past the end are errors, not crashes),
// and streams are in-order queues whose work either runs at once or, with deferred_streams, waits
// until something synchronizes with it. Fault injection makes out-of-memory deterministic.
module;
#include <algorithm>
#include <cstddef>
#include <expected>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fmt/format.h>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <set>
#include <thread>
#include <unordered_set>
#include <sys/mman.h>
#include <vector>
#include "host_cores.hpp"
#include "host_range.hpp"
module gpupool;

namespace gpupool {

namespace {

constexpr std::size_t kSimulatedAlignment = 256;  // as cudaMalloc guarantees

// A stream: work is queued under the stream's lock and run outside it, oldest first. Shared:
// events recorded on it keep it alive, as CUDA events stay valid after their stream is destroyed.
struct SimulatedStream : std::enable_shared_from_this<SimulatedStream> {
  std::mutex mutex;
  std::deque<std::function<void()>> pending;
  std::uint64_t submitted = 0;  // tickets handed out
  std::uint64_t finished = 0;   // tickets whose work has run
  std::mutex drain_mutex;       // one drainer at a time keeps the order

  // Runs queued work until `ticket` has finished (or everything, for UINT64_MAX). Work already
  // done returns at once, without the drain lock: a stream drained from its own queued work (it
  // waits on an event of a stream that waits on an earlier event of this one) would otherwise
  // wait for itself.
  void drain(std::uint64_t ticket) {
    {
      std::lock_guard lock(mutex);
      if (finished >= ticket) return;
    }
    std::lock_guard drain_lock(drain_mutex);
    for (;;) {
      std::function<void()> work;
      {
        std::lock_guard lock(mutex);
        if (finished >= ticket || pending.empty()) return;
        work = std::move(pending.front());
        pending.pop_front();
      }
      work();
      std::lock_guard lock(mutex);
      ++finished;
    }
  }
};

struct SimulatedEvent {
  std::shared_ptr<SimulatedStream> stream;  // null until recorded: an unrecorded event is complete
  std::uint64_t ticket = 0;
};

class SimulatedBackend final : public DeviceBackend {
 public:
  SimulatedBackend(SimulatedDeviceConfig config, int id) : config_(std::move(config)), id_(id) {
    properties_.name = config_.name;
    properties_.kind = DeviceKind::Simulated;
    properties_.ordinal = id;
    properties_.total_memory = config_.capacity;
    properties_.multiprocessor_count =
        config_.worker_threads > 0 ? config_.worker_threads
                                   : static_cast<int>(std::min<std::size_t>(usable_host_cores(), 1024));
  }

  ~SimulatedBackend() override {
    default_stream_->drain(UINT64_MAX);
    for (auto& [address, size] : allocations_) release_host_block(reinterpret_cast<void*>(address), size);
    for (void* p : pinned_) ::operator delete(p, std::align_val_t{kSimulatedAlignment});
    for (auto& [base, reservation] : reservations_)
      munmap(reinterpret_cast<void*>(base), reservation.bytes);
  }

  const DeviceProperties& properties() const override { return properties_; }

  Result<MemoryInfo> memory_info() override {
    std::lock_guard lock(mutex_);
    return MemoryInfo{capacity_ > used_ ? capacity_ - used_ : 0, capacity_};
  }

  Result<void*> allocate(std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    if (bytes == 0)
      return error(ErrorKind::InvalidInput, "cannot allocate 0 bytes: expected a size of at least 1");
    if (auto fault = injected_fault(bytes)) return std::unexpected(*fault);
    void* ptr = host_block(bytes);
    if (!ptr) return out_of_memory(bytes, "the host could not provide the memory");
    allocations_.emplace(reinterpret_cast<std::uintptr_t>(ptr), bytes);
    used_ += bytes;
    return ptr;
  }

  Result<void> deallocate(void* ptr) override {
    std::lock_guard lock(mutex_);
    auto it = allocations_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == allocations_.end())
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot free pointer {}: it is not a live allocation of this "
                               "device (foreign, already freed, or not the start of a block)",
                               ptr));
    used_ -= it->second;
    release_host_block(ptr, it->second);
    allocations_.erase(it);
    return {};
  }

  Result<void*> allocate_pinned(std::size_t bytes) override {
    if (bytes == 0)
      return error(ErrorKind::InvalidInput, "cannot allocate 0 bytes of pinned host memory");
    void* ptr = ::operator new(bytes, std::align_val_t{kSimulatedAlignment}, std::nothrow);
    if (!ptr)
      return error(ErrorKind::OutOfMemory,
                   fmt::format("the host could not provide {} of pinned memory", format_bytes(bytes)));
    std::lock_guard lock(mutex_);
    pinned_.insert(ptr);
    return ptr;
  }

  Result<void> deallocate_pinned(void* ptr) override {
    std::lock_guard lock(mutex_);
    if (pinned_.erase(ptr) == 0)
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot free pinned pointer {}: not a live pinned allocation", ptr));
    ::operator delete(ptr, std::align_val_t{kSimulatedAlignment});
    return {};
  }

  Result<void*> create_stream() override {
    auto stream = std::make_shared<SimulatedStream>();
    std::lock_guard lock(mutex_);
    streams_.emplace(stream.get(), stream);
    return static_cast<void*>(stream.get());
  }

  void destroy_stream(void* stream) noexcept override {
    // Like cudaStreamDestroy: work already queued still runs; events recorded on it stay valid.
    std::shared_ptr<SimulatedStream> owned;
    {
      std::lock_guard lock(mutex_);
      auto it = streams_.find(stream);
      if (it == streams_.end()) return;
      owned = std::move(it->second);
      streams_.erase(it);
    }
    owned->drain(UINT64_MAX);
  }

  Result<void> check_foreign_stream(void* stream) override {
    std::lock_guard lock(mutex_);
    if (streams_.contains(stream)) return {};
    return error(ErrorKind::InvalidInput,
                 fmt::format("stream {} is not a live stream of simulated device {}: expected "
                             "the native() of a stream it made, or nullptr for its default stream",
                             stream, id_));
  }

  Result<void> synchronize_stream(void* stream) override {
    stream_of(stream).drain(UINT64_MAX);
    return {};
  }

  Result<void> synchronize() override {  // every stream, as cudaDeviceSynchronize
    std::vector<std::shared_ptr<SimulatedStream>> streams{default_stream_};
    {
      std::lock_guard lock(mutex_);
      for (auto& [handle, stream] : streams_) streams.push_back(stream);
    }
    for (auto& stream : streams) stream->drain(UINT64_MAX);
    return {};
  }

  Result<void*> create_event() override { return static_cast<void*>(new SimulatedEvent); }
  void destroy_event(void* event) noexcept override { delete static_cast<SimulatedEvent*>(event); }

  Result<void> record_event(void* event, void* stream) override {
    SimulatedStream& s = stream_of(stream);
    auto* e = static_cast<SimulatedEvent*>(event);
    std::lock_guard lock(s.mutex);
    e->stream = s.shared_from_this();
    e->ticket = s.submitted;
    return {};
  }

  Result<bool> event_completed(void* event) override {
    auto* e = static_cast<SimulatedEvent*>(event);
    if (!e->stream) return true;
    std::lock_guard lock(e->stream->mutex);
    return e->stream->finished >= e->ticket;
  }

  Result<void> synchronize_event(void* event) override {
    auto* e = static_cast<SimulatedEvent*>(event);
    if (e->stream) e->stream->drain(e->ticket);
    return {};
  }

  Result<void> stream_wait_event(void* stream, void* event) override {
    auto* e = static_cast<SimulatedEvent*>(event);
    if (!e->stream) return {};
    std::shared_ptr<SimulatedStream> source = e->stream;
    SimulatedStream& waiting = stream_of(stream);
    // An event of the same stream is behind its work already (and draining the stream from its
    // own work would wait for itself).
    if (source.get() == &waiting) return {};
    std::uint64_t ticket = e->ticket;
    return enqueue(waiting, [source, ticket] { source->drain(ticket); });
  }

  Result<void> copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    void* stream) override {
    bool dst_on_device = kind != CopyKind::DeviceToHost;
    bool src_on_device = kind != CopyKind::HostToDevice;
    if (dst_on_device)
      if (auto ok = check_range(dst, bytes, "copy destination"); !ok) return ok;
    if (src_on_device)
      if (auto ok = check_range(src, bytes, "copy source"); !ok) return ok;
    return enqueue(stream_of(stream), [=] { std::memmove(dst, src, bytes); });
  }

  Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes, void* stream) override {
    if (auto ok = check_range(dst, bytes, "fill destination"); !ok) return ok;
    return enqueue(stream_of(stream), [=] { std::memset(dst, value, bytes); });
  }

  Result<void> enqueue_host_work(void* stream, std::function<void()> work) override {
    return enqueue(stream_of(stream), std::move(work));
  }

  // ---- virtual memory: host address space reserved inaccessible, pages made accessible when
  // mapped and inaccessible again when unmapped, so a stray access to an unmapped page faults.

  std::size_t page_bytes() const noexcept override { return config_.page_bytes; }

  Result<void*> reserve_addresses(std::size_t bytes) override {
    const std::size_t page = config_.page_bytes;
    if (bytes == 0 || bytes % page != 0)
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot reserve {} of addresses: expected a positive multiple of "
                               "the page, {}", format_bytes(bytes), format_bytes(page)));
    // Over-reserved by a page, then trimmed, so the range starts on a page boundary.
    void* mapped = mmap(nullptr, bytes + page, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapped == MAP_FAILED)
      return error(ErrorKind::OutOfMemory,
                   fmt::format("the host could not reserve {} of addresses", format_bytes(bytes)));
    const auto start = reinterpret_cast<std::uintptr_t>(mapped);
    const std::uintptr_t base = (start + page - 1) / page * page;
    if (base > start) munmap(mapped, base - start);
    if (const std::uintptr_t end = start + bytes + page; end > base + bytes)
      munmap(reinterpret_cast<void*>(base + bytes), end - (base + bytes));
    std::lock_guard lock(mutex_);
    reservations_.emplace(base, Reservation{bytes, std::vector<std::uint64_t>(bytes / page, 0),
                                            std::vector<std::vector<int>>(bytes / page)});
    return reinterpret_cast<void*>(base);
  }

  void release_addresses(void* base, std::size_t bytes) noexcept override {
    std::lock_guard lock(mutex_);
    auto it = reservations_.find(reinterpret_cast<std::uintptr_t>(base));
    if (it == reservations_.end() || it->second.bytes != bytes) return;
    for (std::uint64_t handle : it->second.pages)
      if (handle) drop_mapping(handle);
    munmap(base, bytes);
    reservations_.erase(it);
  }

  Result<PhysicalPage> create_page() override {
    std::lock_guard lock(mutex_);
    if (auto fault = injected_fault(config_.page_bytes)) return std::unexpected(*fault);
    used_ += config_.page_bytes;
    const std::uint64_t handle = next_page_++;
    pages_.insert(handle);
    return PhysicalPage{handle};
  }

  void release_page(PhysicalPage page) noexcept override {
    std::lock_guard lock(mutex_);
    // As on CUDA, a page released while mapped lives until it is unmapped.
    if (pages_.erase(page.handle) == 1 && !mapped_pages_.contains(page.handle))
      used_ -= config_.page_bytes;
  }

  Result<void> map_pages(void* address, std::span<const PhysicalPage> pages) override {
    std::lock_guard lock(mutex_);
    auto found = find_pages(address, pages.size(), "map");
    if (!found) return std::unexpected(found.error());
    auto [reservation, first] = *found;
    for (std::size_t i = 0; i < pages.size(); ++i) {
      if (reservation->pages[first + i])
        return error(ErrorKind::InvalidInput,
                     fmt::format("cannot map page {} of the range at {}: a page is mapped there "
                                 "already; unmap it first", first + i, address));
      if (!pages_.contains(pages[i].handle) || mapped_pages_.contains(pages[i].handle))
        return error(ErrorKind::InvalidInput,
                     fmt::format("cannot map physical page {}: it is not a live, unmapped page "
                                 "of this device", pages[i].handle));
    }
    if (mprotect(address, pages.size() * config_.page_bytes, PROT_READ | PROT_WRITE) != 0)
      return error(ErrorKind::OutOfMemory, "the host refused to make the mapped pages accessible");
    for (std::size_t i = 0; i < pages.size(); ++i) {
      reservation->pages[first + i] = pages[i].handle;
      mapped_pages_.insert(pages[i].handle);
    }
    return {};
  }

  Result<void> unmap_pages(void* address, std::size_t count) override {
    std::lock_guard lock(mutex_);
    auto found = find_pages(address, count, "unmap");
    if (!found) return std::unexpected(found.error());
    auto [reservation, first] = *found;
    for (std::size_t i = 0; i < count; ++i)
      if (!reservation->pages[first + i])
        return error(ErrorKind::InvalidInput,
                     fmt::format("cannot unmap page {} of the range at {}: it is not mapped",
                                 first + i, address));
    const std::size_t bytes = count * config_.page_bytes;
    (void)madvise(address, bytes, MADV_DONTNEED);  // the host takes the memory back
    (void)mprotect(address, bytes, PROT_NONE);
    for (std::size_t i = 0; i < count; ++i) {
      drop_mapping(reservation->pages[first + i]);
      reservation->pages[first + i] = 0;
      reservation->accessors[first + i].clear();  // a mapping's access ends with it
    }
    return {};
  }

  // ---- peers: any two simulated devices reach each other's memory once enabled (it is all host
  // memory; what is modelled is who was allowed).

  bool can_access_peer(const DeviceBackend& peer) const override {
    return peer.properties().kind == DeviceKind::Simulated;
  }

  Result<void> enable_peer_access(const DeviceBackend& peer) override {
    if (!can_access_peer(peer))
      return error(ErrorKind::InvalidInput,
                   fmt::format("simulated device {} cannot reach the memory of '{}': peer access "
                               "is between simulated devices only", id_, peer.properties().name));
    if (&peer == this) return {};
    std::lock_guard lock(mutex_);
    peers_.insert(peer.properties().ordinal);
    return {};
  }

  bool peer_access_enabled(const DeviceBackend& peer) const override {
    if (&peer == this) return true;
    std::lock_guard lock(mutex_);
    return peers_.contains(peer.properties().ordinal);
  }

  Result<void> grant_access(void* address, std::size_t bytes,
                            const DeviceBackend& accessor) override {
    if (!can_access_peer(accessor))
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot let '{}' reach pages of simulated device {}: peer access "
                               "is between simulated devices only", accessor.properties().name, id_));
    const std::size_t page = config_.page_bytes;
    if (bytes == 0 || bytes % page != 0)
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot grant access to {} at {}: expected a positive multiple of "
                               "the page, {}", format_bytes(bytes), address, format_bytes(page)));
    std::lock_guard lock(mutex_);
    auto found = find_pages(address, bytes / page, "grant access to");
    if (!found) return std::unexpected(found.error());
    auto [reservation, first] = *found;
    for (std::size_t i = first; i < first + bytes / page; ++i)
      if (!reservation->pages[i])
        return error(ErrorKind::InvalidInput,
                     fmt::format("cannot grant access to page {} of the range at {}: it is not "
                                 "mapped", i, address));
    const int who = accessor.properties().ordinal;
    for (std::size_t i = first; i < first + bytes / page; ++i) {
      std::vector<int>& granted = reservation->accessors[i];
      if (std::find(granted.begin(), granted.end(), who) == granted.end()) granted.push_back(who);
    }
    return {};
  }

  Result<bool> accessible_from(const void* address, const DeviceBackend& accessor) override {
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    {
      std::lock_guard lock(mutex_);
      if (auto mapped = mapped_range(at, 1)) {  // in a reserved range: granted page by page
        if (!*mapped)
          return error(ErrorKind::InvalidInput,
                       fmt::format("{} is an unmapped page of simulated device {}", address, id_));
        if (&accessor == this) return true;
        auto it = std::prev(reservations_.upper_bound(at));
        const std::vector<int>& granted =
            it->second.accessors[(at - it->first) / config_.page_bytes];
        return std::find(granted.begin(), granted.end(), accessor.properties().ordinal) !=
               granted.end();
      }
      auto it = allocations_.upper_bound(at);
      if (it == allocations_.begin() || at >= std::prev(it)->first + std::prev(it)->second)
        return error(ErrorKind::InvalidInput,
                     fmt::format("{} is not memory of simulated device {}", address, id_));
    }
    if (&accessor == this) return true;
    return accessor.peer_access_enabled(*this);  // outside this device's lock: it takes its own
  }

  Result<void> set_capacity(std::size_t bytes) override {
    if (bytes == 0)
      return error(ErrorKind::InvalidInput, "simulated capacity 0: expected at least 1 byte");
    std::lock_guard lock(mutex_);
    capacity_ = bytes;
    properties_.total_memory = bytes;
    return {};
  }

  Result<void> set_faults(FaultInjection faults) override {
    if (faults.fail_nth_allocation && *faults.fail_nth_allocation == 0)
      return error(ErrorKind::InvalidInput,
                   "fail_nth_allocation is 0: expected 1 for the next allocation, 2 for the one "
                   "after, ...");
    std::lock_guard lock(mutex_);
    faults_ = faults;
    fault_target_ = faults.fail_nth_allocation ? allocation_number_ + *faults.fail_nth_allocation : 0;
    return {};
  }

 private:
  std::unexpected<GpuError> error(ErrorKind kind, std::string message) const {
    return std::unexpected(GpuError(kind, std::move(message), id_));
  }

  // Caller holds mutex_.
  std::unexpected<GpuError> out_of_memory(std::size_t bytes, std::string_view why) const {
    return error(ErrorKind::OutOfMemory,
                 fmt::format("{}: requested {}, free {} of {}", why, format_bytes(bytes),
                             format_bytes(capacity_ > used_ ? capacity_ - used_ : 0),
                             format_bytes(capacity_)));
  }

  // An allocation or a page is about to be made: the injected fault or the lack of capacity that
  // refuses it, counting the attempt. Caller holds mutex_.
  std::optional<GpuError> injected_fault(std::size_t bytes) {
    ++allocation_number_;
    std::optional<std::unexpected<GpuError>> refused;
    if (faults_.fail_nth_allocation && allocation_number_ == fault_target_)
      refused = out_of_memory(bytes, fmt::format("injected fault: allocation #{} fails",
                                                 *faults_.fail_nth_allocation));
    else if (faults_.fail_above_bytes && bytes > *faults_.fail_above_bytes)
      refused = out_of_memory(bytes, fmt::format("injected fault: allocations above {} fail",
                                                 format_bytes(*faults_.fail_above_bytes)));
    else if (bytes > capacity_ || used_ > capacity_ - bytes)
      refused = out_of_memory(bytes, "not enough simulated device memory");
    if (!refused) return std::nullopt;
    return refused->error();
  }

  // A page's mapping is gone; a page released while mapped is freed now. Caller holds mutex_.
  void drop_mapping(std::uint64_t handle) {
    mapped_pages_.erase(handle);
    if (!pages_.contains(handle)) used_ -= config_.page_bytes;
  }

  struct Reservation {
    std::size_t bytes;
    std::vector<std::uint64_t> pages;  // the physical page mapped at each page, 0 where none
    std::vector<std::vector<int>> accessors;  // per page: the other devices granted it while mapped
  };

  // The reservation holding `count` pages from `address` and the first one's index. Caller holds
  // mutex_.
  Result<std::pair<Reservation*, std::size_t>> find_pages(void* address, std::size_t count,
                                                          std::string_view what) {
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    const std::size_t page = config_.page_bytes;
    auto it = reservations_.upper_bound(at);
    if (count == 0 || at % page != 0 || it == reservations_.begin())
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot {} {} pages at {}: expected at least one page at a page "
                               "boundary of a reserved range", what, count, address));
    --it;
    const std::size_t first = (at - it->first) / page;
    if (at >= it->first + it->second.bytes || count > it->second.pages.size() - first)
      return error(ErrorKind::InvalidInput,
                   fmt::format("cannot {} {} pages at {}: they run past the reserved range", what,
                               count, address));
    return std::pair{&it->second, first};
  }

  // Whether [address, address + bytes) lies in a reserved range with every page mapped; nullopt
  // when it is in no reserved range. Caller holds mutex_.
  std::optional<bool> mapped_range(std::uintptr_t address, std::size_t bytes) const {
    auto it = reservations_.upper_bound(address);
    if (it == reservations_.begin()) return std::nullopt;
    --it;
    if (address >= it->first + it->second.bytes) return std::nullopt;
    if (bytes > it->first + it->second.bytes - address) return false;
    const std::size_t page = config_.page_bytes;
    for (std::size_t i = (address - it->first) / page; i * page < address - it->first + bytes; ++i)
      if (!it->second.pages[i]) return false;
    return true;
  }

  SimulatedStream& stream_of(void* stream) {
    return stream ? *static_cast<SimulatedStream*>(stream) : *default_stream_;
  }

  Result<void> enqueue(SimulatedStream& stream, std::function<void()> work) {
    {
      std::lock_guard lock(stream.mutex);
      stream.pending.push_back(std::move(work));
      ++stream.submitted;
    }
    if (!config_.deferred_streams) stream.drain(UINT64_MAX);
    return {};
  }

  // The host memory behind a device allocation: from the reserved range when there is one and it
  // has a fitting gap, else from the heap (so the range never makes an allocation fail).
  void* host_block(std::size_t bytes) {
    if (reserved_)
      if (auto block = reserved_->take(bytes)) return *block;
    return ::operator new(bytes, std::align_val_t{kSimulatedAlignment}, std::nothrow);
  }
  void release_host_block(void* ptr, std::size_t bytes) {
    if (reserved_ && reserved_->holds(ptr))
      reserved_->give_back(ptr, bytes);
    else
      ::operator delete(ptr, std::align_val_t{kSimulatedAlignment});
  }

  // [ptr, ptr + bytes) must lie inside one live allocation.
  Result<void> check_range(const void* ptr, std::size_t bytes, std::string_view what) {
    std::lock_guard lock(mutex_);
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    if (auto mapped = mapped_range(address, bytes)) {
      if (*mapped) return {};
      return error(ErrorKind::InvalidInput,
                   fmt::format("{} {} + {} reaches a page of a reserved range that is not mapped",
                               what, ptr, format_bytes(bytes)));
    }
    auto it = allocations_.upper_bound(address);
    if (it != allocations_.begin()) {
      --it;
      std::uintptr_t base = it->first;
      std::size_t size = it->second;
      if (address < base + size) {
        if (bytes <= base + size - address) return {};
        return error(ErrorKind::InvalidInput,
                     fmt::format("{} {} + {} runs past the end of its allocation ({} at {}): "
                                 "expected at most {}", what, ptr, format_bytes(bytes),
                                 format_bytes(size), reinterpret_cast<void*>(base),
                                 format_bytes(base + size - address)));
      }
    }
    return error(ErrorKind::InvalidInput,
                 fmt::format("{} {} is not inside a live allocation of this device", what, ptr));
  }

  SimulatedDeviceConfig config_;
  int id_;
  DeviceProperties properties_;
  mutable std::mutex mutex_;  // guards the accounting below
  std::unordered_set<int> peers_;  // the simulated devices (ordinals) this one may reach
  std::size_t capacity_ = config_.capacity;
  std::size_t used_ = 0;
  std::map<std::uintptr_t, std::size_t> allocations_;  // base address -> size, for range checks
  // With reserved_memory: twice the capacity, so first fit rarely finds the range too fragmented.
  std::unique_ptr<detail::HostRange> reserved_ =
      config_.reserved_memory ? std::make_unique<detail::HostRange>(2 * config_.capacity) : nullptr;
  std::unordered_set<void*> pinned_;
  std::map<std::uintptr_t, Reservation> reservations_;  // by base address
  std::unordered_set<std::uint64_t> pages_;             // live physical pages
  std::unordered_set<std::uint64_t> mapped_pages_;      // those mapped somewhere
  std::uint64_t next_page_ = 1;
  FaultInjection faults_;
  std::uint64_t allocation_number_ = 0;  // allocations attempted so far
  std::uint64_t fault_target_ = 0;       // the allocation number that fails
  std::shared_ptr<SimulatedStream> default_stream_ = std::make_shared<SimulatedStream>();
  std::map<void*, std::shared_ptr<SimulatedStream>> streams_;  // created streams, by handle (under mutex_)
};

}  // namespace

std::shared_ptr<DeviceBackend> make_simulated_backend(SimulatedDeviceConfig config, int id) {
  return std::make_shared<SimulatedBackend>(std::move(config), id);
}

}  // namespace gpupool
