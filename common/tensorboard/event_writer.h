// TensorBoard event files: TFRecord framing of serialized `Event` protos (proto/tensorboard/
// event.proto, TensorFlow's field numbers), scalar summaries only.
//
// A file is what TensorFlow's EventsWriter writes: a first event with file_version
// "brain.Event:2", then one event per step whose Summary holds that step's scalars. Each record
//   uint64 length (little endian) | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data
// is written with one write(2), so it is in the kernel when WriteScalars returns: a crash of the
// writing process loses nothing, and a write cut short leaves only a truncated last record, which
// TensorBoard's reader stops at.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace slidedp::tensorboard {

inline constexpr absl::string_view kFileVersion = "brain.Event:2";

struct Scalar {
  std::string tag;  // e.g. "train/loss"; TensorBoard groups by the part before '/'
  float value;      // Summary.Value.simple_value is a float32
};

// One TFRecord: length, masked CRC of the length, data, masked CRC of the data.
std::string FrameRecord(absl::string_view data);

// TensorFlow's name, which TensorBoard looks for ("tfevents" in it), with TF Python's and
// PyTorch's pid and per-process counter so that two files of one process never collide:
// events.out.tfevents.<unix seconds, 10 digits>.<host>.<pid>.<uid>.slidedp
std::string EventFileName(int64_t unix_seconds, absl::string_view host, int pid, int64_t uid);

class EventFileWriter {
 public:
  // Creates `dir` (and its parents) and a new events file in it named by EventFileName, and
  // writes the file_version event. Errors name the path.
  static absl::StatusOr<std::unique_ptr<EventFileWriter>> Create(const std::string& dir, absl::Time now);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One event at `step` whose summary holds `scalars` (in this order).
  absl::Status WriteScalars(int64_t step, absl::Time wall_time, absl::Span<const Scalar> scalars);

  const std::string& path() const { return path_; }

 private:
  EventFileWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  absl::Status WriteRecord(absl::string_view data);

  int fd_;
  std::string path_;
};

}  // namespace slidedp::tensorboard
