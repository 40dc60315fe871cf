// Reads an events file back, for tests (the unit test of the writer, the integration test of a
// job's file): every record's framing and both CRCs are checked, then each record is parsed as an
// Event. TensorBoard itself is the reader in production; tools/gpu/tensorboard_check.py checks a
// job's file with it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::tensorboard {

// The records' data, in order. DATA_LOSS naming the byte offset for a truncated record or a CRC
// that does not match.
absl::StatusOr<std::vector<std::string>> SplitRecords(absl::string_view file_bytes);

struct ScalarEvent {
  int64_t step = 0;
  double wall_time = 0;
  std::string tag;
  float value = 0;
};

struct EventFileContents {
  std::string file_version;  // of the first event, which must carry one
  double first_wall_time = 0;
  std::vector<ScalarEvent> scalars;  // one per summary value with a simple_value, in file order
};

absl::StatusOr<EventFileContents> ReadEventFile(const std::string& path);

}  // namespace slidedp::tensorboard
