// PolicyCache: the layouts AutoPolicy chose (runtime.policy: auto), kept under the state dir
// (<state_dir>/policies/<key>.yaml) so the next job of the same shape runs its layout at once,
// without probes.
//
// The key is a digest of everything the choice depends on: the workers' build (a measurement by
// another build is stale and re-measured, never trusted), the device, the world size, the model
// shape, the batch (global and micro batch, sequence length) and every runtime setting but the
// policy itself. A file is a policy file (common/policy/layer_policy.h, readable, and runnable as
// runtime.policy: FILE) with its `autopolicy:` measurements, written atomically. A cached file that
// does not parse, names another model, device or build, is ignored (logged) and replaced after the
// next measurement.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/jobspec/job_spec.h"
#include "common/model/model_config.h"
#include "common/policy/layer_policy.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

class PolicyCache {
 public:
  explicit PolicyCache(std::string dir) : dir_(std::move(dir)) {}  // empty: nothing is cached
  bool enabled() const { return !dir_.empty(); }

  // The key's text (what it depends on, one line) and its file.
  static std::string KeyText(const JobSpec& spec, const ModelConfig& config,
                             absl::Span<const v1::WorkerHello> workers);
  std::string PathOf(const std::string& key_text) const;

  // The cached layout for `key_text`, if one exists made by `build` for this model and device;
  // otherwise nullopt, with *why_not saying why (empty: no entry).
  std::optional<LayerLayout> Find(const std::string& key_text, const ModelConfig& config,
                                  const v1::WorkerHello& worker, std::string* why_not) const;
  // Stores a policy file's text (checked: it parses, fits the model and carries measurements).
  absl::Status Store(const std::string& key_text, const std::string& policy_yaml, const ModelConfig& config) const;

 private:
  std::string dir_;
};

}  // namespace slidedp::hostd
