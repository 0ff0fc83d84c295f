// The fragmentation model: pool_bench's fragmentation traces replayed through the pool's own
// SegmentArena and VirtualPages (pool/segment_arena.cppm, pool/virtual_pages.cppm, made headers by
// build.sh) and a copy of the thread cache's policy (pool/thread_cache.cppm), for one thread on
// the default stream of virtual segments. No device, no locks: it says where the waste sits at the
// peak and what another placement or page size would give, which pool_bench cannot. With the
// defaults it gives pool_bench's gpupool/virtual figures (and the page budget's moves: `trims`).
//
//   tools/fragmentation_model/build.sh && /tmp/fragmentation_model [options] [trace.csv ...]
//   --slack S        the page budget (PoolConfig::virtual_page_slack; default 0.01); --no-moves: none
//   --no-thread-cache
//   --page KIB       the page (default 2048)
//   --placement P    best | first | pages | mapped: an exact arena instead of the pool's good fit
//                    (best fit; address-ordered first fit; fewest pages newly touched; fewest
//                    unmapped pages), each trying both ends of a span
//   --ideal          also the peak if every whole free page moved at once, and the holes then
//   --repeat N       run each trace N times on one pool, the figures of the last run
// Recorded traces are gpupool replay's CSV (bench/data/traces/*.csv.gz, decompressed).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>
#include "virtual_pages.hpp"

using namespace gpupool;
namespace sc = gpupool::size_classes;

// ---- the traces (bench/pool_benchmark.cpp) --------------------------------------------------------
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};
struct TraceOp { std::uint32_t slot; std::uint64_t bytes; };

std::vector<TraceOp> random_trace(std::uint64_t seed, std::size_t ops) {
  constexpr std::size_t kMaxLive = 1000;
  constexpr std::uint64_t kMaxBytes = 4ull << 20;
  SplitMix64 rng{seed};
  std::vector<std::uint32_t> live, free_slots;
  for (std::uint32_t s = kMaxLive; s-- > 0;) free_slots.push_back(s);
  std::vector<TraceOp> trace;
  while (trace.size() < ops) {
    bool alloc = live.empty() || (live.size() < kMaxLive && (rng.next() & 1));
    if (alloc) {
      std::uint32_t slot = free_slots.back(); free_slots.pop_back(); live.push_back(slot);
      trace.push_back({slot, 1 + rng.next() % kMaxBytes});
    } else {
      std::size_t index = rng.next() % live.size();
      std::uint32_t slot = live[index]; live[index] = live.back(); live.pop_back();
      free_slots.push_back(slot); trace.push_back({slot, 0});
    }
  }
  for (std::uint32_t slot : live) trace.push_back({slot, 0});
  return trace;
}
std::vector<TraceOp> ann_serving_trace(std::uint64_t seed, std::size_t bursts) {
  SplitMix64 rng{seed};
  std::vector<TraceOp> trace;
  auto shard_bytes = [&] { return (96ull << 20) + (rng.next() % 65) * (1ull << 20); };
  for (std::uint32_t shard = 0; shard < 4; ++shard) trace.push_back({shard, shard_bytes()});
  for (std::size_t burst = 0; burst < bursts; ++burst) {
    if (burst % 200 == 199) {
      auto shard = static_cast<std::uint32_t>(rng.next() % 4);
      trace.push_back({shard, 0}); trace.push_back({shard, shard_bytes()});
    }
    std::size_t count = 8 + rng.next() % 57;
    for (std::uint32_t i = 0; i < count; ++i) {
      std::uint64_t batch = 1 + rng.next() % 1024, bytes = 0;
      switch (rng.next() % 3) {
        case 0: bytes = batch * 128 * 4; break;
        case 1: bytes = batch * 4096 * 4; break;
        default: bytes = batch * 100 * 8; break;
      }
      trace.push_back({4 + i, bytes});
    }
    for (std::uint32_t i = 0; i < count; ++i) trace.push_back({4 + i, 0});
  }
  for (std::uint32_t shard = 0; shard < 4; ++shard) trace.push_back({shard, 0});
  return trace;
}
std::vector<TraceOp> csv_trace(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  std::vector<TraceOp> ops;
  std::map<std::uint64_t, std::uint32_t> slot_of;
  std::vector<std::uint32_t> free_slots;  // min-heap
  std::uint32_t slots = 0;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string x;
    while (std::getline(ss, x, ',')) f.push_back(x);
    std::uint64_t id = std::stoull(f[4]), bytes = std::stoull(f[5]);
    if (f[2] == "alloc" && bytes > 0 && !slot_of.contains(id)) {
      std::uint32_t slot = slots;
      if (free_slots.empty()) ++slots;
      else { std::pop_heap(free_slots.begin(), free_slots.end(), std::greater<>()); slot = free_slots.back(); free_slots.pop_back(); }
      slot_of[id] = slot;
      ops.push_back({slot, bytes});
    } else if (f[2] == "free") {
      auto it = slot_of.find(id);
      if (it == slot_of.end()) continue;
      ops.push_back({it->second, 0});
      free_slots.push_back(it->second); std::push_heap(free_slots.begin(), free_slots.end(), std::greater<>());
      slot_of.erase(it);
    }
  }
  for (auto& [id, slot] : slot_of) ops.push_back({slot, 0});
  return ops;
}


