// HostMirrorStreamer: in-place reads of the shared-memory mirror for the CPU backend, or casts
// of the master where the segment keeps no mirror.
#include "worker/pipeline/unit_streamer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace slidedp {

HostMirrorStreamer::HostMirrorStreamer(shm::JobState* state, const ModelLayout& layout, absl::Duration gate_timeout,
                                       Dtype norms, Dtype embedding, UploadSource source, int cast_threads)
    : state_(state),
      publisher_(state->owner()),
      layout_(layout),
      gate_timeout_(gate_timeout),
      norms_(norms),
      embedding_(embedding),
      source_(source) {
  side_.resize(layout.num_units());
  if (source == UploadSource::kMaster) {
    casts_.resize(layout.num_units());
    cast_pool_ = std::make_unique<CastPool>(std::max(1, cast_threads));
  }
  for (int u = 0; u < layout.num_units(); ++u) side_[u].resize(layout.units[u].fp32_numel);
}

absl::StatusOr<UnitParams> HostMirrorStreamer::Acquire(int unit, uint32_t min_version) {
  absl::Time t0 = absl::Now();
  absl::Status s = state_->version(unit).WaitAtLeast(min_version, gate_timeout_, state_->abort(), publisher_);
  gate_wait_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("version gate of unit ", unit, ": ", s.message()));
  const bf16_t* values = state_->mirror(unit);
  if (source_ == UploadSource::kMaster) {
    // Read after the gate, as the mirror would be: the unit's next update needs this step's
    // gradients, so it cannot start before the compute that reads these values.
    Cast& c = casts_[unit];
    if (c.users == 0 || c.gate != min_version) {
      if (c.values.empty() && !spare_.empty()) {
        c.values = std::move(spare_.back());
        spare_.pop_back();
      }
      const int64_t n = layout_.units[unit].numel;
      c.values.resize(n);
      const absl::Time c0 = absl::Now();
      const float* master = state_->master(unit);
      cast_pool_->Cast(master, c.values.data(), n);
      cast_s_ += absl::ToDoubleSeconds(absl::Now() - c0);
      c.gate = min_version;
    }
    c.users++;
    values = c.values.data();
  } else if (values == nullptr) {
    return absl::FailedPreconditionError("the job segment keeps no BF16 mirror (runtime.param_source)");
  }
  if (layout_.units[unit].kind == UnitKind::kEmbedding) {
    return UnitParams(values, embedding_ == Dtype::kF32 ? state_->master(unit) : nullptr);
  }
  std::vector<float>& side = side_[unit];
  if (norms_ != Dtype::kF32 || side.empty()) return UnitParams(values);
  // Read after the gate: the unit's next update needs this step's gradients, so it cannot start
  // before the compute that reads these values.
  CopyNormsFromMaster(layout_.units[unit], state_->master(unit), side.data());
  return UnitParams(values, side.data());
}

void HostMirrorStreamer::Release(int unit) {
  if (source_ != UploadSource::kMaster || unit < 0 || unit >= static_cast<int>(casts_.size())) return;
  Cast& c = casts_[unit];
  if (c.users == 0 || --c.users > 0) return;
  spare_.push_back(std::move(c.values));
  c.values = {};
}

}  // namespace slidedp
