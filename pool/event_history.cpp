// History: PoolRecorder's ring buffer of events, and trace files (CSV, JSON) written and read.
module;
#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>
module gpupool;
import :device_pool;
import :pool_policies;
import :pool_access;
import :recorder;

namespace gpupool {

// ---- the ring buffer ----------------------------------------------------------------------------

void PoolRecorder::record(TraceEvent event) {
  event.seq = next_seq_++;
  if (ring_.empty()) return;
  ring_[event.seq % ring_.size()] = event;
}

Trace PoolRecorder::history() const {
  std::lock_guard lock(mutex_);
  Trace trace;
  if (ring_.empty()) return trace;
  const std::uint64_t kept = std::min<std::uint64_t>(next_seq_, ring_.size());
  trace.dropped = next_seq_ - kept;
  trace.events.reserve(kept);
  for (std::uint64_t seq = trace.dropped; seq < next_seq_; ++seq) trace.events.push_back(ring_[seq % ring_.size()]);
  return trace;
}

Trace history(const GpuMemoryPool& pool) {
  PoolPolicies& policies = PoolAccess::policies(pool);
  std::lock_guard lock(policies.mutex);
  return policies.recorder_owner ? policies.recorder_owner->history() : Trace{};
}

std::size_t Trace::peak_reserved_bytes() const noexcept {
  std::size_t peak = 0;
  for (const TraceEvent& event : events) peak = std::max(peak, event.reserved_bytes);
  return peak;
}

std::string_view to_string(TraceEventKind kind) noexcept {
  switch (kind) {
    case TraceEventKind::Alloc: return "alloc";
    case TraceEventKind::Free: return "free";
    case TraceEventKind::Trim: return "trim";
    case TraceEventKind::Oom: return "oom";
  }
  return "?";
}

namespace {

constexpr TraceEventKind kAllKinds[] = {TraceEventKind::Alloc, TraceEventKind::Free,
                                        TraceEventKind::Trim, TraceEventKind::Oom};
constexpr std::string_view kCsvHeader =
    "seq,time_ns,event,device,id,bytes,block_bytes,precision,stream,in_use_bytes,reserved_bytes,"
    "limit_bytes";
constexpr std::size_t kCsvFields = 12;

std::optional<TraceEventKind> parse_kind(std::string_view text) {
  for (TraceEventKind kind : kAllKinds)
    if (to_string(kind) == text) return kind;
  return std::nullopt;
}

template <class Int>
std::optional<Int> parse_int(std::string_view text) {
  Int value{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::vector<std::string_view> split(std::string_view line, char separator) {
  std::vector<std::string_view> fields;
  for (std::size_t start = 0;;) {
    std::size_t end = line.find(separator, start);
    fields.push_back(line.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return fields;
    start = end + 1;
  }
}

std::unexpected<GpuError> bad_trace(std::string what) {
  return make_error(ErrorKind::InvalidInput, "trace: " + std::move(what));
}

Result<TraceEvent> parse_csv_event(std::string_view line, std::size_t line_number) {
  auto fields = split(line, ',');
  if (fields.size() != kCsvFields)
    return bad_trace(fmt::format("line {} has {} fields: expected {} ({})", line_number,
                                 fields.size(), kCsvFields, kCsvHeader));
  TraceEvent event;
  auto kind = parse_kind(fields[2]);
  auto precision = parse_precision(fields[7]);
  auto device = parse_int<int>(fields[3]);
  if (!kind || !precision || !device)
    return bad_trace(fmt::format("line {}: event \"{}\", device \"{}\" or precision \"{}\" is not "
                                 "one of alloc|free|trim|oom, an integer, fp32|fp16|bf16|int8|bytes",
                                 line_number, fields[2], fields[3], fields[7]));
  event.kind = *kind;
  event.precision = *precision;
  event.device_id = *device;
  std::uint64_t* numbers[] = {&event.seq, &event.time_ns, nullptr, nullptr, &event.id};
  for (std::size_t i : {0u, 1u, 4u})
    if (auto value = parse_int<std::uint64_t>(fields[i])) *numbers[i] = *value;
    else return bad_trace(fmt::format("line {} field {} is \"{}\": expected an unsigned integer",
                                      line_number, i + 1, fields[i]));
  std::size_t* sizes[] = {&event.bytes, &event.block_bytes, nullptr, nullptr, &event.in_use_bytes,
                          &event.reserved_bytes, &event.limit_bytes};
  for (std::size_t i : {5u, 6u, 9u, 10u, 11u})
    if (auto value = parse_int<std::size_t>(fields[i])) *sizes[i - 5] = *value;
    else return bad_trace(fmt::format("line {} field {} is \"{}\": expected a byte count",
                                      line_number, i + 1, fields[i]));
  if (auto stream = parse_int<std::uintptr_t>(fields[8])) event.stream = *stream;
  else return bad_trace(fmt::format("line {} field 9 is \"{}\": expected a stream number",
                                    line_number, fields[8]));
  return event;
}

Result<Trace> parse_csv(std::string_view text) {
  Trace trace;
  std::size_t line_number = 0;
  for (std::string_view line : split(text, '\n')) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    if (line.starts_with("# dropped ")) {
      auto dropped = parse_int<std::uint64_t>(line.substr(10));
      if (!dropped) return bad_trace(fmt::format("line {}: \"{}\": expected # dropped N", line_number, line));
      trace.dropped = *dropped;
      continue;
    }
    if (line == kCsvHeader) continue;
    auto event = parse_csv_event(line, line_number);
    if (!event) return std::unexpected(event.error());
    trace.events.push_back(*event);
  }
  return trace;
}

Result<Trace> parse_json(std::string_view text) {
  nlohmann::json document = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded()) return bad_trace("the text is not valid JSON");
  if (!document.is_object() || document.value("format", "") != "gpupool-trace" ||
      !document.contains("events") || !document["events"].is_array())
    return bad_trace("expected an object with \"format\": \"gpupool-trace\" and an \"events\" array");
  Trace trace;
  if (document.contains("dropped") && document["dropped"].is_number_unsigned())
    trace.dropped = document["dropped"].get<std::uint64_t>();
  std::size_t index = 0;
  for (const nlohmann::json& item : document["events"]) {
    auto field = [&](const char* name) -> std::optional<std::uint64_t> {
      if (!item.is_object() || !item.contains(name) || !item[name].is_number_unsigned()) return std::nullopt;
      return item[name].get<std::uint64_t>();
    };
    TraceEvent event;
    const char* names[] = {"seq", "time_ns", "id", "bytes", "block_bytes", "stream",
                           "in_use_bytes", "reserved_bytes", "limit_bytes"};
    std::uint64_t values[9];
    for (int i = 0; i < 9; ++i) {
      auto value = field(names[i]);
      if (!value) return bad_trace(fmt::format("event {}: \"{}\" is missing or not an unsigned integer", index, names[i]));
      values[i] = *value;
    }
    std::optional<TraceEventKind> kind;
    std::optional<Precision> precision;
    if (item.contains("event") && item["event"].is_string()) kind = parse_kind(item["event"].get<std::string>());
    if (item.contains("precision") && item["precision"].is_string())
      precision = parse_precision(item["precision"].get<std::string>());
    if (!kind || !precision || !item.contains("device") || !item["device"].is_number_integer())
      return bad_trace(fmt::format("event {}: \"event\", \"precision\" or \"device\" is missing or "
                                   "not alloc|free|trim|oom, a precision name, an integer", index));
    event = {values[0], values[1], *kind, item["device"].get<int>(), values[2], values[3], values[4],
             *precision, static_cast<std::uintptr_t>(values[5]), values[6], values[7], values[8]};
    trace.events.push_back(event);
    ++index;
  }
  return trace;
}

}  // namespace

std::string to_csv(const Trace& trace) {
  std::string text;
  if (trace.dropped) text += fmt::format("# dropped {}\n", trace.dropped);
  text += kCsvHeader;
  text += '\n';
  for (const TraceEvent& e : trace.events)
    text += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{}\n", e.seq, e.time_ns, to_string(e.kind),
                        e.device_id, e.id, e.bytes, e.block_bytes, to_string(e.precision), e.stream,
                        e.in_use_bytes, e.reserved_bytes, e.limit_bytes);
  return text;
}

std::string to_json(const Trace& trace) {
  nlohmann::json events = nlohmann::json::array();
  for (const TraceEvent& e : trace.events)
    events.push_back({{"seq", e.seq}, {"time_ns", e.time_ns}, {"event", to_string(e.kind)},
                      {"device", e.device_id}, {"id", e.id}, {"bytes", e.bytes},
                      {"block_bytes", e.block_bytes}, {"precision", to_string(e.precision)},
                      {"stream", e.stream}, {"in_use_bytes", e.in_use_bytes},
                      {"reserved_bytes", e.reserved_bytes}, {"limit_bytes", e.limit_bytes}});
  nlohmann::json document = {{"format", "gpupool-trace"}, {"version", 1},
                             {"dropped", trace.dropped}, {"events", std::move(events)}};
  return document.dump(1);
}

Result<Trace> parse_trace(std::string_view text) {
  auto first = text.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && text[first] == '{') return parse_json(text);
  return parse_csv(text);
}

Result<void> write_trace(const Trace& trace, const std::string& path, TraceFormat format) {
  std::ofstream file(path, std::ios::binary);
  if (file) file << (format == TraceFormat::Csv ? to_csv(trace) : to_json(trace));
  if (!file.good())
    return make_error(ErrorKind::Io, fmt::format("cannot write the trace file \"{}\"", path));
  return {};
}

Result<Trace> read_trace(const std::string& path) {
  // A folder, FIFO or device is refused before it is opened (a FIFO would block the open).
  std::error_code error;
  if (std::filesystem::exists(path, error) && !std::filesystem::is_regular_file(path, error))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the trace \"{}\" is not a regular file (a folder, pipe or "
                                  "device); expected a .csv or .json trace", path));
  std::ifstream file(path, std::ios::binary);
  if (!file) return make_error(ErrorKind::Io, fmt::format("cannot open the trace file \"{}\"", path));
  std::stringstream text;
  text << file.rdbuf();
  auto trace = parse_trace(text.str());
  if (!trace) return std::unexpected(trace.error().with_context(path));
  if (trace->events.empty())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the trace \"{}\" holds no events; expected a trace the pool "
                                  "recorded (docs/diagnostics.md)", path));
  return trace;
}

}  // namespace gpupool