// ---- an arena with exact placement (O(spans) a take: for measuring, not for shipping) ------------
enum class Placement { good_fit, best, first, pages, mapped };
Placement placement = Placement::good_fit;
struct AltArena {
  struct Blk { void* ptr; std::uint32_t span; };
  std::size_t P = 2 << 20;
  std::map<std::uintptr_t, std::size_t> free_;   // address -> bytes
  std::map<std::uintptr_t, std::size_t> taken_;  // address -> bytes
  std::vector<std::uintptr_t> span_addr; std::vector<std::uint32_t> unused;
  std::uintptr_t seg_lo = 0, seg_hi = 0;
  void add_segment(void* base, std::size_t bytes) { auto a = reinterpret_cast<std::uintptr_t>(base); free_[a] = bytes; seg_lo = a; seg_hi = a + bytes; }
  std::size_t new_pages(std::uintptr_t s, std::uintptr_t e, std::uintptr_t a, std::size_t b) const {
    std::size_t first = a / P, last = (a + b - 1) / P;
    std::size_t n = last - first + 1;
    bool shared_front = (s % P) && first == s / P;
    bool shared_back = (e % P) && last == (e - 1) / P;
    if (shared_front) --n;
    if (shared_back && !(shared_front && first == last)) --n;
    return n;
  }
  std::function<std::size_t(std::uintptr_t, std::size_t)> unmapped_cost;
  template <class F> void for_each_free_range(F&& f) const { for (auto& [a, b] : free_) f(a, b); }
  std::optional<Blk> take(std::size_t bytes) {
    std::uintptr_t best_a = 0, best_s = 0; std::size_t best_span = SIZE_MAX, best_cost = SIZE_MAX; bool found = false;
    for (auto& [s, len] : free_) {
      if (len < bytes) continue;
      std::uintptr_t e = s + len;
      auto consider = [&](std::uintptr_t a) {
        std::size_t cost = 0;
        if (placement == Placement::pages) cost = new_pages(s, e, a, bytes);
        if (placement == Placement::mapped) cost = unmapped_cost(a, bytes);
        std::size_t key2 = placement == Placement::first ? 0 : len;
        if (!found || cost < best_cost || (cost == best_cost && key2 < best_span)) { found = true; best_cost = cost; best_span = key2; best_a = a; best_s = s; }
      };
      consider(s);
      if (len > bytes && e != seg_hi) consider(e - bytes);
      if (placement == Placement::first && found) break;
    }
    if (!found) return std::nullopt;
    std::size_t len = free_[best_s]; std::uintptr_t e = best_s + len;
    free_.erase(best_s);
    if (best_a > best_s) free_[best_s] = best_a - best_s;
    if (best_a + bytes < e) free_[best_a + bytes] = e - best_a - bytes;
    taken_[best_a] = bytes;
    std::uint32_t id;
    if (!unused.empty()) { id = unused.back(); unused.pop_back(); span_addr[id] = best_a; } else { id = span_addr.size(); span_addr.push_back(best_a); }
    return Blk{reinterpret_cast<void*>(best_a), id};
  }
  void give_back(std::uint32_t id) {
    std::uintptr_t a = span_addr[id]; unused.push_back(id);
    std::size_t b = taken_[a]; taken_.erase(a);
    auto next = free_.find(a + b);
    if (next != free_.end()) { b += next->second; free_.erase(next); }
    auto it = free_.lower_bound(a);
    if (it != free_.begin()) { auto prev = std::prev(it); if (prev->first + prev->second == a) { prev->second += b; return; } }
    free_[a] = b;
  }
};

