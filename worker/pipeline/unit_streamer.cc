// HostMirrorStreamer: in-place reads of the shared-memory mirror for the CPU backend.
#include "worker/pipeline/unit_streamer.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace slidedp {

HostMirrorStreamer::HostMirrorStreamer(shm::JobState* state, const ModelLayout& layout, absl::Duration gate_timeout,
                                       NormValues norms, EmbeddingValues embedding)
    : state_(state),
      publisher_(state->owner()),
      layout_(layout),
      gate_timeout_(gate_timeout),
      norms_(norms),
      embedding_(embedding) {
  side_.resize(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) side_[u].resize(layout.units[u].fp32_numel);
}

absl::StatusOr<UnitParams> HostMirrorStreamer::Acquire(int unit, uint32_t min_version) {
  absl::Time t0 = absl::Now();
  absl::Status s = state_->version(unit).WaitAtLeast(min_version, gate_timeout_, state_->abort(), publisher_);
  gate_wait_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("version gate of unit ", unit, ": ", s.message()));
  if (layout_.units[unit].kind == UnitKind::kEmbedding) {
    return UnitParams(state_->mirror(unit),
                      embedding_ == EmbeddingValues::kFp32FromMaster ? state_->master(unit) : nullptr);
  }
  std::vector<float>& side = side_[unit];
  if (norms_ != NormValues::kFp32FromMaster || side.empty()) return UnitParams(state_->mirror(unit));
  // Read after the gate: the unit's next update needs this step's gradients, so it cannot start
  // before the compute that reads these values.
  CopyNormsFromMaster(layout_.units[unit], state_->master(unit), side.data());
  return UnitParams(state_->mirror(unit), side.data());
}

}  // namespace slidedp
