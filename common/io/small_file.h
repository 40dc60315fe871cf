// Bounded, non-blocking reads of the small files a client points hostd at (model config.json,
// dataset manifest.json, safetensors indexes, checkpoint metadata, job records, TLS files).
//
// A path from a spec is hostile: it may name a FIFO (a plain open would block the reading thread
// forever), a device such as /dev/zero (a plain read grows memory without end), or a file far
// larger than its kind ever is. ReadSmallFile opens with O_NONBLOCK, accepts regular files only,
// and refuses anything over `max_bytes` before reading it.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp {

inline constexpr uint64_t kMaxConfigFileBytes = 4ull << 20;     // config.json, trainer_state.json, job records
inline constexpr uint64_t kMaxManifestFileBytes = 64ull << 20;  // manifest.json, *.index.json

// The whole file. NOT_FOUND (missing), PERMISSION_DENIED, INVALID_ARGUMENT (not a regular file,
// or larger than max_bytes: the message names `what`, the size and the limit).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes, absl::string_view what = "file");

}  // namespace slidedp
