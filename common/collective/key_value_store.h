// The rendezvous of a cross-node group (GlooGroup): a key-value store every rank of the job reaches.
// On a multi-node job it is the coordinating hostd's (hostd/mesh: a worker asks its own hostd, which
// asks the coordinator); tests use a directory (FileKeyValueStore).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace slidedp {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Sets `key` once (values are at most a few KiB: addresses).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set, at most `timeout` (DEADLINE_EXCEEDED naming the key).
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

}  // namespace slidedp