// ---- the thread cache's policy (pool/thread_cache.cppm): one thread, no lock ----------------------
struct Block { std::uintptr_t ptr; bool carved; std::size_t bytes; std::uint32_t size_class; std::uint32_t span; };
struct Cache {
  static constexpr int kSlots = 4, kEntries = 16;
  static constexpr std::size_t kMaxBytes = std::size_t{4} << 20;
  std::size_t max_bytes = kMaxBytes;
  struct Entry { int count = 0; std::uint64_t last_use = 0; std::array<Block, kSlots> blocks; };
  std::array<std::uint32_t, kEntries> classes; std::array<Entry, kEntries> entries{};
  std::uint32_t nonempty = 0; std::uint64_t clock = 0; std::uint32_t last_missed = UINT32_MAX;
  std::size_t held_bytes = 0, held_blocks = 0;
  Cache() { classes.fill(UINT32_MAX); }
  int find(std::uint32_t c) { for (int e = 0; e < kEntries; ++e) if (classes[e] == c) return e; return -1; }
  Block remove(int e, int i) { Entry& en = entries[e]; Block b = en.blocks[i]; en.blocks[i] = en.blocks[--en.count]; if (!en.count) nonempty &= ~(1u << e); held_bytes -= b.bytes; --held_blocks; return b; }
  std::optional<Block> take(std::uint32_t c, std::size_t least) {
    if (int e = held_blocks ? find(c) : -1; e >= 0)
      for (int i = entries[e].count - 1; i >= 0; --i)
        if (entries[e].blocks[i].bytes >= least) return remove(e, i);
    last_missed = c;
    return std::nullopt;
  }
  int evict_coldest(int keep, std::vector<Block>& ev) {
    int coldest = -1;
    for (std::uint32_t bits = nonempty; bits; bits &= bits - 1) { int e = __builtin_ctz(bits); if (e != keep && (coldest < 0 || entries[e].last_use < entries[coldest].last_use)) coldest = e; }
    if (coldest < 0) { ev.push_back(remove(keep, 0)); return keep; }
    while (entries[coldest].count) ev.push_back(remove(coldest, entries[coldest].count - 1));
    return coldest;
  }
  bool put(const Block& b, std::vector<Block>& ev) {
    if (max_bytes == 0) return false;
    bool full = held_bytes + b.bytes > max_bytes && held_blocks;
    if (full && b.carved && b.size_class != last_missed) return false;
    int e = find(b.size_class);
    if (e >= 0 && entries[e].count == kSlots) return false;
    if (full) while (held_blocks && held_bytes + b.bytes > max_bytes) evict_coldest(e, ev);
    if (e < 0) { std::uint32_t empty = ~nonempty & ((1u << kEntries) - 1); e = empty ? __builtin_ctz(empty) : evict_coldest(-1, ev); classes[e] = b.size_class; }
    Entry& en = entries[e]; en.blocks[en.count++] = b; en.last_use = ++clock; nonempty |= 1u << e; held_bytes += b.bytes; ++held_blocks;
    return true;
  }
};


// ---- one pool of virtual segments --------------------------------------------------------------

struct Options {
  std::optional<double> slack = 0.01;
  bool thread_cache = true;
  std::size_t page = std::size_t{2} << 20;
  bool ideal = false;
  int repeat = 1;
};

// Where the reserved bytes are at one moment.
struct Breakdown {
  std::size_t reserved = 0, requested = 0, in_use = 0, thread_cache = 0, small_cached = 0;
  std::size_t whole_free_pages = 0, shared_free = 0;
};

template <class Arena>
struct Model {
  Options opt;
  Arena arena;
  VirtualPages pages;
  Cache cache;
  std::map<std::uint32_t, std::vector<std::uintptr_t>> small_bins;  // blocks of 4 KiB and less
  std::size_t small_reserved = 0, small_cached = 0, in_use = 0, requested = 0;
  std::size_t most_in_use = 0, most_reserved = 0;
  std::uintptr_t next_small = std::uintptr_t{1} << 50;
  std::uint64_t moves = 0, pages_mapped = 0, pages_unmapped = 0;
  struct Live { Block block; std::size_t requested; };
  std::vector<std::optional<Live>> slots;

  explicit Model(Options o) : opt(o), pages(o.page) {
    if constexpr (requires { arena.P; }) {
      arena.P = o.page;
      arena.unmapped_cost = [this](std::uintptr_t a, std::size_t b) { return pages.unmapped_count(a, b); };
    }
    if (!opt.thread_cache) cache.max_bytes = 0;
    void* base = reinterpret_cast<void*>(std::uintptr_t{1} << 40);
    pages.add_range(base, std::size_t{80} << 30);
    arena.add_segment(base, std::size_t{80} << 30);
  }
  std::size_t reserved() const { return pages.mapped_bytes() + small_reserved; }

