// gpupool:timeline — a picture of a trace: the pool's in-use and cached bytes stacked over time,
// the limit as a dashed line, trims as orange and out-of-memory errors as red marks. Plain SVG
// text, so any browser or rsvg-convert shows it.
module;
#include <optional>
#include <string>
export module gpupool:timeline;
import :error;
import :tracing;

export namespace gpupool {

struct TimelineOptions {
  int width = 960;               // pixels, at least 200
  int height = 400;              // pixels, at least 120
  std::string title = "gpupool memory timeline";
  bool by_event = false;         // x = event number instead of time
  std::optional<int> device_id;  // the device to draw; default: the first event's
};

// InvalidInput for a trace without events of the device, or too small a picture.
Result<std::string> timeline_svg(const Trace& trace, const TimelineOptions& options = {});
Result<void> write_timeline_svg(const Trace& trace, const std::string& path,
                                const TimelineOptions& options = {});

}  // namespace gpupool
