// HostMirrorStreamer: in-place reads of the shared-memory mirror for the CPU backend.
#include "worker/pipeline/unit_streamer.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace slidedp {

absl::StatusOr<const bf16_t*> HostMirrorStreamer::Acquire(int unit, uint32_t min_version) {
  absl::Time t0 = absl::Now();
  absl::Status s = state_->version(unit).WaitAtLeast(min_version, gate_timeout_, state_->abort(), state_->owner());
  gate_wait_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("version gate of unit ", unit, ": ", s.message()));
  return state_->mirror(unit);
}

}  // namespace slidedp