  // DevicePool::try_take_virtual with the page budget (pool/virtual_segments.cpp).
  Block carve(std::uint32_t size_class, std::size_t bytes) {
    auto taken = arena.take(bytes);
    const auto address = reinterpret_cast<std::uintptr_t>(taken->ptr);
    const std::vector<std::uintptr_t> needed = pages.unmapped_in(address, bytes);
    if (!needed.empty() && opt.slack) {
      const std::size_t most = std::max(most_in_use, in_use + bytes);
      const std::size_t limit =
          std::max(static_cast<std::size_t>((1 + std::max(0.0, *opt.slack)) * most), most_reserved);
      const std::size_t after = reserved() + needed.size() * opt.page;
      if (after > limit) {
        const std::size_t count = (after - most + opt.page - 1) / opt.page;
        std::vector<std::uintptr_t> free = pages.free_mapped_pages(arena, SIZE_MAX);
        std::reverse(free.begin(), free.end());  // the highest first
        if (free.size() > count) free.resize(count);
        if (!free.empty()) ++moves;
        for (std::uintptr_t page : free) pages.set_unmapped(page), ++pages_unmapped;
      }
    }
    for (std::uintptr_t page : needed) pages.set_mapped(page, {}), ++pages_mapped;
    most_reserved = std::max(most_reserved, reserved());
    return {address, true, bytes, size_class, taken->span};
  }
  void alloc(std::uint32_t slot, std::size_t request) {
    const std::uint32_t c = sc::class_of(request);
    const bool carved = request > sc::kVirtualArenaThreshold;
    const std::size_t bytes = carved ? (request + 255) / 256 * 256 : sc::class_bytes(c);
    Block block;
    if (auto hit = cache.take(c, bytes)) {
      block = *hit;
    } else if (carved) {
      block = carve(c, bytes);
    } else {
      auto& bin = small_bins[c];
      std::uintptr_t ptr;
      if (!bin.empty()) ptr = bin.back(), bin.pop_back(), small_cached -= bytes;
      else ptr = next_small, next_small += bytes, small_reserved += bytes;
      block = {ptr, false, bytes, c, 0};
    }
    in_use += block.bytes;
    requested += request;
    most_in_use = std::max(most_in_use, in_use);
    most_reserved = std::max(most_reserved, reserved());
    if (slots.size() <= slot) slots.resize(slot + 1);
    slots[slot] = Live{block, request};
  }
  void give_back(const Block& block) {
    if (block.carved) arena.give_back(block.span);
    else small_bins[block.size_class].push_back(block.ptr), small_cached += block.bytes;
  }
  void free(std::uint32_t slot) {
    const Live live = *slots[slot];
    slots[slot].reset();
    in_use -= live.block.bytes;
    requested -= live.requested;
    std::vector<Block> evicted;
    if (!cache.put(live.block, evicted)) give_back(live.block);
    for (const Block& block : evicted) give_back(block);
  }
  Breakdown breakdown() const {
    Breakdown d;
    d.reserved = reserved();
    d.requested = requested;
    d.in_use = in_use;
    d.thread_cache = cache.held_bytes;
    d.small_cached = small_cached;
    d.shared_free = pages.stranded_bytes(arena);
    d.whole_free_pages = pages.free_mapped_pages(arena, SIZE_MAX).size() * opt.page;
    return d;
  }
  // Free spans between live blocks, and those of them that hold no whole page.
  std::pair<std::size_t, std::size_t> holes() const {
    std::size_t holes = 0, within_page = 0;
    arena.for_each_free_range([&](std::uintptr_t a, std::size_t b) {
      if (b > (std::size_t{1} << 36)) return;  // the range's end
      ++holes;
      if ((a + opt.page - 1) / opt.page * opt.page >= (a + b) / opt.page * opt.page) ++within_page;
    });
    return {holes, within_page};
  }
};

