// The host's memory as /proc/meminfo says it: what hostd's admission checks a job against and what
// a worker's AutoPolicy may pin for offloaded checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace slidedp {

struct MemInfo {
  uint64_t total_bytes = 0;      // MemTotal
  uint64_t available_bytes = 0;  // MemAvailable
};

// NOT_FOUND when the file cannot be read; DATA_LOSS when it has no MemTotal or MemAvailable line.
absl::StatusOr<MemInfo> ReadMemInfo(const std::string& path = "/proc/meminfo");

}  // namespace slidedp