std::uint64_t peak_requested(const std::vector<TraceOp>& trace) {
  std::vector<std::uint64_t> bytes;
  std::uint64_t live = 0, peak = 0;
  for (const TraceOp& op : trace) {
    if (bytes.size() <= op.slot) bytes.resize(op.slot + 1);
    if (op.bytes) live += bytes[op.slot] = op.bytes;
    else live -= bytes[op.slot];
    peak = std::max(peak, live);
  }
  return peak;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

void print(const char* what, const Breakdown& d) {
  std::printf("  %-22s reserved %8.1f MiB: requested %8.1f, rounding %5.1f, thread cache %5.1f, "
              "small blocks cached %4.1f, whole free pages %7.1f, free in pages shared with live "
              "blocks %6.1f\n",
              what, mib(d.reserved), mib(d.requested), mib(d.in_use - d.requested),
              mib(d.thread_cache), mib(d.small_cached), mib(d.whole_free_pages), mib(d.shared_free));
}

template <class Arena>
void run(const std::string& name, const std::vector<TraceOp>& trace, const Options& options) {
  Model<Arena> model(options);
  auto replay = [&](auto&& after_each) {
    for (const TraceOp& op : trace) {
      if (op.bytes) model.alloc(op.slot, op.bytes);
      else model.free(op.slot);
      after_each();
    }
  };
  for (int r = 1; r < options.repeat; ++r) replay([] {});
  const std::uint64_t moves = model.moves, mapped = model.pages_mapped, unmapped = model.pages_unmapped;
  std::size_t peak = 0, live_peak = 0, ideal_peak = 0;
  Breakdown at_peak, at_live_peak;
  std::pair<std::size_t, std::size_t> holes;
  std::size_t blocks_at_live_peak = 0;
  replay([&] {
    if (model.reserved() > peak) peak = model.reserved(), at_peak = model.breakdown();
    if (!options.ideal) return;
    const Breakdown now = model.breakdown();
    ideal_peak = std::max(ideal_peak, now.reserved - now.whole_free_pages);
    if (now.requested > live_peak) {
      live_peak = now.requested, at_live_peak = now, holes = model.holes();
      blocks_at_live_peak = 0;
      for (const auto& slot : model.slots) blocks_at_live_peak += slot.has_value();
    }
  });
  const double requested = static_cast<double>(peak_requested(trace));
  std::printf("%-18s peak reserved / peak requested %.4f (peak requested %.1f MiB); %llu moves, "
              "%llu pages mapped, %llu unmapped\n",
              name.c_str(), static_cast<double>(peak) / requested, mib(peak_requested(trace)),
              static_cast<unsigned long long>(model.moves - moves),
              static_cast<unsigned long long>(model.pages_mapped - mapped),
              static_cast<unsigned long long>(model.pages_unmapped - unmapped));
  print("at peak reserved", at_peak);
  if (!options.ideal) return;
  print("at peak requested", at_live_peak);
  std::printf("  at peak requested: %zu live blocks, %zu holes between them (%zu holding no whole page)\n",
              blocks_at_live_peak, holes.first, holes.second);
  std::printf("  every whole free page moved at once: %.4f\n", static_cast<double>(ideal_peak) / requested);
}

int main(int argc, char** argv) {
  Options options;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (arg == "--slack") options.slack = std::atof(value().c_str());
    else if (arg == "--no-moves") options.slack.reset();
    else if (arg == "--no-thread-cache") options.thread_cache = false;
    else if (arg == "--page") options.page = std::strtoull(value().c_str(), nullptr, 10) << 10;
    else if (arg == "--ideal") options.ideal = true;
    else if (arg == "--repeat") options.repeat = std::max(1, std::atoi(value().c_str()));
    else if (arg == "--placement") {
      const std::string p = value();
      placement = p == "best" ? Placement::best : p == "first" ? Placement::first
                : p == "pages" ? Placement::pages : p == "mapped" ? Placement::mapped
                : Placement::good_fit;
    } else if (arg.starts_with("--")) {
      std::fprintf(stderr, "unknown option %s (see the comment at the top of model.cpp)\n", arg.c_str());
      return 2;
    } else {
      files.push_back(arg);
    }
  }
  std::vector<std::pair<std::string, std::vector<TraceOp>>> traces;
  traces.emplace_back("random", random_trace(7, 200'000));
  traces.emplace_back("ann_serving", ann_serving_trace(11, 2000));
  for (const std::string& file : files) {
    std::string name = file.substr(file.find_last_of('/') + 1);
    traces.emplace_back(name.substr(0, name.find('.')), csv_trace(file.c_str()));
  }
  for (const auto& [name, trace] : traces) {
    if (placement == Placement::good_fit) run<SegmentArena>(name, trace, options);
    else run<AltArena>(name, trace, options);
  }
}
